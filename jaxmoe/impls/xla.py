"""Grouped execution of the routed experts in plain XLA ops (``impl="xla"``).

``xla`` (the default on CPU and Intel GPUs): the ``P = T * k`` (token, slot) pairs are
sorted by expert (`jaxmoe.dispatch.plan_dispatch`); a loop runs over the experts that
received at least one pair, in increasing id order; for each it takes that expert's
weights once (dequantizing a `QuantizedTensor` expert there, so only selected experts
are ever dequantized) and runs plain 2-D dots over its sorted rows in chunks of
``block_m`` rows. The work grows with ``T * k`` (plus one weight read per selected
expert), never with ``E * T``. Rows are written back in sorted order; a chunk that runs
past its expert's rows writes rows of later experts, which those experts overwrite,
so no masking is needed and every row is written exactly by its own expert last.
Finally each pair's row is weighted and summed back to its token in a fixed order
(deterministic).

See benchmarks/README.md for the layouts measured on CPU and why this one won.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxmoe.config import MoEConfig
from jaxmoe.dispatch import plan_dispatch
from jaxmoe.experts import ExpertWeights, activation, mm
from jaxmoe.impls.common import check_inputs, combine, sorted_inputs
from jaxmoe.invariance import ROW_BLOCK, wants_invariance
from jaxmoe.quant import materialize
from jaxmoe.routing import Routing

#: Largest row chunk of one expert dot.
MAX_BLOCK_M = 256


def choose_block_m(num_pairs: int, num_experts: int) -> int:
    """Row chunk for the expert dots: the power of two at or above the mean rows per
    expert ``P / E``, within ``[1, MAX_BLOCK_M]``."""
    mean = -(-num_pairs // num_experts)
    return int(min(MAX_BLOCK_M, 1 << max(0, (mean - 1).bit_length())))


def experts_xla(
    x: jax.Array, routing: Routing, ew: ExpertWeights, cfg: MoEConfig, block_m: int | None = None
) -> jax.Array:
    """Sorted grouped SwiGLU in plain XLA ops. ``x [T, d]`` -> ``[T, d]`` float32.

    Args:
      x: ``[T, d]`` activations (compute dtype).
      routing: ``expert_ids, weights [T, k]``.
      ew: `ExpertWeights` ``[E, ...]``, arrays or `QuantizedTensor`.
      cfg: the layer config (activation, biases, ``weight_on_input``).
      block_m: rows per expert dot (default `choose_block_m`; `jaxmoe.invariance.ROW_BLOCK`
        when ``cfg`` asks for batch invariance).
    """
    check_inputs(x, routing, ew, "experts_xla")
    t, k = routing.expert_ids.shape
    if block_m is not None and (not isinstance(block_m, int) or block_m < 1):
        raise ValueError(f"experts_xla: block_m must be a positive int, got {block_m!r}")
    if block_m is None:  # batch-invariant: one chunk shape whatever T is (jaxmoe.invariance)
        block_m = ROW_BLOCK if wants_invariance(cfg, "xla") else choose_block_m(t * k, ew.num_experts)
    return _experts_xla(x, routing, ew, cfg=cfg, block_m=block_m)


@functools.partial(jax.jit, static_argnames=("cfg", "block_m"))
def _experts_xla(x: jax.Array, routing: Routing, ew: ExpertWeights, cfg: MoEConfig, block_m: int) -> jax.Array:
    t, d = x.shape
    k = routing.expert_ids.shape[1]
    e = ew.num_experts
    p = t * k
    bm = block_m
    dt = x.dtype
    with jax.named_scope("dispatch"):
        plan = plan_dispatch(routing.expert_ids, e, bm)
        xs = sorted_inputs(x, routing, plan, cfg)
        xs = jnp.pad(xs, ((0, bm), (0, 0)))  # [P + bm, d]: the last chunk may run past P
        n_slots = min(e, p)
        active = jnp.nonzero(plan.group_sizes > 0, size=n_slots, fill_value=0)[0].astype(jnp.int32)  # [n_slots]
        n_active = jnp.sum(plan.group_sizes > 0, dtype=jnp.int32)

    def expert_body(i, ys):
        ex = active[i]
        start = plan.group_offsets[ex]
        n = plan.group_sizes[ex]
        one = ew.take(ex)  # this expert only: the sole read (and dequantization) of its weights
        wg, wu, wd = (materialize(w, dt) for w in (one.w_gate, one.w_up, one.w_down))  # [d,F] [d,F] [F,d]
        bias = one.biases_f32()

        def chunk_body(j, ys):
            r0 = start + j * bm
            xb = jax.lax.dynamic_slice_in_dim(xs, r0, bm)  # [bm, d]
            g = mm("md,df->mf", xb, wg)  # [bm, F]
            u = mm("md,df->mf", xb, wu)
            if bias is not None:
                g, u = g + bias[0], u + bias[1]
            h = activation(g, u, cfg).astype(dt)
            y = mm("mf,fd->md", h, wd)  # [bm, d]
            if bias is not None:
                y = y + bias[2]
            return jax.lax.dynamic_update_slice_in_dim(ys, y, r0, axis=0)

        return jax.lax.fori_loop(0, (n + bm - 1) // bm, chunk_body, ys)

    with jax.named_scope("grouped_swiglu"):
        ys = jax.lax.fori_loop(0, n_active, expert_body, jnp.zeros((p + bm, d), jnp.float32))
    with jax.named_scope("combine"):
        return combine(ys[:p], routing, plan, cfg, invariant=wants_invariance(cfg, "xla"))

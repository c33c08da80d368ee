"""Grouped execution of the routed experts in plain XLA ops (``impl="xla"``, ``"ragged_dot"``).

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

``ragged_dot``: `jax.lax.ragged_dot` over the same sorted rows, for comparison only
(XLA expands it to a masked dense dot over all experts).

See benchmarks/README.md for the layouts measured on CPU and why this one won.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxmoe.backends import register_impl
from jaxmoe.config import MoEConfig
from jaxmoe.dispatch import plan_dispatch
from jaxmoe.experts import ExpertWeights, activation, mm
from jaxmoe.quant import materialize
from jaxmoe.routing import Routing

_HI = jax.lax.Precision.HIGHEST

#: Largest row chunk of one expert dot.
MAX_BLOCK_M = 256


def choose_block_m(num_pairs: int, num_experts: int) -> int:
    """Row chunk for the expert dots: the power of two at or above the mean rows per
    expert ``P / E``, within ``[1, MAX_BLOCK_M]``."""
    mean = -(-num_pairs // num_experts)
    return int(min(MAX_BLOCK_M, 1 << max(0, (mean - 1).bit_length())))


def _check(x: jax.Array, routing: Routing, ew: ExpertWeights, name: str) -> None:
    if x.ndim != 2:
        raise ValueError(f"{name}: x must be [T, d], got shape {x.shape}")
    if routing.expert_ids.ndim != 2 or routing.expert_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"{name}: routing.expert_ids must be [T, k] with T = {x.shape[0]}, got {routing.expert_ids.shape}"
        )
    if routing.weights.shape != routing.expert_ids.shape:
        raise ValueError(f"{name}: routing.weights {routing.weights.shape} != expert_ids {routing.expert_ids.shape}")
    if ew.w_gate.shape[-2] != x.shape[1]:
        raise ValueError(f"{name}: experts.w_gate {tuple(ew.w_gate.shape)} does not take x of width {x.shape[1]}")


def _sorted_inputs(x: jax.Array, routing: Routing, plan, cfg: MoEConfig):
    """Rows of ``x`` in sorted pair order ``[P, d]`` (weighted when ``weight_on_input``)."""
    p = plan.num_pairs
    xs = x[plan.token_idx]  # [P, d]
    if cfg.weight_on_input:
        ws = routing.weights.reshape(p)[plan.sort_idx]  # [P]
        xs = (xs.astype(jnp.float32) * ws[:, None]).astype(x.dtype)
    return xs


def _combine(ys: jax.Array, routing: Routing, plan, cfg: MoEConfig) -> jax.Array:
    """Sorted rows ``[P, d]`` -> tokens ``[T, d]`` float32 (routing weight unless on input)."""
    t, k = routing.expert_ids.shape
    y = ys[plan.inv].reshape(t, k, -1)  # [T, k, d]
    if not cfg.weight_on_input:
        y = y * routing.weights[..., None]
    return y.sum(axis=1)


def experts_xla(
    x: jax.Array, routing: Routing, ew: ExpertWeights, cfg: MoEConfig, block_m: int | None = None
) -> jax.Array:
    """Sorted grouped SwiGLU in plain XLA ops. ``x [T, d]`` -> ``[T, d]`` float32.

    Args:
      x: ``[T, d]`` activations (compute dtype).
      routing: ``expert_ids, weights [T, k]``.
      ew: `ExpertWeights` ``[E, ...]``, arrays or `QuantizedTensor`.
      cfg: the layer config (activation, biases, ``weight_on_input``).
      block_m: rows per expert dot (default `choose_block_m`).
    """
    _check(x, routing, ew, "experts_xla")
    t, k = routing.expert_ids.shape
    if block_m is not None and (not isinstance(block_m, int) or block_m < 1):
        raise ValueError(f"experts_xla: block_m must be a positive int, got {block_m!r}")
    return _experts_xla(x, routing, ew, cfg=cfg, block_m=block_m or choose_block_m(t * k, ew.num_experts))


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
        xs = _sorted_inputs(x, routing, plan, cfg)
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
        bias = None
        if one.b_gate is not None:
            bias = tuple(b.astype(jnp.float32) for b in (one.b_gate, one.b_up, one.b_down))

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
        return _combine(ys[:p], routing, plan, cfg)


def _ragged(a: jax.Array, b: jax.Array, gs: jax.Array) -> jax.Array:
    """``ragged_dot(a [P, K], b [E, K, N], gs [E]) -> [P, N]`` float32 (operands upcast on CPU, as `mm`)."""
    if a.dtype != jnp.float32 and jax.default_backend() == "cpu":
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jax.lax.ragged_dot(a, b, gs, precision=_HI, preferred_element_type=jnp.float32)


def experts_ragged_dot(x: jax.Array, routing: Routing, ew: ExpertWeights, cfg: MoEConfig) -> jax.Array:
    """`jax.lax.ragged_dot` over the sorted rows (comparison only). ``x [T, d]`` -> ``[T, d]`` float32."""
    _check(x, routing, ew, "experts_ragged_dot")
    return _experts_ragged_dot(x, routing, ew, cfg=cfg)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _experts_ragged_dot(x: jax.Array, routing: Routing, ew: ExpertWeights, cfg: MoEConfig) -> jax.Array:
    dt = x.dtype
    plan = plan_dispatch(routing.expert_ids, ew.num_experts, 1)
    xs = _sorted_inputs(x, routing, plan, cfg)
    gs = plan.group_sizes
    wg, wu, wd = (materialize(w, dt) for w in (ew.w_gate, ew.w_up, ew.w_down))
    g = _ragged(xs, wg, gs)  # [P, F]
    u = _ragged(xs, wu, gs)
    if ew.b_gate is not None:
        eid = jnp.repeat(jnp.arange(ew.num_experts), gs, total_repeat_length=plan.num_pairs)  # [P]
        g = g + ew.b_gate.astype(jnp.float32)[eid]
        u = u + ew.b_up.astype(jnp.float32)[eid]
    h = activation(g, u, cfg).astype(dt)
    y = _ragged(h, wd, gs)  # [P, d]
    if ew.b_down is not None:
        y = y + ew.b_down.astype(jnp.float32)[eid]
    return _combine(y, routing, plan, cfg)


register_impl("xla", experts_xla)
register_impl("ragged_dot", experts_ragged_dot)

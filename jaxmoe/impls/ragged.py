"""``impl="ragged_dot"``: `jax.lax.ragged_dot` over the expert-sorted rows, for comparison only.

XLA:CPU (and the Intel plugin) expand ``ragged_dot`` to a masked dense dot over all
experts, so this is not a fast path there; it is the peer the benchmarks compare to.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxmoe.config import MoEConfig
from jaxmoe.dispatch import plan_dispatch
from jaxmoe.experts import ExpertWeights, activation, dot_f32, freeze
from jaxmoe.impls.common import check_inputs, combine, sorted_inputs
from jaxmoe.invariance import ROW_BLOCK, row_blocks, wants_invariance
from jaxmoe.quant import materialize
from jaxmoe.routing import Routing

_HI = jax.lax.Precision.HIGHEST


def _ragged(a: jax.Array, b: jax.Array, gs: jax.Array) -> jax.Array:
    """``ragged_dot(a [P, K], b [E, K, N], gs [E]) -> [P, N]`` float32 (`jaxmoe.experts.dot_f32`)."""
    return dot_f32(lambda a, b: jax.lax.ragged_dot(a, b, gs, precision=_HI, preferred_element_type=jnp.float32), a, b)


def experts_ragged_dot(x: jax.Array, routing: Routing, ew: ExpertWeights, cfg: MoEConfig) -> jax.Array:
    """`jax.lax.ragged_dot` over the sorted rows (comparison only). ``x [T, d]`` -> ``[T, d]`` float32."""
    check_inputs(x, routing, ew, "experts_ragged_dot")
    return _experts_ragged_dot(x, routing, freeze(ew), cfg=cfg)  # quantized experts: frozen


@functools.partial(jax.jit, static_argnames=("cfg",))
def _experts_ragged_dot(x: jax.Array, routing: Routing, ew: ExpertWeights, cfg: MoEConfig) -> jax.Array:
    plan = plan_dispatch(routing.expert_ids, ew.num_experts, 1)
    xs = sorted_inputs(x, routing, plan, cfg)
    if not wants_invariance(cfg, "ragged_dot"):
        y = _grouped(xs, plan.group_sizes, ew, cfg)
    else:  # fixed-shape blocks of sorted rows, each with the group sizes clipped to it
        p = plan.num_pairs
        starts = plan.group_offsets[:-1]
        ends = plan.group_offsets[1:]

        def block(r, ew, starts, ends):
            xb, r0 = r
            lo = r0[0]
            gs = jnp.clip(ends, lo, lo + ROW_BLOCK) - jnp.clip(starts, lo, lo + ROW_BLOCK)
            return _grouped(xb, gs, ew, cfg)

        r0 = jnp.arange(p, dtype=jnp.int32) // ROW_BLOCK * ROW_BLOCK  # each row's block start
        y = row_blocks(block, (xs, r0), ew, starts, ends)
    return combine(y, routing, plan, cfg, invariant=wants_invariance(cfg, "ragged_dot"))


def _grouped(xs: jax.Array, gs: jax.Array, ew: ExpertWeights, cfg: MoEConfig) -> jax.Array:
    """``xs [P, d]`` rows grouped by ``gs [E]`` -> ``[P, d]`` float32."""
    dt = xs.dtype
    wg, wu, wd = (materialize(w, dt) for w in (ew.w_gate, ew.w_up, ew.w_down))
    g = _ragged(xs, wg, gs)  # [P, F]
    u = _ragged(xs, wu, gs)
    bias = ew.biases_f32()
    eid = jnp.repeat(jnp.arange(ew.num_experts), gs, total_repeat_length=xs.shape[0])  # [P]
    if bias is not None:
        g = g + bias[0][eid]
        u = u + bias[1][eid]
    h = activation(g, u, cfg).astype(dt)
    y = _ragged(h, wd, gs)  # [P, d]
    if bias is not None:
        y = y + bias[2][eid]
    return y

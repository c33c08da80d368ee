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
from jaxmoe.execution import ExecConfig
from jaxmoe.experts import ExpertWeights, dot_f32, freeze, swiglu
from jaxmoe.ggml_activations import prepare
from jaxmoe.impls.common import check_inputs, combine, sorted_inputs
from jaxmoe.invariance import ROW_BLOCK, row_blocks
from jaxmoe.routing import Routing

_HI = jax.lax.Precision.HIGHEST


def experts_ragged_dot(
    x: jax.Array, routing: Routing, ew: ExpertWeights, cfg: MoEConfig, ex: ExecConfig | None = None
) -> jax.Array:
    """`jax.lax.ragged_dot` over the sorted rows (comparison only). ``x [T, d]`` -> ``[T, d]`` float32.

    ``ex.batch_invariant``: fixed-shape blocks of sorted rows; ``ex.platform``: the lowering
    platform group (`jaxmoe.experts.dot_f32`)."""
    ex = ex or ExecConfig()
    check_inputs(x, routing, ew, "experts_ragged_dot")
    return _experts_ragged_dot(x, routing, freeze(ew), cfg, ex.batch_invariant, ex.group, ex.activations)  # frozen


@functools.partial(jax.jit, static_argnums=(3, 4, 5, 6))
def _experts_ragged_dot(
    x: jax.Array, routing: Routing, ew: ExpertWeights, cfg: MoEConfig, invariant: bool, platform: str, activations: str
) -> jax.Array:
    plan = plan_dispatch(routing.expert_ids, ew.num_experts, 1)
    xs = sorted_inputs(x, routing, plan, cfg)
    if not invariant:
        y = _grouped(xs, plan.group_sizes, ew, cfg, platform, activations)
    else:  # fixed-shape blocks of sorted rows, each with the group sizes clipped to it
        p = plan.num_pairs
        starts = plan.group_offsets[:-1]
        ends = plan.group_offsets[1:]

        def block(r, ew, starts, ends):
            xb, r0 = r
            lo = r0[0]
            gs = jnp.clip(ends, lo, lo + ROW_BLOCK) - jnp.clip(starts, lo, lo + ROW_BLOCK)
            return _grouped(xb, gs, ew, cfg, platform, activations)

        r0 = jnp.arange(p, dtype=jnp.int32) // ROW_BLOCK * ROW_BLOCK  # each row's block start
        y = row_blocks(block, (xs, r0), ew, starts, ends)
    return combine(y, routing, plan, cfg, invariant=invariant)


def _grouped(
    xs: jax.Array, gs: jax.Array, ew: ExpertWeights, cfg: MoEConfig, platform: str, activations: str
) -> jax.Array:
    """``xs [P, d]`` rows grouped by ``gs [E]`` -> ``[P, d]`` float32."""
    dt = xs.dtype
    wg, wu, wd = (prepare(w, dt, activations) for w in (ew.w_gate, ew.w_up, ew.w_down))
    bias = ew.biases_f32()
    if bias is not None:
        eid = jnp.repeat(jnp.arange(ew.num_experts), gs, total_repeat_length=xs.shape[0])  # [P]
        bias = tuple(b[eid] for b in bias)

    def ragged(a: jax.Array, b: jax.Array) -> jax.Array:  # [P, K] x [E, K, N] -> [P, N] float32
        return dot_f32(
            lambda a, b: jax.lax.ragged_dot(a, b, gs, precision=_HI, preferred_element_type=jnp.float32),
            a,
            b,
            platform,
        )

    return swiglu(xs, wg, wu, wd, cfg, ragged, bias)

"""Steps every grouped strategy shares: input checks, rows in sorted pair order, and
the weighted combine back to tokens.

The grouped strategies (`jaxmoe.impls.xla`, `jaxmoe.impls.ragged`, `jaxmoe.impls.cpu`)
sort the ``P = T * k`` (token, slot) pairs by expert with `jaxmoe.dispatch.plan_dispatch`,
run each expert over its contiguous rows, and sum each token's slots back in slot order.

Expert ids outside ``[0, E)``: `check_inputs` raises for them when the routing is
concrete; under ``jit`` the plan drops such pairs (never computed) and `combine` adds
exactly zero for them (docs/routing.md, "Invalid expert ids").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmoe.config import MoEConfig
from jaxmoe.dispatch import DispatchPlan, check_expert_ids
from jaxmoe.experts import ExpertWeights
from jaxmoe.invariance import slot_sum
from jaxmoe.routing import Routing


def check_inputs(x: jax.Array, routing: Routing, ew: ExpertWeights, name: str) -> None:
    """ValueError naming ``name`` unless ``x [T, d]``, ``routing [T, k]`` (integer ids, in
    ``[0, E)`` when concrete; float weights) and the experts agree."""
    if x.ndim != 2:
        raise ValueError(f"{name}: x must be [T, d], got shape {x.shape}")
    check_expert_ids(routing.expert_ids, ew.num_experts, name, shape=(x.shape[0], None), weights=routing.weights)
    if ew.w_gate.shape[-2] != x.shape[1]:
        raise ValueError(f"{name}: experts.w_gate {tuple(ew.w_gate.shape)} does not take x of width {x.shape[1]}")


def sorted_inputs(x: jax.Array, routing: Routing, plan: DispatchPlan, cfg: MoEConfig):
    """Rows of ``x`` in sorted pair order ``[P, d]`` (weighted when ``weight_on_input``)."""
    p = plan.num_pairs
    xs = x[plan.token_idx]  # [P, d]
    if cfg.weight_on_input:
        ws = routing.weights.reshape(p)[plan.sort_idx]  # [P]
        xs = (xs.astype(jnp.float32) * ws[:, None]).astype(x.dtype)
    return xs


def combine(
    ys: jax.Array, routing: Routing, plan: DispatchPlan, cfg: MoEConfig, *, invariant: bool = False
) -> jax.Array:
    """Sorted rows ``[P, d]`` -> tokens ``[T, d]`` float32 (routing weight unless on input),
    each token's slots added in slot order (`jaxmoe.invariance.slot_sum`; ``invariant``:
    the batch-invariant form).

    A dropped pair (id outside ``[0, E)``) adds exactly zero, whatever its row holds (the
    rows past ``plan.num_valid`` are never computed and may be uninitialized).
    """
    t, k = routing.expert_ids.shape
    y = ys[plan.inv].reshape(t, k, -1)  # [T, k, d]
    scale = None if cfg.weight_on_input else routing.weights
    return slot_sum(y, scale, plan.pair_valid().reshape(t, k), invariant=invariant)

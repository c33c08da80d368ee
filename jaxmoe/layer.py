"""The MoE layer as a pure function of a parameter pytree.

``y = moe_apply(params, x, cfg, impl=...)``: router logits (float32), `route`, the
routed experts by the chosen implementation (`jaxmoe.impls`), plus the shared expert.
`MoEBlock` holds the same parameters as Flax NNX variables and calls this function.
`MoEParams`, `init_params`, `params_from_sampler` and `compute_routing` live in
`jaxmoe.params` and are re-exported here.
"""

from __future__ import annotations

import functools

import jax

from jaxmoe.config import MoEConfig
from jaxmoe.dispatch import check_expert_ids
from jaxmoe.experts import SharedWeights, shared_expert
from jaxmoe.impls.cpu import shared_expert_cpu, shared_supported
from jaxmoe.impls.policy import call_impl, resolve_impl
from jaxmoe.invariance import wants_invariance
from jaxmoe.params import MoEParams, compute_routing, init_params, params_from_sampler
from jaxmoe.routing import Routing

__all__ = ["MoEParams", "compute_routing", "init_params", "moe_apply", "params_from_sampler"]


def moe_apply(
    params: MoEParams,
    x: jax.Array,
    cfg: MoEConfig,
    *,
    impl: str = "auto",
    return_routing: bool = False,
    routing: Routing | None = None,
):
    """One MoE layer. ``x [..., d]`` -> ``y [..., d]`` in ``x.dtype``.

    Args:
      params: the layer's `MoEParams`.
      x: activations ``[..., d]``.
      cfg: the layer's `MoEConfig`.
      impl: execution strategy name (`jaxmoe.available_impls`); ``auto`` is resolved
        for the platform the program is lowered for (`jaxmoe.impls.policy.call_impl`).
      return_routing: also return the `Routing` used (over the flattened tokens).
      routing: use this routing instead of computing it (e.g. to replay a trace):
        ``expert_ids`` integer and ``weights`` float, both ``[T, k]`` over the flattened
        tokens. Ids outside ``[0, E)`` are a ValueError when concrete; under ``jit`` such
        a pair adds exactly zero (docs/routing.md, "Invalid expert ids").
    """
    if x.shape[-1] != cfg.d_model:
        raise ValueError(f"moe_apply: x has width {x.shape[-1]} but d_model is {cfg.d_model} (shape {x.shape})")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, cfg.d_model)
    host = resolve_impl(impl, x2.shape[0] * cfg.top_k, experts=params.experts, dtype=x2.dtype)
    inv = wants_invariance(cfg, host)  # batch invariance (jaxmoe.invariance)
    if routing is None:
        routing = compute_routing(params, x2, cfg, invariant=inv)
    else:
        shape = (x2.shape[0], cfg.top_k)
        check_expert_ids(routing.expert_ids, cfg.num_experts, "moe_apply", shape=shape, weights=routing.weights)
    with jax.named_scope(f"routed_experts_{impl}"):
        y, _ = call_impl(impl, x2, routing, params.experts, cfg)
    if params.shared is not None:
        y = y + _shared(x2, params.shared, cfg, inv)
    y = y.astype(x.dtype).reshape(*lead, cfg.d_model)
    return (y, routing) if return_routing else y


def _shared(x2: jax.Array, sw: SharedWeights | None, cfg: MoEConfig, invariant: bool) -> jax.Array:
    """The shared expert; batch-invariant when asked: through the C++ kernel when the
    program is lowered for the CPU and the kernel takes the weights, else on fixed row
    blocks in XLA."""
    if sw is None or not invariant or not shared_supported(sw, x2.dtype):
        return shared_expert(x2, sw, cfg, invariant=invariant)
    return _shared_switch(x2, sw, cfg)


@functools.partial(jax.jit, static_argnums=(2,))  # staged: an eager platform switch misdispatches on jax 0.10
def _shared_switch(x2: jax.Array, sw: SharedWeights, cfg: MoEConfig) -> jax.Array:
    return jax.lax.platform_dependent(
        x2,
        sw,
        cpu=functools.partial(shared_expert_cpu, cfg=cfg),
        default=lambda x, sw: shared_expert(x, sw, cfg, invariant=True),
    )

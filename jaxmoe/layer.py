"""The MoE layer as a pure function of a parameter pytree.

``y = moe_apply(params, x, cfg, ex)`` reads as llama.cpp's ``build_moe_ffn``: router
logits (float32) and `route` (`jaxmoe.params.compute_routing`), one call that runs the
routed and the shared experts (`jaxmoe.impls.policy.run_experts`), the cast back.
`MoEBlock` holds the same parameters as Flax NNX variables and calls this function.
`MoEParams`, `init_params`, `params_from_sampler` and `compute_routing` live in
`jaxmoe.params` and are re-exported here.
"""

from __future__ import annotations

import jax

from jaxmoe.config import MoEConfig
from jaxmoe.dispatch import check_expert_ids
from jaxmoe.execution import ExecConfig, exec_config
from jaxmoe.impls.policy import run_experts
from jaxmoe.params import MoEParams, compute_routing, init_params, params_from_sampler
from jaxmoe.routing import Routing

__all__ = ["MoEParams", "compute_routing", "init_params", "moe_apply", "params_from_sampler"]


def moe_apply(
    params: MoEParams,
    x: jax.Array,
    cfg: MoEConfig,
    ex: ExecConfig | None = None,
    *,
    impl: str | None = None,
    return_routing: bool = False,
    routing: Routing | None = None,
    **removed,
):
    """One MoE layer. ``x [..., d]`` -> ``y [..., d]`` in ``x.dtype``.

    Args:
      params: the layer's `MoEParams`.
      x: activations ``[..., d]``.
      cfg: the layer's `MoEConfig` (what the model is).
      ex: how to run it (`jaxmoe.ExecConfig`; default ``ExecConfig()``: ``impl="auto"``,
        resolved for the platform the program is lowered for).
      impl: shorthand for ``ExecConfig(impl=...)`` (with ``ex``: they must agree, or
        ``ex.impl`` is ``auto``).
      return_routing: also return the `Routing` used (over the flattened tokens).
      routing: use this routing instead of computing it (e.g. to replay a trace):
        ``expert_ids`` integer and ``weights`` float, both ``[T, k]`` over the flattened
        tokens. Ids outside ``[0, E)`` are a ValueError when concrete; under ``jit`` such
        a pair adds exactly zero (docs/routing.md, "Invalid expert ids").
    """
    ex = exec_config(ex, impl, **removed)
    if x.shape[-1] != cfg.d_model:
        raise ValueError(f"moe_apply: x has width {x.shape[-1]} but d_model is {cfg.d_model} (shape {x.shape})")
    x2 = x.reshape(-1, cfg.d_model)
    if routing is None:
        routing = compute_routing(params, x2, cfg, invariant=ex.batch_invariant)
    else:
        shape = (x2.shape[0], cfg.top_k)
        check_expert_ids(routing.expert_ids, cfg.num_experts, "moe_apply", shape=shape, weights=routing.weights)
    y = run_experts(x2, routing, params.experts, params.shared, cfg, ex)
    y = y.astype(x.dtype).reshape(x.shape)
    return (y, routing) if return_routing else y

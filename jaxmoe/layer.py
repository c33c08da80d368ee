"""The MoE layer as a pure function of a parameter pytree.

``y = moe_apply(params, x, cfg, impl=...)``: router logits (float32), `route`, the
routed experts by the chosen implementation (`jaxmoe.impls`), plus the shared expert.
`MoEBlock` holds the same parameters as Flax NNX variables and calls this function.
`MoEParams`, `init_params`, `params_from_sampler` and `compute_routing` live in
`jaxmoe.params` and are re-exported here.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Mapping

import jax

from jaxmoe.config import MoEConfig
from jaxmoe.dispatch import check_expert_ids
from jaxmoe.experts import SharedWeights, shared_expert
from jaxmoe.impls.cpu import experts_shared_cpu, shared_expert_cpu, shared_stored_narrow, shared_supported
from jaxmoe.impls.policy import call_impl, lowering_impls
from jaxmoe.impls.registry import get_impl
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
    # batch invariance per lowering platform (jaxmoe.invariance): on where the strategy
    # that platform takes asks for it
    table = lowering_impls(impl, x2.shape[0] * cfg.top_k, experts=params.experts, dtype=x2.dtype)
    inv = {plat: wants_invariance(cfg, name) for plat, name in table.items()}
    if routing is None:
        routing = _per_platform(_routing, _modes(inv), (params, x2), cfg)
    else:
        shape = (x2.shape[0], cfg.top_k)
        check_expert_ids(routing.expert_ids, cfg.num_experts, "moe_apply", shape=shape, weights=routing.weights)
    smodes = None
    if params.shared is not None:
        # the C++ kernel takes the shared expert on the CPU where invariance asks for it, and
        # a quantized or bfloat16-stored one whenever the routed experts run in it there (XLA
        # would dequantize or widen each whole matrix on every call)
        narrow = table["cpu"] == "cpu" and shared_stored_narrow(params.shared, x2.dtype)
        kernel = (any(inv.values()) or narrow) and shared_supported(params.shared, x2.dtype)
        smodes = _modes(inv, kernel, narrow)
    if smodes is not None and table["cpu"] == "cpu" and smodes["cpu"] == "kernel" and x2.shape[0] > 0:
        # both in the C++ kernel on the CPU: one custom call for the routed and the shared
        # expert there (`experts_shared_cpu`); each other platform keeps its own pair
        with jax.named_scope(f"routed_and_shared_experts_{impl}"):
            modes = {plat: (table[plat], smodes[plat]) for plat in table}
            y = _per_platform(_experts_and_shared, modes, (x2, routing, params.experts, params.shared), cfg)
    else:
        with jax.named_scope(f"routed_experts_{impl}"):
            y, _ = call_impl(impl, x2, routing, params.experts, cfg)
        if smodes is not None:
            y = y + _per_platform(_shared, smodes, (x2, params.shared), cfg)
    y = y.astype(x.dtype).reshape(*lead, cfg.d_model)
    return (y, routing) if return_routing else y


def _routing(params: MoEParams, x2: jax.Array, cfg: MoEConfig, mode: str) -> Routing:
    return compute_routing(params, x2, cfg, invariant=mode != "fast")


def _shared(x2: jax.Array, sw: SharedWeights, cfg: MoEConfig, mode: str) -> jax.Array:
    """The shared expert: ``fast`` (XLA); ``kernel``: through the C++ kernel (the CPU,
    weights it takes; batch-invariant, and quantized weights read in their stored format);
    ``blocks``: batch-invariant on fixed row blocks in XLA."""
    if mode == "kernel":
        return shared_expert_cpu(x2, sw, cfg)
    return shared_expert(x2, sw, cfg, invariant=mode == "blocks")


def _experts_and_shared(x2, routing, experts, sw: SharedWeights, cfg: MoEConfig, mode: tuple[str, str]) -> jax.Array:
    """Routed plus shared expert for one platform's ``(impl, shared mode)``: ``cpu`` with
    ``kernel`` is one C++ call for both (`experts_shared_cpu`), anything else the routed
    strategy and then `_shared`."""
    name, smode = mode
    if name == "cpu" and smode == "kernel":
        return experts_shared_cpu(x2, routing, experts, sw, cfg)
    return get_impl(name)(x2, routing, experts, cfg) + _shared(x2, sw, cfg, smode)


def _modes(inv: dict[str, bool], kernel: bool = False, narrow: bool = False) -> dict[str, str]:
    """Each lowering platform's mode: ``kernel`` on the CPU when ``kernel`` (the C++ kernel
    takes the shared expert) and invariance is on there or ``narrow`` (quantized or
    bfloat16-stored shared weights); else ``blocks`` where invariance is on, ``fast`` where
    it is off."""

    def mode(plat: str, on: bool) -> str:
        if kernel and plat == "cpu" and (on or narrow):
            return "kernel"
        return "blocks" if on else "fast"

    return {plat: mode(plat, on) for plat, on in inv.items()}


def _per_platform(fn, modes: Mapping[str, Hashable], args: tuple, cfg: MoEConfig):
    """``fn(*args, cfg, mode)`` with each lowering platform's mode; one platform switch
    when they differ."""
    if len(set(modes.values())) == 1:
        return fn(*args, cfg, next(iter(modes.values())))
    return _switch(fn, tuple(sorted(modes.items())), cfg, *args)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))  # staged: an eager platform switch misdispatches on jax 0.10
def _switch(fn, modes: tuple[tuple[str, Hashable], ...], cfg: MoEConfig, *args):
    branches = {m: functools.partial(_call_mode, fn, cfg, m) for m in set(dict(modes).values())}
    per = {plat: branches[m] for plat, m in modes if plat != "default"}
    return jax.lax.platform_dependent(*args, default=branches[dict(modes)["default"]], **per)


def _call_mode(fn, cfg: MoEConfig, mode: Hashable, *args):
    return fn(*args, cfg, mode)

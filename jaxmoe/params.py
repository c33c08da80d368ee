"""The parameters of one MoE layer as a pytree, their random init, and the routing step.

`MoEParams` is what the functional API (`jaxmoe.layer.moe_apply`), the loaders
(`jaxmoe.io`) and `MoEBlock` exchange; `compute_routing` is the router of the layer
(float32 logits, then `jaxmoe.routing.route`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxmoe.config import MoEConfig
from jaxmoe.experts import ExpertWeights, SharedWeights
from jaxmoe.invariance import row_blocks
from jaxmoe.routing import Routing, route, router_logits


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoEParams:
    """All parameters of one MoE layer.

    Attributes:
      w_router: ``[d, E]``.
      experts: `ExpertWeights`.
      b_router: ``[E]`` or None.
      selection_bias: ``[E]`` or None (DeepSeek ``e_score_correction_bias``).
      shared: `SharedWeights` or None.
    """

    w_router: jax.Array
    experts: ExpertWeights
    b_router: jax.Array | None = None
    selection_bias: jax.Array | None = None
    shared: SharedWeights | None = None

    def check(self, cfg: MoEConfig) -> None:
        """Raises ValueError naming the first tensor whose shape disagrees with ``cfg``."""
        d, e = cfg.d_model, cfg.num_experts
        if tuple(self.w_router.shape) != (d, e):
            raise ValueError(f"MoEParams.w_router has shape {tuple(self.w_router.shape)}, expected {(d, e)}")
        self.experts.check(cfg)
        if cfg.router.router_bias and (self.b_router is None or tuple(self.b_router.shape) != (e,)):
            raise ValueError(f"MoEParams.b_router must have shape {(e,)} (router_bias=True)")
        if cfg.router.use_selection_bias and (self.selection_bias is None or tuple(self.selection_bias.shape) != (e,)):
            raise ValueError(f"MoEParams.selection_bias must have shape {(e,)} (use_selection_bias=True)")
        fs = cfg.shared_expert_dim
        if fs:
            if self.shared is None:
                raise ValueError(f"MoEParams.shared is missing; the config has a shared expert of width {fs}")
            for name, shape in (("w_gate", (d, fs)), ("w_up", (d, fs)), ("w_down", (fs, d))):
                got = tuple(getattr(self.shared, name).shape)
                if got != shape:
                    raise ValueError(f"MoEParams.shared.{name} has shape {got}, expected {shape}")
            if cfg.shared_expert_gate and (self.shared.gate is None or tuple(self.shared.gate.shape) != (d,)):
                raise ValueError(f"MoEParams.shared.gate must have shape {(d,)} (shared_expert_gate=True)")


def params_from_sampler(cfg: MoEConfig, nrm) -> MoEParams:
    """Every tensor of ``cfg`` drawn by ``nrm(shape, fan_in) -> array`` (zero-mean, std
    ``1 / sqrt(fan_in)``): router, experts (and their biases), selection bias (std 0.1),
    shared expert and its gate."""
    d, e, f, fs = cfg.d_model, cfg.num_experts, cfg.expert_dim, cfg.shared_expert_dim
    ew = ExpertWeights(nrm((e, d, f), d), nrm((e, d, f), d), nrm((e, f, d), f))
    if cfg.expert_bias:
        ew = dataclasses.replace(ew, b_gate=nrm((e, f), 4.0), b_up=nrm((e, f), 4.0), b_down=nrm((e, d), 4.0))
    shared = None
    if fs:
        shared = SharedWeights(
            nrm((d, fs), d), nrm((d, fs), d), nrm((fs, d), fs), nrm((d,), d) if cfg.shared_expert_gate else None
        )
    return MoEParams(
        w_router=nrm((d, e), d),
        experts=ew,
        b_router=nrm((e,), 1.0) if cfg.router.router_bias else None,
        selection_bias=nrm((e,), 100.0) if cfg.router.use_selection_bias else None,
        shared=shared,
    )


def init_params(cfg: MoEConfig, key: jax.Array, dtype=jnp.float32, scale: float = 1.0) -> MoEParams:
    """Random parameters (normal, fan-in scaled) for ``cfg``."""
    ks = iter(jax.random.split(key, 16))

    def nrm(shape, fan_in):
        return (jax.random.normal(next(ks), shape, jnp.float32) * (scale / fan_in**0.5)).astype(dtype)

    return params_from_sampler(cfg, nrm)


def compute_routing(params: MoEParams, x2: jax.Array, cfg: MoEConfig, *, invariant: bool = False) -> Routing:
    """Routing of ``x2 [T, d]`` (float32 math).

    ``invariant``: the router logits on fixed-shape row blocks and the rule one token at
    a time (`jaxmoe.invariance.row_blocks`), so a token's routing does not depend on ``T``.
    """
    if not invariant:
        return route(router_logits(x2, params.w_router, params.b_router), cfg.router, params.selection_bias)
    z = row_blocks(router_logits, x2, params.w_router, params.b_router)
    # one token per step: XLA:CPU vectorizes exp differently for large arrays
    return row_blocks(lambda zb, bias: route(zb, cfg.router, bias), z, params.selection_bias, block=1)

"""`MoEBlock`: the Flax NNX module that holds one MoE layer's parameters.

The module only holds variables and calls the pure `jaxmoe.layer.moe_apply`; its
`params()` method returns the `MoEParams` pytree the functional API takes. For training,
``block(x, return_aux=True)`` also returns the router's logits, routing and losses
(`jaxmoe.losses.RouterAux`). With ``track_load=True`` the block counts the pairs routed
to each expert over its calls (`ExpertLoad`, `jaxmoe.stats.expert_counts`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmoe.config import MoEConfig
from jaxmoe.execution import ExecConfig, exec_config
from jaxmoe.experts import ExpertWeights, SharedWeights
from jaxmoe.layer import moe_apply
from jaxmoe.losses import RouterAux, router_aux, update_selection_bias
from jaxmoe.parallel import moe_apply_ep
from jaxmoe.params import MoEParams, init_params
from jaxmoe.routing import Routing, router_logits
from jaxmoe.stats import expert_counts


class SelectionBias(nnx.Variable):
    """The router's selection bias ``[E]``: state, not a parameter. Training updates it with
    `MoEBlock.update_selection_bias` (DeepSeek-V3's loss-free balancing), not the optimizer:
    ``nnx.Optimizer(block, tx, wrt=nnx.Param)`` and ``nnx.grad`` with an ``nnx.Param``
    filter leave it alone."""


class ExpertLoad(nnx.Variable):
    """Pairs routed to each expert ``[E]`` int32, accumulated over the calls of a
    `MoEBlock` made with ``track_load=True``: state, neither a parameter nor trained
    (``nnx.Optimizer(block, tx, wrt=nnx.Param)`` leaves it alone)."""


def _var(v):
    return None if v is None else nnx.Param(v)


def _val(v: nnx.Variable | None) -> jax.Array | None:
    return None if v is None else v.get_value()


def _req(v: nnx.Variable | None) -> jax.Array:
    if v is None:
        raise ValueError("MoEBlock: a required parameter is missing")
    return v.get_value()


class MoEBlock(nnx.Module):
    """One MoE layer: router, routed SwiGLU experts, shared expert.

    ``block(x)`` maps ``x [..., d]`` to ``y [..., d]``; ``block(x, return_routing=True)``
    also returns the `jaxmoe.Routing` it used; ``block(x, return_aux=True)`` returns
    ``(y, aux)`` with ``aux`` a `jaxmoe.losses.RouterAux`: the router logits ``[T, E]``
    and routing ``[T, k]`` over the flattened tokens, the Switch load-balancing loss, the
    router z-loss and DeepSeek-V3's sequence-wise balance loss (sequences: the
    second-to-last axis of ``x`` when it has three or more, else all of ``x``; scores:
    sigmoid for ``sigmoid*`` routers, else softmax). The losses are unscaled and
    differentiable in the router weights; add them to the training loss with your
    coefficients. The selection bias is not a trained parameter: update it with
    `jaxmoe.losses.update_selection_bias` from ``aux.routing.expert_ids``.

    Args:
      cfg: the `MoEConfig`.
      rngs: random init (normal, fan-in scaled), keyword only.
      impl: shorthand for ``ExecConfig(impl=...)`` (``auto``, ``xla``, ``pallas``, ...).
      ex: how to run the layer (`jaxmoe.ExecConfig`: strategy, batch invariance,
        activation arithmetic, ...); default ``ExecConfig(impl=impl)``.
      dtype: parameter and compute dtype (routing is float32 always).
      params: ready `MoEParams` (e.g. from a loader) instead of a random init.
      mesh: a `jax.sharding.Mesh` with an ``expert`` axis for expert parallelism.
      track_load: count the (token, slot) pairs each expert receives over the block's
        calls into ``block.expert_load`` (an `ExpertLoad` ``[E]`` int32; ids outside
        ``[0, E)`` do not count), computed inside the layer's own jitted call (no host
        sync). Reset with `reset_expert_load`. The counter is NNX state: under a
        transform use ``nnx.jit`` / ``nnx.grad`` (or ``nnx.split`` / ``nnx.merge``), not
        a ``jax.jit`` closing over the block, which cannot update it.
    """

    def __init__(
        self,
        cfg: MoEConfig,
        *,
        rngs: nnx.Rngs | None = None,
        impl: str | None = None,
        ex: ExecConfig | None = None,
        dtype=jnp.float32,
        params: MoEParams | None = None,
        mesh=None,
        track_load: bool = False,
        **removed,
    ):
        self.cfg = cfg
        self.ex = exec_config(ex, impl, **removed)
        self.dtype = jnp.dtype(dtype)
        self.mesh = mesh
        if params is None:
            if rngs is None:
                raise ValueError("MoEBlock needs rngs= (random init) or params= (loaded weights)")
            params = init_params(cfg, rngs.params(), dtype=self.dtype)
        params.check(cfg)
        self._set(params)
        if not isinstance(track_load, bool):
            raise ValueError(f"MoEBlock: track_load must be a bool, got {track_load!r}")
        self.expert_load = ExpertLoad(jnp.zeros((cfg.num_experts,), jnp.int32)) if track_load else None

    def _set(self, p: MoEParams) -> None:
        self.w_router = nnx.Param(p.w_router)
        self.b_router = _var(p.b_router)
        self.selection_bias = None if p.selection_bias is None else SelectionBias(p.selection_bias)
        ew = p.experts
        self.w_gate, self.w_up, self.w_down = nnx.Param(ew.w_gate), nnx.Param(ew.w_up), nnx.Param(ew.w_down)
        self.b_gate, self.b_up, self.b_down = _var(ew.b_gate), _var(ew.b_up), _var(ew.b_down)
        sh = p.shared
        self.has_shared = sh is not None
        self.s_gate = _var(None if sh is None else sh.w_gate)
        self.s_up = _var(None if sh is None else sh.w_up)
        self.s_down = _var(None if sh is None else sh.w_down)
        self.s_sigmoid_gate = _var(None if sh is None else sh.gate)

    def params(self) -> MoEParams:
        """The parameters as the `MoEParams` pytree (the functional API's input)."""
        ew = ExpertWeights(
            _req(self.w_gate), _req(self.w_up), _req(self.w_down), _val(self.b_gate), _val(self.b_up), _val(self.b_down)
        )
        shared = None
        if self.has_shared:
            shared = SharedWeights(_req(self.s_gate), _req(self.s_up), _req(self.s_down), _val(self.s_sigmoid_gate))
        return MoEParams(_req(self.w_router), ew, _val(self.b_router), _val(self.selection_bias), shared)

    def update_selection_bias(self, expert_ids: jax.Array, gamma: float) -> None:
        """One loss-free balancing step in place (`jaxmoe.losses.update_selection_bias`)
        from the ``expert_ids [..., k]`` of the last step(s), e.g. ``aux.routing.expert_ids``.
        ValueError when the router has no selection bias."""
        if self.selection_bias is None:
            raise ValueError(
                "MoEBlock.update_selection_bias: this router has no selection bias (RouterConfig.use_selection_bias)"
            )
        self.selection_bias.set_value(update_selection_bias(self.selection_bias.get_value(), expert_ids, gamma))

    def reset_expert_load(self) -> None:
        """Sets ``block.expert_load`` back to zeros. ValueError unless the block was built
        with ``track_load=True``."""
        if self.expert_load is None:
            raise ValueError(
                "MoEBlock.reset_expert_load: the block does not count its load (build it with track_load=True)"
            )
        self.expert_load.set_value(jnp.zeros_like(self.expert_load.get_value()))

    @property
    def impl(self) -> str:
        """The strategy name of the block's `ExecConfig`."""
        return self.ex.impl

    def __call__(
        self,
        x: jax.Array,
        *,
        return_routing: bool = False,
        return_aux: bool = False,
        impl: str | None = None,
        ex: ExecConfig | None = None,
    ):
        """``x [..., d]`` -> ``y [..., d]`` (and the routing or the `RouterAux`); ``ex`` /
        ``impl`` override the block's `ExecConfig` for this call."""
        x = jnp.asarray(x)
        if x.shape[-1] != self.cfg.d_model:
            raise ValueError(f"MoEBlock: x has width {x.shape[-1]} but d_model is {self.cfg.d_model} (shape {x.shape})")
        if return_routing and return_aux:
            raise ValueError("MoEBlock: pass return_routing or return_aux, not both (aux.routing is the routing)")
        run = exec_config(ex or self.ex, impl) if (ex is not None or impl is not None) else self.ex
        p = self.params()
        x = x.astype(self.dtype)
        load = None if self.expert_load is None else self.expert_load.get_value()
        if self.mesh is not None:
            want = return_routing or return_aux
            out = moe_apply_ep(p, x, self.cfg, self.mesh, run, return_routing=want or load is not None)
            if load is not None:
                load = _add_counts_jit(load, out[1].expert_ids)
                out = out if want else out[0]
        elif load is not None:
            out, load = _moe_apply_load_jit(p, x, self.cfg, run, return_routing or return_aux, load)
        else:
            out = _moe_apply_jit(p, x, self.cfg, run, return_routing or return_aux)
        if self.expert_load is not None:
            self.expert_load.set_value(load)
        if not return_aux:
            return out
        y, routing = out
        return y, _aux_jit(p, x, routing, self.cfg)


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _moe_apply_jit(p: MoEParams, x: jax.Array, cfg: MoEConfig, ex: ExecConfig, return_routing: bool):
    # One jitted function per (config, ExecConfig): eager calls of the block run compiled,
    # and inside a user's jit this nests at no cost.
    return moe_apply(p, x, cfg, ex, return_routing=return_routing)


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _moe_apply_load_jit(p: MoEParams, x: jax.Array, cfg: MoEConfig, ex: ExecConfig, return_routing: bool, load):
    """`_moe_apply_jit` that also adds the call's `expert_counts` to ``load [E]``, in the same
    compiled program; returns ``(out, load)``."""
    y, routing = moe_apply(p, x, cfg, ex, return_routing=True)
    load = load + expert_counts(routing, cfg.num_experts)
    return ((y, routing) if return_routing else y), load


@jax.jit
def _add_counts_jit(load: jax.Array, expert_ids: jax.Array) -> jax.Array:
    return load + expert_counts(expert_ids, load.shape[0])


@functools.partial(jax.jit, static_argnums=(3,))
def _aux_jit(p: MoEParams, x: jax.Array, routing: Routing, cfg: MoEConfig) -> RouterAux:
    """`RouterAux` of the call: the logits again (XLA shares them with the layer's own
    under one jit) and the losses of `jaxmoe.losses.router_aux`."""
    x2 = x.reshape(-1, cfg.d_model)
    z = router_logits(x2, p.w_router, p.b_router)
    seq_len = x.shape[-2] if x.ndim >= 3 else None
    score_fn = "sigmoid" if cfg.router.score_fn.startswith("sigmoid") else "softmax"
    return router_aux(z, routing, score_fn=score_fn, seq_len=seq_len)

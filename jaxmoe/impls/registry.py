"""The table of execution strategies: name -> `Impl`.

An `Impl` is the contract of one strategy:

- ``routed(x [T, d], routing, experts, cfg, ex) -> [T, d]`` float32: the routed
  experts, weighted and summed over each token's slots;
- ``layer(x, routing, experts, shared, cfg, ex) -> [T, d]`` float32, optional:
  routed plus shared expert in one go (``cpu`` runs both in one C++ call); without it the
  layer is ``routed`` plus the XLA shared expert (`jaxmoe.experts.shared_expert`);
- ``platforms``: the platform groups (`jaxmoe.platforms.PLATFORM_GROUPS`) whose code
  differs; every other group is traced once as ``"default"``.

``ex`` is the call's `jaxmoe.execution.ExecConfig`, whose ``platform`` is the platform
group the program is lowered for, a static value: nothing below the one platform switch
of `jaxmoe.impls.policy.run_experts` asks for the platform again.

`BUILTIN` is the explicit table of the strategies jaxmoe ships; `register_impl` adds a
user's own under a new name (a name that is taken is an error, ``auto`` is reserved).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import MappingProxyType

import jax
from jax import Array

from jaxmoe.config import MoEConfig
from jaxmoe.execution import ExecConfig
from jaxmoe.experts import ExpertWeights, SharedWeights, experts_dense, experts_gather, shared_expert
from jaxmoe.impls.cpu import cpu_layer, experts_cpu
from jaxmoe.impls.pallas import experts_pallas
from jaxmoe.impls.ragged import experts_ragged_dot
from jaxmoe.impls.xla import experts_xla
from jaxmoe.impls.xla_tiled import experts_xla_tiled
from jaxmoe.routing import Routing

RoutedFn = Callable[..., jax.Array]

#: The XLA strategies run ggml's activation arithmetic through `jaxmoe.ggml_activations`.
_GGML = ("float", "ggml")


@dataclasses.dataclass(frozen=True)
class Impl:
    """One strategy (module docstring). Calling it runs ``routed`` (``ex`` default
    ``ExecConfig()``: the default device's platform group)."""

    routed: RoutedFn
    layer: Callable[..., jax.Array] | None = None
    platforms: tuple[str, ...] = ()
    activations: tuple[str, ...] = ("float",)

    def __call__(
        self, x: jax.Array, routing: Routing, ew: ExpertWeights, cfg: MoEConfig, ex: ExecConfig | None = None
    ) -> jax.Array:
        return self.routed(x, routing, ew, cfg, ex or ExecConfig())

    def run_layer(
        self, x: Array, routing: Routing, ew: ExpertWeights, sw: SharedWeights | None, cfg: MoEConfig, ex: ExecConfig
    ) -> Array:
        """Routed plus shared expert: ``layer`` when the strategy has one, else ``routed``
        plus the XLA shared expert (batch-invariant when ``ex`` asks)."""
        if self.layer is not None:
            return self.layer(x, routing, ew, sw, cfg, ex)
        y = self.routed(x, routing, ew, cfg, ex)
        if sw is None:
            return y
        return y + shared_expert(
            x, sw, cfg, invariant=ex.batch_invariant, platform=ex.group, activations=ex.activations
        )


#: The shipped strategies (read only).
BUILTIN: MappingProxyType[str, Impl] = MappingProxyType(
    {
        # every expert on every token, masked: the oracle
        "dense": Impl(experts_dense, platforms=("cpu",), activations=_GGML),
        # the k selected experts of each token, pair by pair
        "gather": Impl(experts_gather, platforms=("cpu",), activations=_GGML),
        # sorted, tiled grouped SwiGLU in XLA ops (a loop over the touched experts)
        "xla": Impl(experts_xla, platforms=("cpu",), activations=_GGML),
        # the same without a loop: batched dots over tiles (GPUs without Pallas)
        "xla_tiled": Impl(experts_xla_tiled, platforms=("cpu",), activations=_GGML),
        # jax.lax.ragged_dot, comparison only
        "ragged_dot": Impl(experts_ragged_dot, platforms=("cpu",), activations=_GGML),
        # C++ XLA FFI kernel on XLA:CPU; fuses a quantized / invariant shared expert
        # (ggml activations for the weight kinds `jaxmoe.impls.cpu.ggml_problem` accepts)
        "cpu": Impl(experts_cpu, layer=cpu_layer, platforms=("cpu",), activations=("float", "int8", "ggml")),
        # Pallas/Triton kernels: compiled on CUDA / ROCm, interpreted elsewhere
        "pallas": Impl(experts_pallas, platforms=("triton",)),
    }
)

_USER: dict[str, Impl] = {}


def register_impl(
    name: str,
    routed: RoutedFn,
    *,
    layer: Callable[..., jax.Array] | None = None,
    platforms: tuple[str, ...] = (),
) -> None:
    """Adds a user strategy under ``name``: ``routed(x [T, d], routing, experts, cfg, ex)
    -> [T, d]`` float32, optionally its ``layer`` (routed + shared) and the platform groups
    it tells apart (`Impl`; each other group is traced once with ``ex.platform ==
    "default"``).

    Raises ValueError when ``name`` is ``auto``, already taken (shipped or registered
    before), or ``routed`` is not callable.
    """
    if not isinstance(name, str) or not name or name == "auto":
        raise ValueError(f"register_impl: name must be a non-empty string other than 'auto', got {name!r}")
    if name in BUILTIN or name in _USER:
        raise ValueError(f"register_impl: impl {name!r} is already registered; pick another name")
    if not callable(routed):
        raise ValueError(f"register_impl: routed for {name!r} must be callable, got {type(routed).__name__}")
    if layer is not None and not callable(layer):
        raise ValueError(f"register_impl: layer for {name!r} must be callable, got {type(layer).__name__}")
    _USER[name] = Impl(routed, layer=layer, platforms=tuple(platforms))


def unregister_impl(name: str) -> None:
    """Removes a user strategy added by `register_impl` (shipped ones cannot be removed)."""
    if name not in _USER:
        raise ValueError(f"unregister_impl: {name!r} is not a user-registered impl; user impls: {sorted(_USER)}")
    del _USER[name]


def available_impls() -> list[str]:
    """``auto`` and every registered name, sorted."""
    return ["auto", *sorted({*BUILTIN, *_USER})]


def get_impl(name: str) -> Impl:
    """The strategy registered under ``name`` (not ``auto``: resolve it first)."""
    fn = BUILTIN.get(name) or _USER.get(name)
    if fn is None:
        raise ValueError(f"unknown impl {name!r}; available: {available_impls()}")
    return fn


__all__ = ["BUILTIN", "Impl", "available_impls", "get_impl", "register_impl", "unregister_impl"]

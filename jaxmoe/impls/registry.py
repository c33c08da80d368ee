"""The table of execution strategies: name -> ``fn(x [T, d], routing, experts, cfg) -> [T, d]``.

`BUILTIN` is the explicit table of the strategies jaxmoe ships; `register_impl` adds a
user's own under a new name (a name that is taken is an error, ``auto`` is reserved).
`get_impl` looks a name up; ``impl="auto"`` is resolved before that by
`jaxmoe.impls.policy.resolve_impl`.
"""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType

import jax

from jaxmoe.experts import experts_dense, experts_gather
from jaxmoe.impls.cpu import experts_cpu
from jaxmoe.impls.pallas import experts_pallas
from jaxmoe.impls.ragged import experts_ragged_dot
from jaxmoe.impls.xla import experts_xla
from jaxmoe.impls.xla_tiled import experts_xla_tiled

ImplFn = Callable[..., jax.Array]

#: The shipped strategies (read only).
BUILTIN: MappingProxyType[str, ImplFn] = MappingProxyType(
    {
        "dense": experts_dense,  # every expert on every token, masked: the oracle
        "gather": experts_gather,  # the k selected experts of each token, pair by pair
        "xla": experts_xla,  # sorted, tiled grouped SwiGLU in XLA ops
        "xla_tiled": experts_xla_tiled,  # the same without a loop: batched dots over tiles (GPUs without Pallas)
        "ragged_dot": experts_ragged_dot,  # jax.lax.ragged_dot, comparison only
        "cpu": experts_cpu,  # C++ XLA FFI kernel on XLA:CPU
        "pallas": experts_pallas,  # Pallas/Triton kernels on CUDA / ROCm
    }
)

_USER: dict[str, ImplFn] = {}


def register_impl(name: str, fn: ImplFn) -> None:
    """Adds a user strategy ``fn(x [T, d], routing, experts, cfg) -> [T, d]`` under ``name``.

    Raises ValueError when ``name`` is ``auto``, already taken (shipped or registered
    before), or ``fn`` is not callable.
    """
    if not isinstance(name, str) or not name or name == "auto":
        raise ValueError(f"register_impl: name must be a non-empty string other than 'auto', got {name!r}")
    if name in BUILTIN or name in _USER:
        raise ValueError(f"register_impl: impl {name!r} is already registered; pick another name")
    if not callable(fn):
        raise ValueError(f"register_impl: fn for {name!r} must be callable, got {type(fn).__name__}")
    _USER[name] = fn


def unregister_impl(name: str) -> None:
    """Removes a user strategy added by `register_impl` (shipped ones cannot be removed)."""
    if name not in _USER:
        raise ValueError(f"unregister_impl: {name!r} is not a user-registered impl; user impls: {sorted(_USER)}")
    del _USER[name]


def available_impls() -> list[str]:
    """``auto`` and every registered name, sorted."""
    return ["auto", *sorted({*BUILTIN, *_USER})]


def get_impl(name: str) -> ImplFn:
    """The strategy registered under ``name`` (not ``auto``: resolve it first)."""
    fn = BUILTIN.get(name) or _USER.get(name)
    if fn is None:
        raise ValueError(f"unknown impl {name!r}; available: {available_impls()}")
    return fn

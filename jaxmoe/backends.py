"""Execution strategies of the routed experts and the ``impl="auto"`` choice.

An implementation is a function ``fn(x [T, d], routing, experts, cfg) -> [T, d]``
(float32) registered under a name; `MoEBlock(impl=...)` and `moe_apply` look it up
here. See DESIGN.md, "Execution strategies".
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from jaxmoe import experts as _experts

ImplFn = Callable[..., jax.Array]

_IMPLS: dict[str, ImplFn] = {}

#: Token-pair count (T * k) at or below which ``auto`` takes the ``gather`` path off
#: GPU: one decode token of the top-8 families (gather 29.6 ms vs xla 31.3 ms on the
#: Qwen3.6 layer; gather re-reads an expert per pair, so it loses once pairs repeat
#: experts; benchmarks/README.md).
GATHER_MAX_PAIRS = 8

INTEL_PLATFORMS = ("oneapi", "sycl", "xpu")
PALLAS_PLATFORMS = ("cuda", "rocm", "gpu")


def register_impl(name: str, fn: ImplFn) -> None:
    _IMPLS[name] = fn


def available_impls() -> list[str]:
    _load_optional()
    return ["auto", *sorted(_IMPLS)]


def default_platform() -> str:
    return jax.devices()[0].platform


def resolve_impl(
    impl: str, num_pairs: int | None = None, platform: str | None = None, *, experts=None, dtype=None
) -> str:
    """The concrete implementation name for ``impl`` (``auto`` resolved).

    ``auto``: ``pallas`` on CUDA / ROCm (its kernels have their own decode path). On the
    CPU, ``cpu`` (the C++ kernel of `jaxmoe.cpu_kernel`, which reads the selected
    experts in place) when ``experts`` are given, it takes them (float32 / bfloat16,
    not quantized) and it built on this machine. Otherwise (CPU without the kernel,
    quantized experts, Intel GPUs through the oneAPI PJRT plugin, anything else)
    ``gather`` for at most `GATHER_MAX_PAIRS` token pairs ``T * k``, else ``xla``.
    Forcing ``pallas`` on an Intel platform raises ValueError: Pallas's Triton
    backend lowers only for CUDA and ROCm.

    Args:
      impl: a registered name or ``auto``.
      num_pairs: ``T * k`` of the call.
      platform: the device platform (default: that of the first device).
      experts: the call's `ExpertWeights` (lets ``auto`` pick ``cpu``).
      dtype: the compute dtype of the activations (default float32).
    """
    _load_optional()
    platform = platform or default_platform()
    if impl != "auto":
        if impl not in _IMPLS:
            raise ValueError(f"unknown impl {impl!r}; available: {available_impls()}")
        if impl == "pallas" and platform in INTEL_PLATFORMS:
            raise ValueError(
                f"impl='pallas' cannot lower on platform {platform!r}: Pallas's Triton backend "
                f"targets CUDA and ROCm only; use impl='xla' (or 'auto') there"
            )
        if impl == "cpu" and platform != "cpu":
            raise ValueError(
                f"impl='cpu' is an XLA:CPU custom call and cannot run on platform {platform!r}; use impl='auto'"
            )
        return impl
    if platform in PALLAS_PLATFORMS and "pallas" in _IMPLS:
        return "pallas"
    if platform == "cpu" and experts is not None and "cpu" in _IMPLS:
        from jaxmoe import cpu_kernel

        if cpu_kernel.supports(experts, dtype or "float32") is None and cpu_kernel.cpu_kernel_available():
            return "cpu"
    if num_pairs is not None and num_pairs <= GATHER_MAX_PAIRS:
        return "gather"
    if "xla" in _IMPLS:
        return "xla"
    return "dense"


def get_impl(name: str) -> ImplFn:
    _load_optional()
    if name not in _IMPLS:
        raise ValueError(f"unknown impl {name!r}; available: {available_impls()}")
    return _IMPLS[name]


_loaded = False


def _load_optional() -> None:
    """Imports the modules that register the grouped paths (lazily: they import this one)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    import jaxmoe.cpu_kernel  # noqa: F401  registers cpu (compiled on first use)
    import jaxmoe.grouped  # noqa: F401  registers xla, ragged_dot
    import pallas_kernels.impl  # noqa: F401  registers pallas


register_impl("dense", _experts.experts_dense)
register_impl("gather", _experts.experts_gather)

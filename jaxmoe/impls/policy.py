"""``impl="auto"``: which strategy runs where.

See `resolve_impl`; the measurements behind the thresholds are in benchmarks/README.md
and docs/performance.md.
"""

from __future__ import annotations

import jax

from jaxmoe.experts import ExpertWeights
from jaxmoe.impls.cpu import cpu_kernel_available, supports
from jaxmoe.impls.registry import get_impl
from jaxmoe.platforms import INTEL_PLATFORMS, PALLAS_PLATFORMS

#: Token-pair count (T * k) at or below which ``auto`` takes the ``gather`` path off
#: GPU: one decode token of the top-8 families (gather 29.6 ms vs xla 31.3 ms on the
#: Qwen3.6 layer; gather re-reads an expert per pair, so it loses once pairs repeat
#: experts; benchmarks/README.md).
GATHER_MAX_PAIRS = 8


def default_platform() -> str:
    """The platform of JAX's first device (``cpu``, ``cuda``, ``rocm``, ``oneapi``, ...)."""
    return jax.devices()[0].platform


def resolve_impl(
    impl: str,
    num_pairs: int | None = None,
    platform: str | None = None,
    *,
    experts: ExpertWeights | None = None,
    dtype=None,
) -> str:
    """The concrete implementation name for ``impl`` (``auto`` resolved).

    ``auto``: ``pallas`` on CUDA / ROCm (its kernels have their own decode path). On the
    CPU, ``cpu`` (the C++ kernel of `jaxmoe.impls.cpu`, which reads the selected
    experts in place) when ``experts`` are given, it takes them (float32 / bfloat16,
    not quantized) and it built on this machine. Otherwise (CPU without the kernel,
    quantized experts, Intel GPUs through the oneAPI PJRT plugin, anything else)
    ``gather`` for at most `GATHER_MAX_PAIRS` token pairs ``T * k``, else ``xla``.
    Forcing ``pallas`` on an Intel platform, or ``cpu`` off the CPU, raises ValueError.

    Args:
      impl: a registered name or ``auto``.
      num_pairs: ``T * k`` of the call.
      platform: the device platform (default: that of the first device).
      experts: the call's `ExpertWeights` (lets ``auto`` pick ``cpu``).
      dtype: the compute dtype of the activations (default float32).
    """
    platform = platform or default_platform()
    if impl != "auto":
        get_impl(impl)  # ValueError for an unknown name
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
    if platform in PALLAS_PLATFORMS:
        return "pallas"
    if (
        platform == "cpu"
        and experts is not None
        and supports(experts, dtype or "float32") is None
        and cpu_kernel_available()
    ):
        return "cpu"
    if num_pairs is not None and num_pairs <= GATHER_MAX_PAIRS:
        return "gather"
    return "xla"


__all__ = ["GATHER_MAX_PAIRS", "default_platform", "resolve_impl"]

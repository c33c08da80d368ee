"""Platform names, and which strategy each platform takes (one place for the package).

`jax.lax.platform_dependent` switches on JAX platform names; jaxmoe groups them by what
runs there. `jaxmoe.impls.policy.run_experts` builds one branch per group, and each
branch is handed its group name as a static value.
"""

from __future__ import annotations

import jax

#: Platforms of the OpenXLA Intel GPU plugin (jax-oneapi-pjrt) across its versions.
INTEL_PLATFORMS = ("oneapi", "sycl", "xpu")
#: Platforms whose XLA backend takes Pallas's Triton lowering.
TRITON_PLATFORMS = ("cuda", "rocm")
#: Platforms with a native `jax.lax.ragged_dot` and ``ragged_all_to_all``.
RAGGED_PLATFORMS = ("cuda", "rocm", "gpu", "tpu")

#: Platform group -> the `jax.lax.platform_dependent` names it covers. Any other platform
#: (TPU, ...) is the group ``"default"``.
PLATFORM_GROUPS: dict[str, tuple[str, ...]] = {
    "cpu": ("cpu",),
    "triton": TRITON_PLATFORMS,
    "intel": INTEL_PLATFORMS,
}
#: Every group, ``"default"`` last.
GROUPS = (*PLATFORM_GROUPS, "default")

#: What ``impl="auto"`` takes in each group (`jaxmoe.impls.policy.resolve_impl` has the
#: conditions): ``cpu`` is the C++ kernel where it built and takes the experts, else
#: ``gather`` for at most `GATHER_MAX_PAIRS` token pairs and ``xla`` above.
AUTO_IMPL = {"cpu": "cpu", "triton": "pallas", "intel": "xla_tiled", "default": "xla"}
#: What an explicit ``impl`` becomes in a group (``xla``'s loop suits the CPU; a GPU
#: without Pallas takes the loop-free form).
EXPLICIT_IMPL = {"intel": {"xla": "xla_tiled"}}
#: Where an explicit ``impl`` cannot lower at all.
IMPL_GROUPS = {"cpu": ("cpu",), "pallas": ("triton", "cpu", "default")}
#: Token-pair count ``T * k`` at or below which ``auto`` takes ``gather`` where the C++
#: kernel is not available (docs/performance.md, "Why the strategies look the way they do").
GATHER_MAX_PAIRS = 8


def platform_group(platform: str) -> str:
    """The group of a JAX platform name (``gpu`` counts as ``triton``)."""
    if platform == "gpu":
        return "triton"
    for group, names in PLATFORM_GROUPS.items():
        if platform in names:
            return group
    return "default"


def default_platform() -> str:
    """The platform of JAX's first device (``cpu``, ``gpu``, ``oneapi``, ...)."""
    return jax.devices()[0].platform


def host_group() -> str:
    """The group of the default device's platform."""
    return platform_group(default_platform())


__all__ = [
    "AUTO_IMPL",
    "EXPLICIT_IMPL",
    "GATHER_MAX_PAIRS",
    "GROUPS",
    "IMPL_GROUPS",
    "INTEL_PLATFORMS",
    "PLATFORM_GROUPS",
    "RAGGED_PLATFORMS",
    "TRITON_PLATFORMS",
    "default_platform",
    "host_group",
    "platform_group",
]

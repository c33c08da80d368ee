"""``impl="auto"``: which strategy runs where, chosen for the platform the program is
lowered for, not the host it is traced on.

`resolve_impl` names the strategy for one platform; `lowering_impls` gives that name
for every platform with its own branch; `call_impl` runs the strategy through
`jax.lax.platform_dependent`, so ``jax.jit(f).lower(lowering_platforms=("cuda",))``
(or ``jax.export``) from a CPU host contains the CUDA branch (the Triton kernels), a
lowering for ``oneapi`` the Intel branch, and the same jitted function still runs on
the CPU. The measurements behind the thresholds are in benchmarks/README.md and
docs/performance.md.
"""

from __future__ import annotations

import functools

import jax

from jaxmoe.config import MoEConfig
from jaxmoe.experts import ExpertWeights
from jaxmoe.impls.cpu import cpu_kernel_available, supports
from jaxmoe.impls.registry import get_impl
from jaxmoe.platforms import BRANCH_PLATFORMS, INTEL_PLATFORMS, PALLAS_PLATFORMS
from jaxmoe.routing import Routing

#: Token-pair count (T * k) at or below which ``auto`` takes the ``gather`` path off
#: GPU: one decode token of the top-8 families (gather 29.6 ms vs xla 31.3 ms on the
#: Qwen3.6 layer; gather re-reads an expert per pair, so it loses once pairs repeat
#: experts; benchmarks/README.md).
GATHER_MAX_PAIRS = 8


#: What ``impl="xla"`` lowers to on a GPU without Pallas (Intel): the tiled formulation
#: with a bounded number of kernel launches (`jaxmoe.impls.xla_tiled`) instead of the
#: loop over touched experts that suits the CPU.
GPU_XLA = "xla_tiled"


def default_platform() -> str:
    """The platform of JAX's first device (``cpu``, ``gpu``, ``oneapi``, ...)."""
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

    ``auto``: ``pallas`` on CUDA / ROCm (its kernels have their own decode path);
    ``xla_tiled`` (`GPU_XLA`) on Intel GPUs through the oneAPI PJRT plugin, at every
    ``T``. On the CPU, ``cpu`` (the C++ kernel of `jaxmoe.impls.cpu`, which reads the
    selected experts in place) when ``experts`` are given, it takes them (float32 /
    bfloat16, int8 / int4 or GGUF block-kind `QuantizedTensor`s:
    `jaxmoe.impls.cpu.supports`) and it built on this machine. Otherwise (CPU without the
    kernel, experts it refuses, any other platform) ``gather`` for at most
    `GATHER_MAX_PAIRS` token pairs ``T * k``, else ``xla``.
    An explicit ``xla`` on an Intel platform is ``xla_tiled`` (its GPU shape); other
    explicit names are kept. Forcing ``pallas`` on an Intel platform, or ``cpu`` off the
    CPU, raises ValueError.

    Args:
      impl: a registered name or ``auto``.
      num_pairs: ``T * k`` of the call.
      platform: the lowering platform (default: the default backend's).
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
        return GPU_XLA if impl == "xla" and platform in INTEL_PLATFORMS else impl
    if platform in PALLAS_PLATFORMS:
        return "pallas"
    if platform in INTEL_PLATFORMS:
        return GPU_XLA
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


def lowering_impls(
    impl: str, num_pairs: int | None = None, *, experts: ExpertWeights | None = None, dtype=None
) -> dict[str, str]:
    """The strategy ``impl`` takes on each lowering platform.

    Keys: every platform of `jaxmoe.platforms.BRANCH_PLATFORMS` plus ``"default"`` (any
    other platform); values: `resolve_impl`'s name there. An explicit name is first
    checked against the host's platform (`resolve_impl`'s ValueErrors); on the other
    platforms it is kept as given (``xla`` -> ``xla_tiled`` on Intel), so forcing
    ``cpu`` or ``pallas`` and lowering for a platform that cannot take it fails at
    lowering time.
    """
    if impl != "auto":
        resolve_impl(impl, num_pairs, experts=experts, dtype=dtype)  # unknown names, host-platform errors
    table = {}
    for plat in (*BRANCH_PLATFORMS, "default"):
        if impl != "auto":
            table[plat] = GPU_XLA if impl == "xla" and plat in INTEL_PLATFORMS else impl
        else:
            table[plat] = resolve_impl(impl, num_pairs, plat, experts=experts, dtype=dtype)
    return table


def call_impl(
    impl: str, x: jax.Array, routing: Routing, experts: ExpertWeights, cfg: MoEConfig
) -> tuple[jax.Array, str]:
    """Runs the routed experts with ``impl`` resolved for the lowering platform.

    Returns ``(y [T, d] float32, name)``; ``name`` is the strategy of the default
    backend (for logs and named scopes). When the platforms disagree (``auto``: ``cpu``
    on the CPU, ``pallas`` on CUDA, ``xla_tiled`` on Intel, ...) every branch is traced
    and `jax.lax.platform_dependent` keeps the one of the platform the program is
    lowered for (all of them, behind a switch on the platform, in a multi-platform
    `jax.export`). Every strategy ``auto`` picks has a reverse mode of its own, so the
    switch is differentiated through its branches: each platform's gradient is its own
    strategy's (docs/design.md, "Training / reverse mode").
    """
    num_pairs = x.shape[0] * routing.expert_ids.shape[1]
    table = lowering_impls(impl, num_pairs, experts=experts, dtype=x.dtype)
    plat = default_platform()
    host = table.get("cuda" if plat == "gpu" else plat, table["default"])
    if len(set(table.values())) == 1:
        return get_impl(host)(x, routing, experts, cfg), host
    return _switch_jit(x, routing, experts, cfg, tuple(sorted(table.items()))), host


def _dispatch(x, routing, experts, cfg, table):
    fns = {name: functools.partial(_run, name, cfg) for name in set(dict(table).values())}  # one per name
    per = {plat: fns[name] for plat, name in table if plat != "default"}
    return jax.lax.platform_dependent(x, routing, experts, default=fns[dict(table)["default"]], **per)


def _run(name, cfg, x, routing, experts):
    return get_impl(name)(x, routing, experts, cfg)


# Always staged: an eager (op-by-op) platform switch dispatches with the wrong argument
# count on jax 0.10 ("Wrong number of arguments: expected 15 but got 9").
_switch_jit = jax.jit(_dispatch, static_argnums=(3, 4))


__all__ = [
    "GATHER_MAX_PAIRS",
    "GPU_XLA",
    "call_impl",
    "default_platform",
    "lowering_impls",
    "resolve_impl",
]

"""The one way through the experts: which strategy runs where, and the one platform switch.

`run_experts` is the expert computation of a layer, routed and shared: it builds the
per-platform table once (`lowering_table`: the strategy each platform group of
`jaxmoe.platforms` takes), and makes at most one `jax.lax.platform_dependent` for the
whole computation. Each branch is handed its platform group as a static value, so
``jax.jit(f).lower(lowering_platforms=("cuda",))`` (or ``jax.export``) from a CPU host
holds the CUDA branch (the Triton kernels), a lowering for ``oneapi`` the Intel branch,
and the same jitted function still runs on the CPU. `jaxmoe.moe_apply` and
`jaxmoe.moe_apply_ep` both call it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from jaxmoe.config import MoEConfig
from jaxmoe.execution import ExecConfig
from jaxmoe.experts import ExpertWeights, SharedWeights
from jaxmoe.impls.cpu import cpu_kernel_available, cpu_layer, ggml_problem, supports
from jaxmoe.impls.cpu.build import kernel_ready
from jaxmoe.impls.registry import available_impls, get_impl
from jaxmoe.platforms import (
    AUTO_IMPL,
    EXPLICIT_IMPL,
    GATHER_MAX_PAIRS,
    GROUPS,
    IMPL_GROUPS,
    PLATFORM_GROUPS,
    default_platform,
    platform_group,
)
from jaxmoe.routing import Routing


def resolve_impl(
    impl: str,
    num_pairs: int | None = None,
    platform: str | None = None,
    *,
    experts: ExpertWeights | None = None,
    dtype=None,
    built: bool = True,
) -> str:
    """The strategy ``impl`` takes on ``platform`` (a JAX platform name or a group of
    `jaxmoe.platforms.GROUPS`; default: the default device's).

    ``auto``: `jaxmoe.platforms.AUTO_IMPL` of the group; on the CPU that is ``cpu`` (the
    C++ kernel) only when ``experts`` are given, it takes them (`jaxmoe.impls.cpu.supports`)
    and it built; otherwise, and on platforms without a strategy of their own, ``gather``
    for at most `jaxmoe.platforms.GATHER_MAX_PAIRS` token pairs ``T * k`` and ``xla``
    above. An explicit name is kept, or mapped by `jaxmoe.platforms.EXPLICIT_IMPL`
    (``xla`` -> ``xla_tiled`` on Intel). ValueError for an unknown name, ``pallas`` on an
    Intel platform, ``cpu`` off the CPU. ``built=False``: ``cpu`` whenever it takes the
    experts, without asking whether the kernel built (`run_experts` asks at lowering time).
    """
    group = platform if platform in GROUPS else platform_group(platform or default_platform())
    if impl != "auto":
        get_impl(impl)  # ValueError for an unknown name
        allowed = IMPL_GROUPS.get(impl)
        if allowed is not None and group not in allowed:
            raise ValueError(
                f"impl={impl!r} cannot lower for platform {platform or default_platform()!r} "
                f"(it runs on the {'/'.join(allowed)} platform groups); use impl='auto'"
            )
        return EXPLICIT_IMPL.get(group, {}).get(impl, impl)
    name = AUTO_IMPL[group]
    if group == "cpu" and not (
        experts is not None and supports(experts, dtype or "float32") is None and (not built or cpu_kernel_available())
    ):
        name = AUTO_IMPL["default"]
    if name == "xla" and num_pairs is not None and num_pairs <= GATHER_MAX_PAIRS:
        return "gather"
    return name


def lowering_table(
    impl: str, num_pairs: int | None = None, *, experts: ExpertWeights | None = None, dtype=None
) -> dict[str, str]:
    """The strategy ``impl`` takes in each platform group (`jaxmoe.platforms.GROUPS`).

    An explicit name is first checked against the host's platform (`resolve_impl`'s
    ValueErrors); in the other groups it is kept as given (mapped by
    `jaxmoe.platforms.EXPLICIT_IMPL`), so forcing ``cpu`` and lowering for a GPU fails at
    lowering time. ``auto``'s CPU entry is ``cpu`` whenever the kernel takes the experts:
    whether it built is asked when the program is lowered for the CPU (`run_experts`).
    """
    if impl != "auto":
        resolve_impl(impl, num_pairs, experts=experts, dtype=dtype)  # unknown names, host-platform errors
        return {g: EXPLICIT_IMPL.get(g, {}).get(impl, impl) for g in GROUPS}
    return {g: resolve_impl(impl, num_pairs, g, experts=experts, dtype=dtype, built=False) for g in GROUPS}


def run_experts(
    x: jax.Array,
    routing: Routing,
    experts: ExpertWeights,
    shared: SharedWeights | None,
    cfg: MoEConfig,
    ex: ExecConfig,
) -> jax.Array:
    """Routed and shared experts of ``x [T, d]`` -> ``[T, d]`` float32, by ``ex.impl``
    resolved for the platform the program is lowered for.

    One branch per distinct ``(strategy, platform)`` pair, where ``platform`` is the group
    a strategy tells apart (`jaxmoe.impls.registry.Impl.platforms`) or ``"default"``; when
    there is more than one, one `jax.lax.platform_dependent` keeps the branch of the
    lowering platform (all of them, behind a switch, in a multi-platform `jax.export`).
    Every strategy ``auto`` picks has a reverse mode of its own, so each platform's
    gradient is its own strategy's. ``shared`` None: the routed experts only.

    ``auto``'s CPU branch holds the C++ kernel and its fallback (``gather`` / ``xla``)
    behind a `jax.lax.cond` on `jaxmoe.impls.cpu.build.kernel_ready`, a constant decided
    when the program is lowered for the CPU (XLA keeps one branch): lowering for a GPU
    never builds, loads or checks the kernel.
    """
    num_pairs = x.shape[0] * routing.expert_ids.shape[1]
    table = lowering_table(ex.impl, num_pairs, experts=experts, dtype=x.dtype)
    if ex.activations == "ggml":
        table = ggml_table(table, ex, num_pairs, experts)
    keys = {g: (name, g if g in get_impl(name).platforms else "default") for g, name in table.items()}
    if ex.activations == "int8":
        name = table[platform_group(default_platform())]
        if name == "cpu" and ex.impl == "auto" and not cpu_kernel_available():
            name = _fallback(num_pairs)
        if ex.activations not in get_impl(name).activations:
            raise ValueError(
                f"ExecConfig.activations={ex.activations!r}: impl {name!r} multiplies float activations only "
                f"(the mode is impl='cpu''s)"
            )
    if len(set(keys.values())) == 1:
        name, plat = next(iter(keys.values()))
        return _branch(name, plat, cfg, ex, x, routing, experts, shared)
    return _switch(tuple(sorted(keys.items())), cfg, ex, x, routing, experts, shared)


def ggml_table(table: dict[str, str], ex: ExecConfig, num_pairs: int, experts: ExpertWeights) -> dict[str, str]:
    """``table`` for ``activations="ggml"``: under ``auto`` a group whose strategy lacks the
    mode takes the XLA fallback (`_fallback`); an explicit strategy without it is a
    ValueError naming the strategies that have it. The C++ kernel has the mode for some
    weight kinds only (`jaxmoe.impls.cpu.ggml_problem`, whose reason an explicit ``cpu``
    raises)."""
    out = {}
    for g, name in table.items():
        why = ggml_problem(experts) if name == "cpu" else None
        if why is not None and ex.impl != "auto":
            raise ValueError(f"ExecConfig.activations='ggml': {why}")
        if why is not None or "ggml" not in get_impl(name).activations:
            if ex.impl != "auto":
                have = sorted(n for n in available_impls() if n != "auto" and "ggml" in get_impl(n).activations)
                raise ValueError(
                    f"ExecConfig.activations='ggml': impl {name!r} has no ggml arithmetic; impl='auto' or one of {have}"
                )
            name = _fallback(num_pairs)
        out[g] = name
    return out


def _fallback(num_pairs: int) -> str:
    """``auto``'s strategy on the CPU where the C++ kernel did not build."""
    return resolve_impl("auto", num_pairs, "default")


def _branch(name: str, platform: str, cfg: MoEConfig, ex: ExecConfig, x, routing, experts, shared) -> jax.Array:
    ex = dataclasses.replace(ex, platform=platform)  # the branch's platform group, static
    with jax.named_scope(f"experts_{name}"):
        if name == "cpu" and ex.impl == "auto":  # the kernel where it built (asked at lowering), else the fallback
            fallback = get_impl(_fallback(x.shape[0] * routing.expert_ids.shape[1]))

            def kernel(x, routing, experts, shared):
                return cpu_layer(x, routing, experts, shared, cfg, ex, check=False)

            def other(x, routing, experts, shared):
                return fallback.run_layer(x, routing, experts, shared, cfg, ex)

            return jax.lax.cond(kernel_ready(), kernel, other, x, routing, experts, shared)
        return get_impl(name).run_layer(x, routing, experts, shared, cfg, ex)


# Always staged: an eager (op-by-op) platform switch dispatches with the wrong argument
# count on jax 0.10 ("Wrong number of arguments: expected 15 but got 9").
@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _switch(keys: tuple[tuple[str, tuple[str, str]], ...], cfg: MoEConfig, ex: ExecConfig, *args) -> jax.Array:
    fns = {key: functools.partial(_branch, *key, cfg, ex) for key in set(dict(keys).values())}  # one per key
    table = dict(keys)
    per = {plat: fns[table[g]] for g, plats in PLATFORM_GROUPS.items() for plat in plats}
    return jax.lax.platform_dependent(*args, default=fns[table["default"]], **per)


__all__ = ["lowering_table", "resolve_impl", "run_experts"]

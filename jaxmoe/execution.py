"""How to run a layer, apart from what the layer is.

`jaxmoe.config.MoEConfig` holds the facts of the model (routing rule, widths, activation,
shared expert). `ExecConfig` holds how one call runs them: the strategy (``impl``),
batch invariance, the activation arithmetic, Pallas interpret mode and tile overrides.
`jaxmoe.moe_apply`, `jaxmoe.moe_apply_ep`, `jaxmoe.MoEBlock`, `jaxmoe.from_pretrained`
and the eval YAML (``impls:`` entries) take the same object or its fields; ``impl="..."``
stays as a shorthand for ``ExecConfig(impl=...)``.

Both are frozen and hashable (static arguments of `jax.jit`); every violation is a
ValueError that names the field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxmoe.platforms import GROUPS, host_group

#: Activation arithmetic: ``float`` (activations as given, float32 accumulation),
#: ``int8`` (``impl="cpu"`` only: activations quantized to int8 per block of 32 for
#: integer-coded experts, docs/kernels.md "int8 activations") or ``ggml`` (llama.cpp's
#: CPU arithmetic: `jaxmoe.ggml_activations`).
ACTIVATION_MODES = ("float", "int8", "ggml")

#: Layouts of ``impl="xla_tiled"`` (`jaxmoe.impls.xla_tiled`).
XLA_TILED_LAYOUTS = ("pairs", "capacity", "tiles")

#: Fields and keywords that used to say how to run, and what replaced each.
REMOVED = {
    "batch_invariant": "ExecConfig(batch_invariant=...) (the MoEConfig field was removed)",
    "int8_activations": "ExecConfig(activations='int8') (the MoEConfig field was removed)",
    "block_m": "ExecConfig(block_m=...)",
    "layout": "ExecConfig(layout=...)",
    "interpret": "ExecConfig(interpret=...)",
    "config": "ExecConfig(kernel_config=...)",
    "JAXMOE_PALLAS_INTERPRET": "ExecConfig(interpret=True / False) (the environment variable is no longer read)",
}


def _fail(field: str, msg: str) -> None:
    raise ValueError(f"ExecConfig.{field}: {msg}")


@dataclasses.dataclass(frozen=True)
class ExecConfig:
    """How one call of the layer runs.

    Attributes:
      impl: the strategy (`jaxmoe.available_impls`); ``auto`` is chosen for the platform
        the program is lowered for (`jaxmoe.impls.policy`).
      batch_invariant: a token's output bitwise independent of the batch it is in (its
        neighbours, the batch size, its position): fixed row blocks for every dot over
        tokens, fixed-order sums, fixed tiles (`jaxmoe.invariance`). Off by default: it
        costs time on every strategy (docs/performance.md).
      activations: `ACTIVATION_MODES`: ``float``, or ``int8`` (``impl="cpu"``, or
        ``auto`` where it takes ``cpu``: int8 / int4 / Q4_K / Q6_K experts multiply
        activations quantized to int8 per block of 32, ``dx = max|x| / 127``, in integers,
        as llama.cpp does; float experts keep float activations). Another explicit impl
        with ``int8`` is a ValueError; ``auto`` lowered for a platform without the kernel
        runs float activations there. Or ``ggml``: each product's activations converted
        as llama.cpp's CPU backend converts them for the weight type (Q8_0 / Q8_1 / Q8_K
        blocks, bf16 / f16 rounding; `jaxmoe.ggml_activations`), the SwiGLU output again
        before the down projection, routed and shared experts alike; the XLA strategies
        have it (``auto`` takes one of them where its strategy lacks it).
      interpret: Pallas interpret mode for ``impl="pallas"``; None: compiled where Triton
        lowers (CUDA / ROCm), interpreted on every other platform.
      block_m: rows per expert tile of ``xla`` / ``xla_tiled`` (None: chosen from the
        call's size, or the fixed invariant tile).
      layout: ``xla_tiled``'s layout (`XLA_TILED_LAYOUTS`; None: chosen from ``block_m``).
      kernel_config: the Pallas kernels' block sizes (a `pallas_kernels.tuning.KernelConfig`;
        None: chosen from the call's size).
      platform: the platform group the program is lowered for (`jaxmoe.platforms.GROUPS`),
        set by `jaxmoe.impls.policy.run_experts` on each branch of its one platform switch,
        so no strategy asks for the platform again; None (what a caller passes): the
        default device's group when a strategy is called directly.
    """

    impl: str = "auto"
    batch_invariant: bool = False
    activations: str = "float"
    interpret: bool | None = None
    block_m: int | None = None
    layout: str | None = None
    kernel_config: Any = None
    platform: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.impl, str) or not self.impl:
            _fail("impl", f"must be a strategy name (a non-empty string), got {self.impl!r}")
        if not isinstance(self.batch_invariant, bool):
            _fail("batch_invariant", f"must be true or false, got {self.batch_invariant!r}")
        if self.activations not in ACTIVATION_MODES:
            _fail("activations", f"unknown {self.activations!r}; expected one of {ACTIVATION_MODES}")
        if self.activations == "int8" and self.impl not in ("auto", "cpu"):
            _fail("activations", f"{self.activations!r} is a mode of impl='cpu' (or 'auto'); impl is {self.impl!r}")
        if self.interpret is not None and not isinstance(self.interpret, bool):
            _fail("interpret", f"must be true, false or null, got {self.interpret!r}")
        if self.block_m is not None and (
            not isinstance(self.block_m, int) or isinstance(self.block_m, bool) or self.block_m < 1
        ):
            _fail("block_m", f"must be a positive int or null, got {self.block_m!r}")
        if self.layout is not None and self.layout not in XLA_TILED_LAYOUTS:
            _fail("layout", f"unknown {self.layout!r}; expected one of {XLA_TILED_LAYOUTS}")
        if self.platform is not None and self.platform not in GROUPS:
            _fail("platform", f"unknown {self.platform!r}; expected one of {GROUPS} or null")

    @property
    def label(self) -> str:
        """A short name for reports: the impl, then each field that differs from its
        default as ``field=value`` (``cpu`` / ``cpu,activations=int8``)."""
        parts = [self.impl]
        for f in dataclasses.fields(self):
            if f.name in ("impl", "platform"):
                continue
            v = getattr(self, f.name)
            if v != f.default:
                parts.append(f"{f.name}={v}")
        return ",".join(parts)

    @property
    def group(self) -> str:
        """``platform``, or the default device's group when it is None."""
        return self.platform or host_group()

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if self.kernel_config is not None:
            d["kernel_config"] = repr(self.kernel_config)
        return d


FIELDS = tuple(f.name for f in dataclasses.fields(ExecConfig))


def reject_removed(kwargs: Mapping[str, Any], where: str) -> None:
    """TypeError naming the replacement of the first removed keyword in ``kwargs``, or of
    any other unexpected keyword."""
    for k in kwargs:
        if k in REMOVED:
            raise TypeError(f"{where}: keyword {k!r} was removed; use {REMOVED[k]}")
        raise TypeError(f"{where}: unexpected keyword {k!r}")


def exec_config(ex: ExecConfig | None = None, impl: str | None = None, **kwargs) -> ExecConfig:
    """The call's `ExecConfig`: ``ex`` (default ``ExecConfig()``), with ``impl`` when
    given. Both given and disagreeing is a ValueError; other keywords: `reject_removed`."""
    reject_removed(kwargs, "exec_config")
    if ex is None:
        return ExecConfig(impl=impl or "auto")
    if not isinstance(ex, ExecConfig):
        raise ValueError(f"exec: expected an ExecConfig, got {type(ex).__name__}")
    if impl is not None and impl != ex.impl:
        if ex.impl != "auto":
            raise ValueError(f"impl={impl!r} disagrees with ExecConfig.impl={ex.impl!r}; pass one of them")
        return dataclasses.replace(ex, impl=impl)
    return ex


def exec_from_dict(d: Mapping[str, Any] | str, *, source: str = "<dict>") -> ExecConfig:
    """An `ExecConfig` from a YAML value: an impl name, or a mapping of its fields
    (``{impl: cpu, activations: int8}``). Unknown or removed keys are errors naming them."""
    if isinstance(d, str):
        return ExecConfig(impl=d)
    if not isinstance(d, Mapping):
        raise ValueError(f"{source}: expected an impl name or a mapping of ExecConfig fields, got {d!r}")
    for k in d:
        if k in REMOVED and k not in FIELDS:
            raise ValueError(f"{source}: key {k!r} was removed; use {REMOVED[k]}")
        if k not in FIELDS or k in ("kernel_config", "platform"):
            known = [f for f in FIELDS if f not in ("kernel_config", "platform")]
            raise ValueError(f"{source}: unknown key {k!r}; known: {known}")
    try:
        return ExecConfig(**dict(d))
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


__all__ = [
    "ACTIVATION_MODES",
    "FIELDS",
    "REMOVED",
    "XLA_TILED_LAYOUTS",
    "ExecConfig",
    "exec_config",
    "exec_from_dict",
    "reject_removed",
]

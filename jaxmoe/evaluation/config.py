"""The ``default`` kind of eval config: its schema, its cross-field checks and its loader.

A config without a ``kind`` key (or with ``kind: default``) measures every impl against
a reference, layer by layer (`jaxmoe.evaluation.runner` runs it). It is YAML with the
sections below, checked by the schema engine of `jaxmoe.evaluation.schema`: an unknown
key or a value of the wrong type is a `ConfigError` (a ``ValueError``) that names the
file and the dotted key (and the ``--set`` override it came from, if any).

```yaml
kind: default                 # optional
name: default                 # run name (defaults to the file's stem)
model:
  preset: qwen3.6-35b-a3b     # a preset name, a list of them, or "all"   (or path:)
  path: null                  # a model YAML, a GGUF file, or an HF / MLX checkpoint dir
  layers: [0]                 # layer indices (must be MoE layers)
  shrink: null                # {d_model, expert_dim, shared_expert_dim, num_experts, top_k}
  seed: 0                     # random weights (presets and YAML configs)
  weight_scale: 1.0
  dtype: float32              # base parameter dtype: the reference is computed from these
inputs: {kind: random, seed: 0, scale: 1.0, path: null, stats_tokens: 512}
impls: [auto, xla, gather, dense]  # and cpu_int8: impl cpu with MoEConfig.int8_activations
tokens: [1, 8, 64]
dtypes: null                  # compute dtypes of the cases; default [model.dtype]
quantize: [none]              # none | int8 (GGUF Q8_0, group 32) | int4 (MLX affine, group 64)
reference: {impl: float64, max_tokens: 64}   # or a plain string: `reference: float64`
repeats: 5                    # timed calls per case (after the compile call and `warmup` calls)
warmup: 1
time_budget_s: null           # stop timing a case once its timed calls exceed this (>= 3 calls)
impl_max_tokens: {dense: 1}   # token counts above the cap are recorded as skipped
tolerance: {default: 1.0e-4}  # max |y - ref| / max |ref|, by case label, quantize, dtype or impl
min_routing_agreement: 0.0    # fraction of tokens whose selected expert set matches the reference
output_dir: runs
plots: true
heatmap_tokens: 32
```
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Literal

from jaxmoe.config import MoEConfig, list_presets
from jaxmoe.evaluation.schema import (
    Context,
    check_impls,
    check_name,
    find_config,
    mapping_reader,
    read_config_file,
    to_plain,
)
from jaxmoe.impls.registry import available_impls

DTYPES = ("float32", "bfloat16", "float16")
QUANTIZE = ("none", "int8", "int4")
#: The reference that is not an impl: the float64 numpy forward of `jaxmoe.evaluation.reference`.
FLOAT64_REFERENCE = "float64"


@dataclasses.dataclass(frozen=True)
class ShrinkSection:
    """Smaller widths for a preset (a correctness sweep at shrunk size); None keeps the preset's."""

    d_model: int | None = None
    expert_dim: int | None = None
    shared_expert_dim: int | None = None
    num_experts: int | None = None
    top_k: int | None = None


@dataclasses.dataclass(frozen=True)
class ModelSection:
    preset: str | tuple[str, ...] | None = None
    path: str | None = None
    layers: tuple[int, ...] = (0,)
    shrink: ShrinkSection | None = None
    seed: int = 0
    weight_scale: float = 1.0
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"


@dataclasses.dataclass(frozen=True)
class InputsSection:
    """Activations fed to each layer: seeded normal ``scale * N(0, 1)`` or rows of an ``.npy`` file."""

    kind: Literal["random", "npy"] = "random"
    seed: int = 0
    scale: float = 1.0
    path: str | None = None
    stats_tokens: int = 512


@dataclasses.dataclass(frozen=True)
class ReferenceSection:
    """``impl: float64`` (numpy float64 forward) or a registered impl name, on the first ``max_tokens`` tokens."""

    impl: str = FLOAT64_REFERENCE
    max_tokens: int = 64


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """One evaluation run of the ``default`` kind (see the module docstring for the YAML form)."""

    kind: Literal["default"] = "default"
    model: ModelSection
    name: str = ""
    description: str = ""
    inputs: InputsSection = InputsSection()
    impls: tuple[str, ...] = ("auto",)
    tokens: tuple[int, ...] = (1, 8, 64)
    dtypes: tuple[Literal["float32", "bfloat16", "float16"], ...] | None = None
    quantize: tuple[Literal["none", "int8", "int4"], ...] = ("none",)
    reference: ReferenceSection | str = ReferenceSection()
    repeats: int = 5
    warmup: int = 1
    time_budget_s: float | None = None
    impl_max_tokens: dict[str, int] = dataclasses.field(default_factory=dict)
    tolerance: dict[str, float] = dataclasses.field(default_factory=lambda: {"default": 1e-4})
    min_routing_agreement: float = 0.0
    output_dir: str = "runs"
    plots: bool = True
    heatmap_tokens: int = 32

    @property
    def ref(self) -> ReferenceSection:
        return self.reference if isinstance(self.reference, ReferenceSection) else ReferenceSection(impl=self.reference)

    @property
    def case_dtypes(self) -> tuple[str, ...]:
        return self.dtypes if self.dtypes else (self.model.dtype,)

    def to_dict(self) -> dict[str, Any]:
        """The resolved config as plain YAML/JSON data (tuples as lists)."""
        d = to_plain(self)
        d["reference"] = to_plain(self.ref)
        d["dtypes"] = list(self.case_dtypes)
        return d


# --------------------------------------------------------------------------- loading


def load_eval_config(name_or_path: str | os.PathLike, overrides: list[str] | None = None) -> EvalConfig:
    """Reads, overrides and validates a ``default``-kind eval config; every problem is a `ConfigError`."""
    path = find_config(name_or_path)
    return config_from_mapping(read_config_file(path), str(path), overrides, default_name=path.stem)


# --------------------------------------------------------------------------- cross-field checks


def check(cfg: EvalConfig, ctx: Context) -> None:
    """Checks that need more than one key or the installed library (impls, presets, files)."""
    m = cfg.model
    if m.preset is None and m.path is None:
        ctx.fail(
            "model.path",
            "neither model.preset (preset name(s) or 'all') nor model.path (a model YAML, "
            "GGUF file or HF / MLX checkpoint dir) is set; give one, e.g. --set model.path=FILE",
        )
    if m.preset is not None and m.path is not None:
        ctx.fail("model", "give only one of model.preset and model.path")
    if m.preset is not None:
        names = (m.preset,) if isinstance(m.preset, str) else m.preset
        if not names:
            ctx.fail("model.preset", "is an empty list")
        known = list_presets()
        for n in names:
            if n != "all" and n not in known:
                ctx.fail("model.preset", f"unknown preset {n!r}; available: {known}")
    if m.path is not None:
        p = Path(m.path)
        if not p.exists():
            ctx.fail("model.path", f"{m.path} does not exist")
        if m.shrink is not None and p.suffix not in (".yaml", ".yml"):
            ctx.fail("model.shrink", "only applies to random weights (a preset or a model YAML), not a checkpoint")
    if not m.layers:
        ctx.fail("model.layers", "is an empty list")
    for i, layer in enumerate(m.layers):
        if layer < 0:
            ctx.fail(f"model.layers[{i}]", f"must be >= 0, got {layer}")
    if len(set(m.layers)) != len(m.layers):
        ctx.fail("model.layers", f"has duplicates: {list(m.layers)}")
    if m.shrink is not None:
        for f in dataclasses.fields(ShrinkSection):
            v = getattr(m.shrink, f.name)
            if v is not None and v < 1:
                ctx.fail(f"model.shrink.{f.name}", f"must be >= 1, got {v}")
    if not m.weight_scale > 0:
        ctx.fail("model.weight_scale", f"must be > 0, got {m.weight_scale}")

    inp = cfg.inputs
    if inp.kind == "npy":
        if inp.path is None:
            ctx.fail("inputs.path", "is required with inputs.kind: npy")
        if not Path(inp.path).is_file():
            ctx.fail("inputs.path", f"{inp.path} does not exist")
    elif inp.path is not None:
        ctx.fail("inputs.path", "is only read with inputs.kind: npy (kind is 'random')")
    if not inp.scale > 0:
        ctx.fail("inputs.scale", f"must be > 0, got {inp.scale}")
    if inp.stats_tokens < 1:
        ctx.fail("inputs.stats_tokens", f"must be >= 1, got {inp.stats_tokens}")

    impls = eval_impls()
    check_impls(ctx, cfg.impls, impls)
    if not cfg.tokens:
        ctx.fail("tokens", "is an empty list")
    for i, t in enumerate(cfg.tokens):
        if t < 1:
            ctx.fail(f"tokens[{i}]", f"must be >= 1, got {t}")
    if len(set(cfg.tokens)) != len(cfg.tokens):
        ctx.fail("tokens", f"has duplicates: {list(cfg.tokens)}")
    if cfg.dtypes is not None and (not cfg.dtypes or len(set(cfg.dtypes)) != len(cfg.dtypes)):
        ctx.fail("dtypes", f"must be a non-empty list without duplicates (or null), got {list(cfg.dtypes)}")
    if not cfg.quantize or len(set(cfg.quantize)) != len(cfg.quantize):
        ctx.fail("quantize", f"must be a non-empty list without duplicates, got {list(cfg.quantize)}")
    ref = cfg.ref
    if ref.impl != FLOAT64_REFERENCE and ref.impl not in impls:
        ctx.fail(
            "reference.impl" if isinstance(cfg.reference, ReferenceSection) else "reference",
            f"must be {FLOAT64_REFERENCE!r} or an available impl {impls}, got {ref.impl!r}",
        )
    if ref.max_tokens < 1:
        ctx.fail("reference.max_tokens", f"must be >= 1, got {ref.max_tokens}")
    if cfg.repeats < 1:
        ctx.fail("repeats", f"must be >= 1, got {cfg.repeats}")
    if cfg.warmup < 0:
        ctx.fail("warmup", f"must be >= 0, got {cfg.warmup}")
    if cfg.time_budget_s is not None and not cfg.time_budget_s > 0:
        ctx.fail("time_budget_s", f"must be > 0 (or null), got {cfg.time_budget_s}")
    for k, v in cfg.impl_max_tokens.items():
        if k not in impls:
            ctx.fail(f"impl_max_tokens.{k}", f"is not an available impl {impls}")
        if v < 1:
            ctx.fail(f"impl_max_tokens.{k}", f"must be >= 1, got {v}")
    # any impl, dtype or quantize name (a shipped config's entry for an impl that --set
    # impls=[...] left out is unused, not wrong); a label only of this config's cases
    vocab = {"default", *impls, *DTYPES, *QUANTIZE}
    labels = {case_label(i, d, q) for i in cfg.impls for d in cfg.case_dtypes for q in cfg.quantize}
    for k, v in cfg.tolerance.items():
        if k not in vocab and k not in labels:
            ctx.fail(
                f"tolerance.{k}",
                f"matches no case; use 'default', an impl, dtype or quantize "
                f"name, or a case label of this config such as {sorted(labels)[0]!r}",
            )
        if not v > 0:
            ctx.fail(f"tolerance.{k}", f"must be > 0, got {v}")
    if not 0.0 <= cfg.min_routing_agreement <= 1.0:
        ctx.fail("min_routing_agreement", f"must lie in [0, 1], got {cfg.min_routing_agreement}")
    if cfg.heatmap_tokens < 1:
        ctx.fail("heatmap_tokens", f"must be >= 1, got {cfg.heatmap_tokens}")
    check_name(ctx, cfg.name)


config_from_mapping = mapping_reader(EvalConfig, check, default_name="eval")


#: An eval impl that is no `jaxmoe.moe_apply` impl: ``cpu`` (the C++ kernel) with
#: `MoEConfig.int8_activations` on, so int8 / int4 / Q4_K / Q6_K experts multiply their
#: inputs quantized to int8 per block of 32 (what llama.cpp does; the error bound against
#: float activations is in docs/design.md, "int8 activations"). Float experts and the
#: other block kinds keep float activations.
INT8_IMPL = "cpu_int8"


def eval_impls() -> list[str]:
    """The impl names a ``default`` eval takes: `jaxmoe.available_impls` and `INT8_IMPL`
    (where the C++ kernel cannot build, its cases are errors, as ``cpu``'s are)."""
    return [*available_impls(), INT8_IMPL]


def moe_call(impl: str, cfg: MoEConfig) -> tuple[str, MoEConfig]:
    """The `jaxmoe.moe_apply` impl and config an eval impl runs: ``cpu`` with
    ``int8_activations`` for `INT8_IMPL`, any other name as it is."""
    if impl == INT8_IMPL:
        return "cpu", dataclasses.replace(cfg, int8_activations=True)
    return impl, cfg


def case_label(impl: str, dtype: str, quantize: str) -> str:
    """``impl/dtype`` or ``impl/dtype/quantize``: how a case is named in tables and tolerances."""
    return f"{impl}/{dtype}" if quantize == "none" else f"{impl}/{dtype}/{quantize}"


def case_tolerance(cfg: EvalConfig, impl: str, dtype: str, quantize: str) -> float:
    """A case's relative-error tolerance: its label's entry if given, else the largest entry
    among its impl, dtype and quantize names, else ``default`` (1e-4 when absent)."""
    tol = cfg.tolerance
    label = case_label(impl, dtype, quantize)
    if label in tol:
        return tol[label]
    hits = [tol[k] for k in (impl, dtype, quantize) if k in tol]
    if hits:
        return max(hits)
    return tol.get("default", 1e-4)

"""The ``default`` kind of eval config: its schema, its cross-field checks and its loader.

A config without a ``kind`` key (or with ``kind: default``) measures every impl against
a reference, layer by layer (`jaxmoe.evaluation.runner` runs it). It is YAML with the
sections below, checked by the schema engine of `jaxmoe.evaluation.schema`: an unknown
key or a value of the wrong type is a `ConfigError` (a ``ValueError``) that names the
file and the dotted key (and the ``--set`` override it came from, if any).

Each ``impls:`` entry says how the layer runs: an impl name (``cpu``) or a mapping of
`jaxmoe.execution.ExecConfig` fields (``{impl: cpu, activations: int8}``); results,
reports, tolerances and ``impl_max_tokens`` name it by its `ExecConfig.label`
(``cpu,activations=int8``).

```yaml
kind: default                 # optional
name: default                 # run name (defaults to the file's stem)
model:
  preset: qwen3.6-35b-a3b     # a preset name, a list of them, or "all"   (or path:)
  path: null                  # a model YAML, a GGUF file, or an HF / MLX checkpoint dir
  layers: [0]                 # layer indices (must be MoE layers)
  shrink: null                # {d_model, expert_dim, shared_expert_dim, num_experts, top_k} (presets.shrink_config)
  seed: 0                     # random weights (presets and YAML configs)
  weight_scale: 1.0
  dtype: float32              # base parameter dtype: the reference is computed from these
inputs: {kind: random, seed: 0, scale: 1.0, path: null, stats_tokens: 512}
impls: [auto, xla, {impl: cpu, activations: int8}]  # impl names or mappings of ExecConfig fields
tokens: [1, 8, 64]
dtypes: null                  # compute dtypes of the cases; default [model.dtype]
quantize: [none]              # none | int8 (GGUF Q8_0, group 32) | int4 (MLX affine, group 64)
reference: {impl: float64, max_tokens: 64}   # or a plain string: `reference: float64`
repeats: 5                    # timed calls per case (after the compile call and `warmup` calls)
warmup: 1
time_budget_s: null           # stop timing a case once its timed calls exceed this (>= 3 calls)
impl_max_tokens: {dense: 1}   # by impl or entry label; token counts above the cap are recorded as skipped
tolerance: {default: 1.0e-4}  # max |y - ref| / max |ref|, by case label, quantize, dtype, entry label or impl
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

from jaxmoe.evaluation.presets import ShrinkSection
from jaxmoe.evaluation.schema import (
    REMOVED_IMPLS,
    Context,
    RunConfig,
    exec_of_label,
    find_config,
    mapping_reader,
    read_config_file,
    removed_impl,
    to_plain,
)
from jaxmoe.execution import ExecConfig
from jaxmoe.impls.registry import available_impls

DTYPES = ("float32", "bfloat16", "float16")
QUANTIZE = ("none", "int8", "int4")
#: The reference that is not an impl: the float64 numpy forward of `jaxmoe.evaluation.reference`.
FLOAT64_REFERENCE = "float64"


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
class EvalConfig(RunConfig):
    """One evaluation run of the ``default`` kind (see the module docstring for the YAML form)."""

    kind: Literal["default"] = "default"
    model: ModelSection
    inputs: InputsSection = InputsSection()
    impls: tuple[ExecConfig, ...] = (ExecConfig(),)
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
        for n in names:
            if n != "all":
                ctx.check_preset("model.preset", n)
    if m.path is not None:
        p = Path(m.path)
        if not p.exists():
            ctx.fail("model.path", f"{m.path} does not exist")
        if m.shrink is not None and p.suffix not in (".yaml", ".yml"):
            ctx.fail("model.shrink", "only applies to random weights (a preset or a model YAML), not a checkpoint")
    ctx.check_list("model.layers", m.layers, lo=0)
    ctx.check_shrink("model.shrink", m.shrink)  # per preset: `sources.layer_specs`
    ctx.check_positive("model.weight_scale", m.weight_scale)

    inp = cfg.inputs
    if inp.kind == "npy":
        if inp.path is None:
            ctx.fail("inputs.path", "is required with inputs.kind: npy")
        if not Path(inp.path).is_file():
            ctx.fail("inputs.path", f"{inp.path} does not exist")
    elif inp.path is not None:
        ctx.fail("inputs.path", "is only read with inputs.kind: npy (kind is 'random')")
    ctx.check_positive("inputs.scale", inp.scale)
    ctx.check_min("inputs.stats_tokens", inp.stats_tokens)

    impls = available_impls()
    ctx.check_execs("impls", cfg.impls, impls)
    ctx.check_list("tokens", cfg.tokens)
    if cfg.dtypes is not None:
        ctx.check_list("dtypes", cfg.dtypes, lo=None)
    ctx.check_list("quantize", cfg.quantize, lo=None)
    ref = cfg.ref
    if ref.impl != FLOAT64_REFERENCE and ref.impl not in impls:
        ctx.fail(
            "reference.impl" if isinstance(cfg.reference, ReferenceSection) else "reference",
            f"must be {FLOAT64_REFERENCE!r} or an available impl {impls}, got {ref.impl!r}",
        )
    ctx.check_min("reference.max_tokens", ref.max_tokens)
    ctx.check_min("repeats", cfg.repeats)
    ctx.check_min("warmup", cfg.warmup, 0)
    if cfg.time_budget_s is not None:
        ctx.check_positive("time_budget_s", cfg.time_budget_s)
    ctx.check_caps("impl_max_tokens", cfg.impl_max_tokens, cfg.impls, impls)
    # any impl, dtype or quantize name or entry label (a shipped config's tolerance for an
    # entry that --set impls=[...] left out is unused, not wrong); a case label only of this config
    vocab = {"default", *impls, *DTYPES, *QUANTIZE, *(ex.label for ex in cfg.impls)}
    labels = {case_label(ex, d, q) for ex in cfg.impls for d in cfg.case_dtypes for q in cfg.quantize}
    for k, v in cfg.tolerance.items():
        if k in REMOVED_IMPLS:
            ctx.fail(f"tolerance.{k}", removed_impl(k))
        if k not in vocab and k not in labels and not _names_an_entry(k, impls):
            ctx.fail(
                f"tolerance.{k}",
                f"matches no case; use 'default', an impl, dtype or quantize "
                f"name, or a case label of this config such as {sorted(labels)[0]!r}",
            )
        ctx.check_positive(f"tolerance.{k}", v)
    ctx.check_fraction("min_routing_agreement", cfg.min_routing_agreement)
    ctx.check_min("heatmap_tokens", cfg.heatmap_tokens)
    ctx.check_name(cfg.name)


config_from_mapping = mapping_reader(EvalConfig, check, default_name="eval")


def _names_an_entry(label: str, impls: list[str]) -> bool:
    """``label`` is the label of an entry of an available impl (one ``--set impls=[...]`` may
    have left out)."""
    try:
        return exec_of_label(label).impl in impls
    except ValueError:
        return False


def case_label(ex: ExecConfig | str, dtype: str, quantize: str) -> str:
    """``label/dtype`` or ``label/dtype/quantize`` (``label``: the entry's `ExecConfig.label`,
    or an impl name): how a case is named in tables and tolerances."""
    label = ex.label if isinstance(ex, ExecConfig) else ex
    return f"{label}/{dtype}" if quantize == "none" else f"{label}/{dtype}/{quantize}"


def case_tolerance(cfg: EvalConfig, ex: ExecConfig | str, dtype: str, quantize: str) -> float:
    """A case's relative-error tolerance: its case label's entry if given, else the largest
    entry among its entry label, impl, dtype and quantize names, else ``default`` (1e-4
    when absent). ``ex``: the entry, or an impl name (the entry ``ExecConfig(impl=ex)``)."""
    ex = ex if isinstance(ex, ExecConfig) else ExecConfig(impl=ex)
    tol = cfg.tolerance
    label = case_label(ex, dtype, quantize)
    if label in tol:
        return tol[label]
    hits = [tol[k] for k in {ex.label, ex.impl, dtype, quantize} if k in tol]
    if hits:
        return max(hits)
    return tol.get("default", 1e-4)

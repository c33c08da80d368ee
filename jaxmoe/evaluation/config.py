"""The schema of an evaluation config (``configs/evals/*.yaml``) and its loader.

An eval config is YAML with the sections below; every key is checked on load, and an
unknown key or a value of the wrong type is a `ConfigError` (a ``ValueError``) that
names the file and the dotted key (and the ``--set`` override it came from, if any).

```yaml
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
impls: [auto, xla, gather, dense]
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
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

DTYPES = ("float32", "bfloat16", "float16")
QUANTIZE = ("none", "int8", "int4")
#: The reference that is not an impl: the float64 numpy forward of `jaxmoe.evaluation.reference`.
FLOAT64_REFERENCE = "float64"


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-4`` (no dot) as a float, as YAML 1.2 does."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                 |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                 |\.[0-9_]+(?:[eE][-+][0-9]+)?
                 |[-+]?\.(?:inf|Inf|INF)
                 |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def yaml_load(text_or_stream):
    """``yaml.safe_load`` with YAML 1.2 floats (``1e-4``)."""
    return yaml.load(text_or_stream, Loader=_Loader)


class ConfigError(ValueError):
    """A bad eval config: the message names the file and the key at fault."""


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


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """One evaluation run (see the module docstring for the YAML form)."""

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

        def plain(v):
            if dataclasses.is_dataclass(v):
                return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
            if isinstance(v, (list, tuple)):
                return [plain(a) for a in v]
            if isinstance(v, dict):
                return {k: plain(a) for k, a in v.items()}
            return v

        d = plain(self)
        d["reference"] = plain(self.ref)
        d["dtypes"] = list(self.case_dtypes)
        return d


# --------------------------------------------------------------------------- typed coercion


def _tname(tp) -> str:
    if tp is type(None):
        return "null"
    if isinstance(tp, type):
        return {"int": "an int", "float": "a number", "str": "a string", "bool": "a bool"}.get(tp.__name__, tp.__name__)
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(tp)))
    if typing.get_origin(tp) in (tuple, list):
        return f"a list of {_tname(typing.get_args(tp)[0])}"
    if typing.get_origin(tp) is dict:
        return f"a mapping to {_tname(typing.get_args(tp)[1])}"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return str(tp)


class _Ctx:
    def __init__(self, source: str, overrides: dict[str, str]):
        self.source = source
        self.overrides = overrides

    def fail(self, key: str, msg: str) -> typing.NoReturn:
        where = f"key '{key}'" if key else "the top level"
        for ok, text in self.overrides.items():
            if key == ok or key.startswith(ok + ".") or (key and ok.startswith(key + ".")):
                where += f" (from --set {text})"
                break
        raise ConfigError(f"{self.source}: {where}: {msg}")


def _coerce(value: Any, tp: Any, key: str, ctx: _Ctx) -> Any:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            ctx.fail(key, f"must be {' or '.join(_tname(a) for a in args)}, got null")
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key, ctx)
            except ConfigError as e:
                errors.append(e)
        if len(errors) == 1:
            raise errors[0]
        ctx.fail(
            key,
            f"must be {' or '.join(_tname(a) for a in args if a is not type(None))}, "
            f"got {type(value).__name__} {value!r}",
        )
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            ctx.fail(key, f"must be one of {list(choices)}, got {value!r}")
        return value
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            ctx.fail(key, f"must be {_tname(tp)}, got {type(value).__name__} {value!r}")
        el = typing.get_args(tp)[0]
        return tuple(_coerce(v, el, f"{key}[{i}]", ctx) for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            ctx.fail(key, f"must be {_tname(tp)}, got {type(value).__name__} {value!r}")
        kt, vt = typing.get_args(tp)
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                ctx.fail(key, f"keys must be strings, got {k!r}")
            out[k] = _coerce(v, vt, f"{key}.{k}", ctx)
        return out
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key, ctx)
    if tp is bool:
        if not isinstance(value, bool):
            ctx.fail(key, f"must be a bool (true/false), got {type(value).__name__} {value!r}")
        return value
    if tp is int:
        if not isinstance(value, int) or isinstance(value, bool):
            ctx.fail(key, f"must be an int, got {type(value).__name__} {value!r}")
        return value
    if tp is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            ctx.fail(key, f"must be a number, got {type(value).__name__} {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            ctx.fail(key, f"must be a string, got {type(value).__name__} {value!r}")
        return value
    raise TypeError(f"eval config schema: unsupported type {tp!r} at {key}")  # a bug in this module


def _build(cls, data: Any, key: str, ctx: _Ctx):
    if not isinstance(data, dict):
        ctx.fail(key, f"must be a mapping, got {type(data).__name__} {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for k in data:
        if k not in fields:
            sub = f"{key}.{k}" if key else str(k)
            ctx.fail(sub, f"unknown key; known keys{' of ' + key if key else ''}: {sorted(fields)}")
    kw = {}
    for name, f in fields.items():
        sub = f"{key}.{name}" if key else name
        if name in data:
            kw[name] = _coerce(data[name], hints[name], sub, ctx)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            ctx.fail(sub, "is required")
    return cls(**kw)


# --------------------------------------------------------------------------- --set overrides


def parse_override(text: str) -> tuple[str, Any]:
    """``"model.seed=3"`` -> ``("model.seed", 3)``; the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected key=value (dotted key, YAML value)")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not p for p in key.split(".")):
        raise ConfigError(f"--set {text!r}: bad key {key!r}")
    try:
        value = yaml_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {text!r}: the value is not valid YAML ({e})") from None
    return key, value


def apply_overrides(data: dict, overrides: list[str]) -> tuple[dict, dict[str, str]]:
    """Applies ``--set key=value`` overrides to the raw config mapping (a copy).

    Intermediate mappings are created where missing or null. Returns the new mapping and
    ``{dotted key: original text}`` so later errors can name the override.
    """
    import copy

    data = copy.deepcopy(data)
    seen: dict[str, str] = {}
    for text in overrides:
        key, value = parse_override(text)
        parts = key.split(".")
        node = data
        for i, p in enumerate(parts[:-1]):
            nxt = node.get(p)
            if nxt is None:
                nxt = node[p] = {}
            elif not isinstance(nxt, dict):
                raise ConfigError(
                    f"--set {text!r}: key '{'.'.join(parts[: i + 1])}' holds "
                    f"{type(nxt).__name__} {nxt!r}, not a mapping"
                )
            node = nxt
        node[parts[-1]] = value
        seen[key] = text
    return data, seen


# --------------------------------------------------------------------------- loading


def evals_dir() -> Path:
    """Directory of the shipped eval configs (``configs/evals``)."""
    env = os.environ.get("JAXMOE_CONFIGS")
    if env:
        return Path(env) / "evals"
    here = Path(__file__).resolve().parent.parent
    for cand in (here.parent / "configs" / "evals", here / "configs" / "evals"):
        if cand.is_dir():
            return cand
    return here.parent / "configs" / "evals"


def list_eval_configs() -> list[str]:
    return sorted(p.stem for p in evals_dir().glob("*.yaml"))


def find_config(name_or_path: str | os.PathLike) -> Path:
    """A YAML path, or the name of a shipped config (``default`` -> configs/evals/default.yaml)."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    cand = evals_dir() / f"{name_or_path}.yaml"
    if p.suffix not in (".yaml", ".yml") and cand.is_file():
        return cand
    raise ConfigError(
        f"eval config {str(name_or_path)!r} not found (not a file, not one of {list_eval_configs()} in {evals_dir()})"
    )


def config_from_mapping(
    data: Any, source: str = "<mapping>", overrides: list[str] | None = None, default_name: str = "eval"
) -> EvalConfig:
    """Validates a raw mapping (with ``--set`` overrides applied) into an `EvalConfig`."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping, got {type(data).__name__}")
    data, seen = apply_overrides(data, list(overrides or []))
    ctx = _Ctx(source, seen)
    cfg = _build(EvalConfig, data, "", ctx)
    if not cfg.name:
        cfg = dataclasses.replace(cfg, name=default_name)
    check(cfg, ctx)
    return cfg


def load_eval_config(name_or_path: str | os.PathLike, overrides: list[str] | None = None) -> EvalConfig:
    """Reads, overrides and validates an eval config; every problem is a `ConfigError`."""
    path = find_config(name_or_path)
    try:
        with open(path) as f:
            data = yaml_load(f)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    return config_from_mapping(data, str(path), overrides, default_name=path.stem)


# --------------------------------------------------------------------------- cross-field checks


def _known_impls() -> list[str]:
    from jaxmoe import backends

    backends._load_optional()
    return backends.available_impls()


def check(cfg: EvalConfig, ctx: _Ctx) -> None:
    """Checks that need more than one key or the installed library (impls, presets, files)."""
    from jaxmoe.config import list_presets

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

    impls = _known_impls()
    if not cfg.impls:
        ctx.fail("impls", "is an empty list")
    for i, name in enumerate(cfg.impls):
        if name not in impls:
            ctx.fail(f"impls[{i}]", f"impl {name!r} is not available here; available: {impls}")
    if len(set(cfg.impls)) != len(cfg.impls):
        ctx.fail("impls", f"has duplicates: {list(cfg.impls)}")
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
    vocab = {"default", *cfg.impls, *cfg.case_dtypes, *cfg.quantize}
    labels = {case_label(i, d, q) for i in cfg.impls for d in cfg.case_dtypes for q in cfg.quantize}
    for k, v in cfg.tolerance.items():
        if k not in vocab and k not in labels:
            ctx.fail(
                f"tolerance.{k}",
                f"matches no case; use 'default', an impl, dtype or quantize "
                f"name of this config, or a case label such as {sorted(labels)[0]!r}",
            )
        if not v > 0:
            ctx.fail(f"tolerance.{k}", f"must be > 0, got {v}")
    if not 0.0 <= cfg.min_routing_agreement <= 1.0:
        ctx.fail("min_routing_agreement", f"must lie in [0, 1], got {cfg.min_routing_agreement}")
    if cfg.heatmap_tokens < 1:
        ctx.fail("heatmap_tokens", f"must be >= 1, got {cfg.heatmap_tokens}")
    if not cfg.name or any(c in cfg.name for c in "/\\"):
        ctx.fail("name", f"must be a non-empty name without slashes, got {cfg.name!r}")


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

"""The schema engine every eval config goes through, whatever its kind.

An eval config is a YAML mapping. Its top-level ``kind`` key says which run it describes
(``default`` when absent; see `jaxmoe.evaluation.kinds`), and each kind declares its
schema as frozen dataclasses: a field's type annotation is the rule its value must
follow (``int``, ``float``, ``str``, ``bool``, ``Literal[...]``, ``X | None``,
``tuple[X, ...]``, ``dict[str, X]`` or a nested dataclass, i.e. a section), a field
without a default is required. `validate` applies the ``--set key=value`` overrides,
builds the dataclass (`build`), fills in ``name`` and runs the kind's cross-field check.
Every problem is a `ConfigError` (a ``ValueError``) that names the file, the dotted key
(``model.shrink.d_model``, ``mesh[2].expert``) and the ``--set`` override it came from.

This module also finds the config files: `find_config` takes a path or the name of a
shipped config in `evals_dir` (``configs/evals``), `read_config_file` parses one.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from jaxmoe.config import MoEConfig, configs_root, list_presets
from jaxmoe.evaluation.presets import ShrinkSection, shrink_config
from jaxmoe.execution import REMOVED, ExecConfig, exec_from_dict

#: The top-level key naming a config's kind, and the kind of a config without one.
KIND_KEY = "kind"
DEFAULT_KIND = "default"

#: Eval-only impl names that were removed, and the ``impls:`` entry that replaced each.
REMOVED_IMPLS = {"cpu_int8": ExecConfig(impl="cpu", activations="int8")}


def removed_impl(name: str) -> str:
    """What replaced the removed eval-only impl ``name`` (`REMOVED_IMPLS`), in words."""
    ex = REMOVED_IMPLS[name]
    entry = ", ".join(f"{k}: {v}" for k, v in exec_to_plain(ex).items())
    return f"impl {name!r} was removed; use the entry {{{entry}}} (named {ex.label!r} in results and tolerances)"


class ConfigError(ValueError):
    """A bad eval config: the message names the file and the key at fault."""


class YamlLoader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-4`` (no dot) as a float, as YAML 1.2 does."""


YamlLoader.add_implicit_resolver(
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
    return yaml.load(text_or_stream, Loader=YamlLoader)


# --------------------------------------------------------------------------- typed coercion


def type_name(tp) -> str:
    """How an error message names the type ``tp`` (``an int``, ``a list of a string``, ...)."""
    if tp is type(None):
        return "null"
    if tp is ExecConfig:
        return "an impl name or a mapping of ExecConfig fields"
    if isinstance(tp, type) and not dataclasses.is_dataclass(tp):
        return {"int": "an int", "float": "a number", "str": "a string", "bool": "a bool"}.get(tp.__name__, tp.__name__)
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(tp)))
    if typing.get_origin(tp) in (tuple, list):
        return f"a list of {type_name(typing.get_args(tp)[0])}"
    if typing.get_origin(tp) is dict:
        return f"a mapping to {type_name(typing.get_args(tp)[1])}"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return str(tp)


class Context:
    """Where a config came from: its ``source`` (the file) and the ``--set`` overrides
    applied to it (``{dotted key: original text}``), so `fail` can name both; the
    ``check_*`` methods are the value rules every kind's cross-key check is written with."""

    def __init__(self, source: str, overrides: dict[str, str] | None = None):
        self.source = source
        self.overrides = dict(overrides or {})

    def fail(self, key: str, msg: str) -> typing.NoReturn:
        """Raises the `ConfigError` ``<source>: key '<key>' (from --set ...): <msg>``."""
        where = f"key '{key}'" if key else "the top level"
        for ok, text in self.overrides.items():
            if key == ok or key.startswith(ok + ".") or key.startswith(ok + "[") or (key and ok.startswith(key + ".")):
                where += f" (from --set {text})"
                break
        raise ConfigError(f"{self.source}: {where}: {msg}")

    # ----------------------------------------------------------------------- value checks
    # Every kind's cross-key check is written with these, so one rule reads and fails alike
    # in every kind: ``<file>: key '<key>': <what is wrong>, got <value>``.

    def check_min(self, key: str, value, lo: int | float = 1) -> None:
        """``value >= lo``."""
        if not value >= lo:
            self.fail(key, f"must be >= {lo}, got {value!r}")

    def check_positive(self, key: str, value) -> None:
        """``value > 0`` (a tolerance, a scale, a time)."""
        if not value > 0:
            self.fail(key, f"must be > 0, got {value!r}")

    def check_fraction(self, key: str, value) -> None:
        """``0 <= value <= 1``."""
        if not 0 <= value <= 1:
            self.fail(key, f"must lie in [0, 1], got {value!r}")

    def check_list(self, key: str, values, lo: int | float | None = 1) -> None:
        """A non-empty list without duplicates, each entry ``>= lo`` (unless ``lo`` is None)."""
        if not values:
            self.fail(key, "is an empty list")
        if lo is not None:
            for i, v in enumerate(values):
                self.check_min(f"{key}[{i}]", v, lo)
        if len(set(values)) != len(values):
            self.fail(key, f"has duplicates: {list(values)}")

    def check_name(self, name: str) -> None:
        """A run name must be non-empty and free of path separators (it names a directory)."""
        if not name or any(c in name for c in "/\\"):
            self.fail("name", f"must be a non-empty name without slashes, got {name!r}")

    def check_preset(self, key: str, name: str) -> None:
        """``name`` is a shipped preset (`jaxmoe.config.list_presets`)."""
        known = list_presets()
        if name not in known:
            self.fail(key, f"unknown preset {name!r}; available: {known}")

    def check_shrink(self, key: str, shrink: ShrinkSection | None, base: MoEConfig | None = None) -> None:
        """A ``shrink`` section: widths >= 1 (``shared_expert_dim`` >= 0), and, given the preset's
        ``base`` config, widths `jaxmoe.evaluation.presets.shrink_config` can apply to it."""
        if shrink is None:
            return
        for k, v in shrink.widths().items():
            self.check_min(f"{key}.{k}", v, 0 if k == "shared_expert_dim" else 1)
        if base is not None:
            try:
                shrink_config(base, **shrink.widths())
            except ValueError as e:
                self.fail(key, f"{base.name or 'the model'}: {e}")

    def check_exec(self, key: str, ex: ExecConfig, available: list[str]) -> None:
        """The entry ``ex`` runs an available impl."""
        if ex.impl not in available:
            self.fail(key, f"impl {ex.impl!r} is not available here; available: {available}")

    def check_execs(self, key: str, execs, available: list[str]) -> None:
        """``execs`` (`ExecConfig` entries) is non-empty, each of an available impl, no two
        with the same label (`ExecConfig.label`, how reports and tolerances name them)."""
        if not execs:
            self.fail(key, "must be a non-empty list of impl names or mappings of ExecConfig fields")
        for i, ex in enumerate(execs):
            self.check_exec(f"{key}[{i}]", ex, available)
        labels = [ex.label for ex in execs]
        if len(set(labels)) != len(labels):
            self.fail(key, f"has duplicates: {labels}")

    def check_caps(self, key: str, caps: dict[str, int], execs, available: list[str]) -> None:
        """``impl_max_tokens``: each key an available impl or the label of an entry of ``execs``
        (a cap for an impl that ``--set impls=[...]`` left out is unused, not wrong), each cap >= 1."""
        names = {*available, *(ex.label for ex in execs)}
        for k, v in caps.items():
            if k not in names:
                self.fail(f"{key}.{k}", f"is not an available impl {available} nor an entry of impls {sorted(names)}")
            self.check_min(f"{key}.{k}", v)


def coerce(value: Any, tp: Any, key: str, ctx: Context) -> Any:
    """``value`` checked against the type annotation ``tp`` (lists become tuples, ints
    given for floats become floats, mappings for dataclasses become instances)."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            ctx.fail(key, f"must be {' or '.join(type_name(a) for a in args)}, got null")
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return coerce(value, a, key, ctx)
            except ConfigError as e:
                errors.append(e)
        if len(errors) == 1:
            raise errors[0]
        ctx.fail(
            key,
            f"must be {' or '.join(type_name(a) for a in args if a is not type(None))}, "
            f"got {type(value).__name__} {value!r}",
        )
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            ctx.fail(key, f"must be one of {list(choices)}, got {value!r}")
        return value
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            ctx.fail(key, f"must be {type_name(tp)}, got {type(value).__name__} {value!r}")
        el = typing.get_args(tp)[0]
        return tuple(coerce(v, el, f"{key}[{i}]", ctx) for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            ctx.fail(key, f"must be {type_name(tp)}, got {type(value).__name__} {value!r}")
        _, vt = typing.get_args(tp)
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                ctx.fail(key, f"keys must be strings, got {k!r}")
            out[k] = coerce(v, vt, f"{key}.{k}", ctx)
        return out
    if tp is ExecConfig:
        return coerce_exec(value, key, ctx)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, key, ctx)
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
    raise TypeError(f"eval config schema: unsupported type {tp!r} at {key}")  # a bug in a schema


def coerce_exec(value: Any, key: str, ctx: Context) -> ExecConfig:
    """An ``impls:`` entry: an impl name or a mapping of `jaxmoe.execution.ExecConfig` fields
    (`jaxmoe.execution.exec_from_dict`); a removed eval-only name (`REMOVED_IMPLS`) names
    its replacement."""
    name = value.get("impl") if isinstance(value, dict) else value
    if isinstance(name, str) and name in REMOVED_IMPLS:
        ctx.fail(key, removed_impl(name))
    try:
        return exec_from_dict(value, source=key)
    except ValueError as e:
        ctx.fail(key, str(e).removeprefix(f"{key}: "))


def exec_of_label(label: str) -> ExecConfig:
    """The `ExecConfig` an `ExecConfig.label` names (``cpu,activations=int8``): the impl, then
    ``field=value`` options (values read as YAML). ValueError naming a bad field or value."""
    impl, *fields = label.split(",")
    options = {}
    for f in fields:
        k, eq, v = f.partition("=")
        if not eq:
            raise ValueError(f"{label!r}: expected impl[,field=value...], got {f!r}")
        options[k] = yaml_load(v)
    return exec_from_dict({"impl": impl, **options}, source=repr(label))


def exec_to_plain(ex: ExecConfig) -> str | dict[str, Any]:
    """An `ExecConfig` as its YAML entry: the impl name alone, or the mapping of the impl and
    the fields that differ from their defaults (`coerce_exec` reads it back)."""
    d = {f.name: getattr(ex, f.name) for f in dataclasses.fields(ex) if getattr(ex, f.name) != f.default}
    d.pop("kernel_config", None)
    return ex.impl if not d.keys() - {"impl"} else {"impl": ex.impl, **d}


def build(cls, data: Any, key: str, ctx: Context):
    """An instance of the dataclass ``cls`` from the mapping ``data`` (every key checked:
    unknown keys, missing required keys and wrongly typed values are `ConfigError`)."""
    if not isinstance(data, dict):
        ctx.fail(key, f"must be a mapping, got {type(data).__name__} {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for k in data:
        if k not in fields:
            sub = f"{key}.{k}" if key else str(k)
            if k in REMOVED:
                ctx.fail(sub, f"was removed: how a layer runs is an `impls:` entry's field, {REMOVED[k]}")
            ctx.fail(sub, f"unknown key; known keys{' of ' + key if key else ''}: {sorted(fields)}")
    kw = {}
    for name, f in fields.items():
        sub = f"{key}.{name}" if key else name
        if name in data:
            kw[name] = coerce(data[name], hints[name], sub, ctx)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            ctx.fail(sub, "is required")
    return cls(**kw)


def to_plain(v: Any) -> Any:
    """A config (or any value in one) as plain YAML/JSON data: dataclasses as mappings,
    tuples as lists."""
    if isinstance(v, ExecConfig):
        return exec_to_plain(v)
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: to_plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, (list, tuple)):
        return [to_plain(a) for a in v]
    if isinstance(v, dict):
        return {k: to_plain(a) for k, a in v.items()}
    return v


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


# --------------------------------------------------------------------------- kinds and validation


def prepare(data: Any, source: str, overrides: list[str] | None = None) -> tuple[dict, Context, str]:
    """The raw config mapping with the overrides applied, its `Context`, and its kind.

    The kind is the ``kind`` key (`DEFAULT_KIND` when absent); it is not checked against
    the known kinds here.
    """
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping, got {type(data).__name__}")
    data, seen = apply_overrides(data, list(overrides or []))
    ctx = Context(source, seen)
    kind = data.get(KIND_KEY, DEFAULT_KIND)
    if not isinstance(kind, str):
        ctx.fail(KIND_KEY, f"must be a string (the kind of eval run), got {type(kind).__name__} {kind!r}")
    return data, ctx, kind


C = typing.TypeVar("C")


def validate(
    cls: type[C],
    data: Any,
    source: str = "<mapping>",
    overrides: list[str] | None = None,
    *,
    default_name: str = "eval",
    check: Callable[[C, Context], None] | None = None,
) -> C:
    """Validates a raw config mapping (``--set`` overrides applied) into the dataclass ``cls``.

    ``cls`` declares its kind as the default of its ``kind`` field; a mapping of another
    kind is a `ConfigError` on key ``kind``. An empty or absent ``name`` becomes
    ``default_name``. ``check(cfg, ctx)`` then runs the checks that need more than one
    key (it raises through ``ctx.fail``).
    """
    data, ctx, kind = prepare(data, source, overrides)
    want = {f.name: f.default for f in dataclasses.fields(cls)}.get(KIND_KEY, DEFAULT_KIND)
    if kind != want:
        ctx.fail(
            KIND_KEY,
            f"is {kind!r}, but {cls.__name__} reads only {want!r} configs "
            "(jaxmoe.evaluation.kinds.load_any reads every kind)",
        )
    cfg = build(cls, data, "", ctx)
    if not getattr(cfg, "name", "x"):
        cfg = dataclasses.replace(cfg, name=default_name)
    if check is not None:
        check(cfg, ctx)
    return cfg


# --------------------------------------------------------------------------- config files


def evals_dir() -> Path:
    """Directory of the shipped eval configs (``configs/evals``)."""
    return configs_root() / "evals"


def list_eval_configs() -> list[str]:
    """The names of the shipped eval configs (``default``, ``offload``, ...)."""
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


def read_config_file(path: str | os.PathLike) -> Any:
    """The parsed YAML of ``path`` (`ConfigError` if it cannot be read or parsed)."""
    try:
        with open(path) as f:
            return yaml_load(f)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read: {e}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """The keys every kind of eval config has (each kind's dataclass extends it)."""

    kind: str = DEFAULT_KIND  # each kind's dataclass narrows it to its own name
    name: str = ""  # the run's name (default: the file's stem); names its run directory
    description: str = ""
    output_dir: str = "runs"  # where run directories go

    def to_dict(self) -> dict[str, Any]:
        """The resolved config as plain YAML/JSON data."""
        return to_plain(self)

    def results_head(self) -> dict[str, Any]:
        """The first entries of a run's results: kind, name, description, the resolved config."""
        return {"kind": self.kind, "name": self.name, "description": self.description, "config": self.to_dict()}


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How an eval run is invoked (the same for every kind).

    Attributes:
      source: where the config came from (recorded in the results).
      out: the run directory; default ``<output_dir>/<name>-<UTC timestamp>``.
      overrides: the ``--set`` overrides applied (recorded in the results).
      progress: show a progress bar where the runner has one.
      console: where the summary goes (default: a new `rich.console.Console`).
    """

    source: str = "<config>"
    out: str | os.PathLike | None = None
    overrides: tuple[str, ...] = ()
    progress: bool = True
    console: Any = None


def mapping_reader(cls: type[C], check: Callable[[C, Context], None], default_name: str) -> Callable[..., C]:
    """``config_from_mapping(data, source="<mapping>", overrides=None, default_name=...)`` of one
    eval kind: `validate` with the kind's dataclass ``cls`` and its cross-key ``check``."""

    def config_from_mapping(
        data: Any, source: str = "<mapping>", overrides: list[str] | None = None, default_name: str = default_name
    ) -> C:
        return validate(cls, data, source, overrides, default_name=default_name, check=check)

    config_from_mapping.__doc__ = f"Validates a raw mapping (``--set`` overrides applied) into a `{cls.__name__}`."
    return config_from_mapping

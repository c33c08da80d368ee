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

from jaxmoe.config import configs_root

#: The top-level key naming a config's kind, and the kind of a config without one.
KIND_KEY = "kind"
DEFAULT_KIND = "default"

#: ``runner:`` values of older configs (the module that used to read the file) and the
#: kind each one means; ``runner: M`` is read as ``kind: LEGACY_RUNNERS[M]``.
LEGACY_RUNNERS = {
    "jaxmoe.parallel_eval": "expert-parallel",
    "jaxmoe.evaluation.expert_parallel": "expert-parallel",
    "jaxmoe.offload.sweep": "offload",
    "jaxmoe.evaluation.offload": "offload",
}


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
    applied to it (``{dotted key: original text}``), so `fail` can name both."""

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

    The kind is the ``kind`` key (`DEFAULT_KIND` when absent); an older config's
    ``runner: <module>`` key is read as the kind that module ran (`LEGACY_RUNNERS`) and
    removed. The kind is not checked against the known kinds here.
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
    if "runner" in data:
        runner = data.pop("runner")
        legacy = LEGACY_RUNNERS.get(runner) if isinstance(runner, str) else None
        if legacy is None:
            ctx.fail(
                "runner",
                f"must name a module that runs eval configs ({', '.join(LEGACY_RUNNERS)}), got {runner!r}; "
                f"new configs say `{KIND_KEY}: <kind>` instead",
            )
        if KIND_KEY in data and kind != legacy:
            ctx.fail("runner", f"{runner!r} runs {legacy!r} configs, but key '{KIND_KEY}' says {kind!r}")
        kind = data[KIND_KEY] = legacy
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


def check_name(ctx: Context, name: str) -> None:
    """A run name must be non-empty and free of path separators (it names a directory)."""
    if not name or any(c in name for c in "/\\"):
        ctx.fail("name", f"must be a non-empty name without slashes, got {name!r}")


def check_impls(ctx: Context, names, available: list[str], key: str = "impls") -> None:
    """``names`` is a non-empty list of distinct impls, each one of ``available``."""
    if not names:
        ctx.fail(key, "must be a non-empty list of impl names")
    for i, name in enumerate(names):
        if name not in available:
            ctx.fail(f"{key}[{i}]", f"impl {name!r} is not available here; available: {available}")
    if len(set(names)) != len(names):
        ctx.fail(key, f"has duplicates: {list(names)}")


def mapping_reader(cls: type[C], check: Callable[[C, Context], None], default_name: str) -> Callable[..., C]:
    """``config_from_mapping(data, source="<mapping>", overrides=None, default_name=...)`` of one
    eval kind: `validate` with the kind's dataclass ``cls`` and its cross-key ``check``."""

    def config_from_mapping(
        data: Any, source: str = "<mapping>", overrides: list[str] | None = None, default_name: str = default_name
    ) -> C:
        return validate(cls, data, source, overrides, default_name=default_name, check=check)

    config_from_mapping.__doc__ = f"Validates a raw mapping (``--set`` overrides applied) into a `{cls.__name__}`."
    return config_from_mapping

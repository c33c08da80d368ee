"""Config-driven evaluation runs: ``jaxmoe eval [CONFIG] [--set key=value ...] [--out DIR]``.

A run reads ``configs/evals/<CONFIG>.yaml`` (default: ``default``), measures every
implementation against the reference for every layer and token count, and writes
``runs/<name>-<UTC timestamp>/`` (or ``--out DIR``): ``results.json`` (every number with
its unit, plus the resolved config), ``report.md``, ``config.yaml`` (the resolved
config) and PNG plots. Exit codes: 0 every case within tolerance, 1 some case over its
tolerance or failing (the regression gate), 2 a bad config or command line.

A config whose top level names ``runner: <jaxmoe module>`` (``offload.yaml``) belongs to
another subsystem: ``jaxmoe eval`` hands it to that module's ``cli_main`` / ``main``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jaxmoe.evaluation.config import (
    ConfigError,
    EvalConfig,
    config_from_mapping,
    find_config,
    list_eval_configs,
    load_eval_config,
)

__all__ = [
    "cli_main",
    "run",
    "EvalConfig",
    "ConfigError",
    "load_eval_config",
    "config_from_mapping",
    "list_eval_configs",
    "find_config",
]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="jaxmoe eval",
        description="Run a config-driven MoE evaluation (configs/evals/*.yaml).",
        epilog="exit codes: 0 all cases within tolerance, 1 a case over tolerance or failing, 2 config error",
    )
    ap.add_argument(
        "config",
        nargs="?",
        default="default",
        help="a YAML file or the name of a shipped config (default: %(default)s)",
    )
    ap.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key (dotted, YAML value), e.g. --set tokens=[1,8] --set model.seed=3",
    )
    ap.add_argument(
        "--out", default=None, help="write the run into this directory instead of <output_dir>/<name>-<timestamp>"
    )
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--list", action="store_true", help="list the shipped configs and exit")
    return ap


class _Bar:
    def __init__(self, prog, task):
        self.prog, self.task = prog, task

    def advance(self, msg: str = "") -> None:
        self.prog.update(self.task, advance=1, description=msg)


def run(
    ecfg: EvalConfig, *, source: str = "<config>", out=None, overrides=None, progress: bool = True, console=None
) -> tuple[dict, Path]:
    """Runs ``ecfg`` and writes the run directory. Returns (results mapping, run directory)."""
    import yaml
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from jaxmoe.evaluation import plots as P
    from jaxmoe.evaluation import report as R
    from jaxmoe.evaluation.runner import count_steps, make_run_dir, run_eval
    from jaxmoe.evaluation.sources import layer_specs

    console = console or Console()
    specs = layer_specs(ecfg, source)
    run_dir = make_run_dir(ecfg, out)
    if progress:
        with Progress(
            TextColumn("[bold]{task.description:<48}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=False,
        ) as prog:
            task = prog.add_task(f"{ecfg.name}: starting", total=count_steps(ecfg, specs))
            res = run_eval(ecfg, source=source, specs=specs, progress=_Bar(prog, task), overrides=overrides)
    else:
        res = run_eval(ecfg, source=source, specs=specs, overrides=overrides)
    res["run_dir"] = str(run_dir)
    names = P.write_plots(res, run_dir) if ecfg.plots else []
    res["plots"] = names
    with open(run_dir / "results.json", "w") as f:
        json.dump(res, f, indent=1, allow_nan=False)
    with open(run_dir / "config.yaml", "w") as f:
        yaml.safe_dump(ecfg.to_dict(), f, sort_keys=False)
    (run_dir / "report.md").write_text(R.render_markdown(res, names))
    console.print(R.summary_table(res))
    for fail in res["gate"]["failures"]:
        console.print(f"[red]FAIL[/] {fail}")
    console.print(f"results: {run_dir}/ (results.json, report.md{''.join(', ' + n for n in names)})")
    return res, run_dir


def _delegated_runner(path: Path) -> str | None:
    """The ``runner:`` module named at the top of a config that another subsystem reads
    (e.g. ``jaxmoe.offload.sweep`` for ``offload.yaml``), else None."""
    from jaxmoe.evaluation.config import yaml_load

    try:
        with open(path) as f:
            data = yaml_load(f)
    except Exception:  # a broken file is reported by load_eval_config
        return None
    if not isinstance(data, dict) or "runner" not in data:
        return None
    mod = data["runner"]
    if not isinstance(mod, str) or not mod.startswith("jaxmoe."):
        raise ConfigError(f"{path}: key 'runner': must name a jaxmoe module (e.g. jaxmoe.offload.sweep), got {mod!r}")
    return mod


def _run_delegated(module: str, path: Path, out) -> int:
    import importlib

    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        raise ConfigError(f"{path}: key 'runner': module {module!r} is not installed ({e})") from None
    fn = getattr(mod, "cli_main", None) or getattr(mod, "main", None)
    if fn is None:
        raise ConfigError(f"{path}: key 'runner': {module} has no cli_main(argv) or main(argv)")
    return int(fn([str(path), *(["--out", str(out)] if out else [])]) or 0)


def cli_main(argv: list[str] | None = None) -> int:
    """``jaxmoe eval`` entry point; returns the exit code (0 pass, 1 gate failed, 2 config error)."""
    ap = _parser()
    try:
        a = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:  # argparse: --help (0) or a usage error (2)
        return int(e.code or 0)
    if a.list:
        for name in list_eval_configs():
            print(name)
        return 0
    try:
        path = find_config(a.config)
        delegate = _delegated_runner(path)
        if delegate is not None:
            if a.overrides:
                raise ConfigError(f"{path}: --set is not supported for configs run by {delegate} (key 'runner')")
            return _run_delegated(delegate, path, a.out)
        ecfg = load_eval_config(path, a.overrides)
        res, _ = run(ecfg, source=str(path), out=a.out, overrides=a.overrides, progress=not a.no_progress)
    except ConfigError as e:
        print(f"jaxmoe eval: config error: {e}", file=sys.stderr)
        return 2
    return 0 if res["gate"]["passed"] else 1

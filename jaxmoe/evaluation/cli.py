"""``jaxmoe eval [CONFIG] [--set key=value ...] [--out DIR] [--no-progress] [--keep-freed-memory] [--list]``.

``CONFIG`` is a YAML file or the name of a shipped config (``configs/evals/<CONFIG>.yaml``;
default: ``default``). Its ``kind`` key picks the runner (`jaxmoe.evaluation.kinds`);
``--set`` overrides any key of any kind (dotted key, YAML value). The run writes
``<output_dir>/<name>-<UTC timestamp>/`` (or ``--out DIR``).

Exit codes: 0 the run's gate passed (every case within tolerance; for ``offload``, every
streamed run bit-identical to the resident one), 1 the gate failed (the regression
gate), 2 a bad config or command line (nothing is run).
"""

from __future__ import annotations

import argparse
import sys

from jaxmoe.evaluation.kinds import KINDS, kind_of, load_any
from jaxmoe.evaluation.schema import ConfigError, RunOptions, find_config, list_eval_configs
from jaxmoe.host_memory import keep_freed_host_memory

#: Exit codes of `cli_main`.
EXIT_PASSED, EXIT_GATE_FAILED, EXIT_CONFIG_ERROR = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    """The ``jaxmoe eval`` argument parser."""
    ap = argparse.ArgumentParser(
        prog="jaxmoe eval",
        description="Run a config-driven MoE evaluation (configs/evals/*.yaml).",
        epilog=f"kinds (the config's `kind` key): {', '.join(KINDS)}. "
        "exit codes: 0 all cases within tolerance, 1 a case over tolerance or failing, 2 config error",
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
    ap.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="jaxmoe.keep_freed_host_memory() before anything runs: glibc keeps freed memory for reuse, so "
        "XLA:CPU's fresh per-call buffers (a training step's weight gradients) skip first-touch page "
        "zeroing (README, Training); recorded in the results",
    )
    ap.add_argument("--list", action="store_true", help="list the shipped configs and exit")
    return ap


def cli_main(argv: list[str] | None = None) -> int:
    """``jaxmoe eval`` entry point; returns the exit code (0 pass, 1 gate failed, 2 config error)."""
    ap = build_parser()
    try:
        a = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:  # argparse: --help (0) or a usage error (2)
        return int(e.code or 0)
    if a.list:
        for name in list_eval_configs():
            print(name)
        return EXIT_PASSED
    if a.keep_freed_memory:
        try:
            if not keep_freed_host_memory():
                print("jaxmoe eval: --keep-freed-memory: not glibc, nothing changed", file=sys.stderr)
        except RuntimeError as e:
            print(f"jaxmoe eval: --keep-freed-memory: {e}", file=sys.stderr)
            return EXIT_CONFIG_ERROR
    try:
        path = find_config(a.config)
        cfg = load_any(path, a.overrides)
        res, _ = kind_of(cfg).run(
            cfg, RunOptions(source=str(path), out=a.out, overrides=tuple(a.overrides or ()), progress=not a.no_progress)
        )
    except ConfigError as e:
        print(f"jaxmoe eval: config error: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    return EXIT_PASSED if res["gate"]["passed"] else EXIT_GATE_FAILED

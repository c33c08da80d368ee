"""The ``jaxmoe`` command line: ``eval``, ``inspect`` and ``demo``.

Each subcommand's module parses its own arguments, so ``jaxmoe SUB --help`` is
answered there: `jaxmoe.evaluation.cli`, `jaxmoe.io.inspect`, `jaxmoe.demo`.
"""

from __future__ import annotations

import sys

from jaxmoe.demo import cli_main as demo_main
from jaxmoe.evaluation.cli import cli_main as eval_main
from jaxmoe.io.inspect import cli_main as inspect_main

USAGE = """usage: jaxmoe <command> [args]

commands:
  eval [CONFIG] [--set key=value ...]   run an evaluation (default: configs/evals/default.yaml)
  inspect FILE_OR_DIR                   print the MoE layout of a GGUF file or HF/MLX checkpoint
  demo [--preset NAME] [--tokens N ...] route random activations through a preset layer
"""

COMMANDS = {"eval": eval_main, "inspect": inspect_main, "demo": demo_main}


def main(argv: list[str] | None = None) -> int:
    """The ``jaxmoe`` entry point: dispatches to the subcommand; returns its exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"jaxmoe: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return int(COMMANDS[cmd](rest) or 0)


if __name__ == "__main__":
    sys.exit(main())

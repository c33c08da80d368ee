"""``python -m jaxmoe.evaluation [CONFIG] [--set key=value ...] [--out DIR]``: the same as ``jaxmoe eval``."""

import sys

from jaxmoe.evaluation.cli import cli_main

sys.exit(cli_main())

"""Config-driven evaluation runs: ``jaxmoe eval [CONFIG] [--set key=value ...] [--out DIR]``.

A run reads ``configs/evals/<CONFIG>.yaml`` (default: ``default``) or any YAML file. The
file's ``kind`` key says what it measures (`jaxmoe.evaluation.kinds`):

- ``default`` (no ``kind`` key): every implementation against the reference for every
  layer and token count (`config` schema, `runner`); writes ``results.json`` (every
  number with its unit, plus the resolved config), ``report.md``, ``config.yaml`` (the
  resolved config) and PNG plots;
- ``expert-parallel``: meshes against the single-device layer (`expert_parallel`);
- ``offload``: experts streamed from storage, cache budgets x predictors (`offload`).

Each run goes to ``runs/<name>-<UTC timestamp>/`` (or ``--out DIR``). Exit codes
(`cli`): 0 every case within tolerance, 1 some case over its tolerance or failing (the
regression gate), 2 a bad config or command line.

Modules, lowest first: `presets` (the one rule for shrinking a preset), `schema` (the
engine every kind's YAML goes through: types, unknown keys, ``--set`` overrides, the value
checks, ``impls:`` entries as `jaxmoe.execution.ExecConfig`, errors naming file and key;
finding config files), `config` (the ``default`` kind's schema), `metrics`, `reference` (the float64 numpy
forward), `sources` (weights and activations), `report`, `plots`, the runners `runner`,
`expert_parallel`, `offload` and `train`, `kinds` (kind name -> schema and runner) and `cli`.
"""

from jaxmoe.evaluation.cli import cli_main
from jaxmoe.evaluation.config import EvalConfig, config_from_mapping, load_eval_config
from jaxmoe.evaluation.expert_parallel import ExpertParallelConfig
from jaxmoe.evaluation.kinds import KINDS, EvalKind, load_any
from jaxmoe.evaluation.offload import OffloadSweepConfig
from jaxmoe.evaluation.runner import run
from jaxmoe.evaluation.schema import ConfigError, find_config, list_eval_configs

__all__ = [
    "KINDS",
    "ConfigError",
    "EvalConfig",
    "EvalKind",
    "ExpertParallelConfig",
    "OffloadSweepConfig",
    "cli_main",
    "config_from_mapping",
    "find_config",
    "list_eval_configs",
    "load_any",
    "load_eval_config",
    "run",
]

"""The kinds of eval run: which schema reads a config and which runner runs it.

A config's top-level ``kind`` key picks its row of `KINDS` (``default`` when absent):

- ``default``: every impl against a reference, layer by layer
  (`jaxmoe.evaluation.config.EvalConfig`, run by `jaxmoe.evaluation.runner`);
- ``expert-parallel``: meshes against the single-device layer
  (`jaxmoe.evaluation.expert_parallel`);
- ``offload``: cache budgets x predictors with experts streamed from storage
  (`jaxmoe.evaluation.offload`);
- ``train``: forward + backward step time and gradient error per impl against a float64
  reference and the Hugging Face block's torch backward (`jaxmoe.evaluation.train`).

Every kind goes through the same schema engine (`jaxmoe.evaluation.schema`), so unknown
keys, wrong types and ``--set`` overrides behave alike, and every runner has the same
signature ``run(cfg, opts: RunOptions | None) -> (results, run_dir)``
with ``results["gate"]["passed"]`` the run's verdict.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jaxmoe.evaluation.config as default_kind
import jaxmoe.evaluation.expert_parallel as expert_parallel
import jaxmoe.evaluation.offload as offload
import jaxmoe.evaluation.runner as runner
import jaxmoe.evaluation.train as train
from jaxmoe.evaluation.schema import find_config, prepare, read_config_file

#: Any kind's config dataclass.
AnyEvalConfig = (
    default_kind.EvalConfig | expert_parallel.ExpertParallelConfig | offload.OffloadSweepConfig | train.TrainEvalConfig
)


@dataclasses.dataclass(frozen=True)
class EvalKind:
    """One kind of eval run.

    Attributes:
      name: the value of the config's ``kind`` key.
      config_class: the dataclass its configs validate into.
      from_mapping: ``(data, source, overrides, default_name) -> config``.
      run: ``(config, opts: schema.RunOptions | None) -> (results, run directory)``.
      description: one line for listings.
    """

    name: str
    config_class: type
    from_mapping: Callable[..., Any]
    run: Callable[..., tuple[dict, Path]]
    description: str


KINDS: dict[str, EvalKind] = {
    k.name: k
    for k in (
        EvalKind(
            "default",
            default_kind.EvalConfig,
            default_kind.config_from_mapping,
            runner.run,
            "every impl vs a reference, per layer, token count, dtype and quantization",
        ),
        EvalKind(
            expert_parallel.KIND,
            expert_parallel.ExpertParallelConfig,
            expert_parallel.config_from_mapping,
            expert_parallel.run,
            "expert-parallel meshes vs the single-device layer",
        ),
        EvalKind(
            offload.KIND,
            offload.OffloadSweepConfig,
            offload.config_from_mapping,
            offload.run,
            "experts streamed from storage: cache budgets x policies x predictors",
        ),
        EvalKind(
            train.KIND,
            train.TrainEvalConfig,
            train.config_from_mapping,
            train.run,
            "training step per impl: fwd+bwd time vs the HF torch block, gradient error vs float64",
        ),
    )
}


def kind_of(cfg: AnyEvalConfig) -> EvalKind:
    """The `EvalKind` of a validated config."""
    return KINDS[cfg.kind]


def from_mapping(
    data: Any, source: str = "<mapping>", overrides: list[str] | None = None, default_name: str = "eval"
) -> AnyEvalConfig:
    """Validates a raw mapping of any kind (its ``kind`` key, ``default`` when absent)."""
    _, ctx, kind = prepare(data, source, overrides)
    if kind not in KINDS:
        ctx.fail("kind", f"unknown kind {kind!r}; known kinds: {sorted(KINDS)}")
    return KINDS[kind].from_mapping(data, source, overrides, default_name)


def load_any(name_or_path: str | os.PathLike, overrides: list[str] | None = None) -> AnyEvalConfig:
    """Reads, overrides and validates an eval config of any kind: a YAML path or the name
    of a shipped config (``default``, ``expert-parallel``, ``offload``, ...). Every problem
    is a `jaxmoe.evaluation.schema.ConfigError` naming the file and key."""
    path = find_config(name_or_path)
    return from_mapping(read_config_file(path), str(path), overrides, default_name=path.stem)

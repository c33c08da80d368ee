"""Presets at smaller widths: the one rule every eval kind, test and benchmark shrinks by.

`shrink_config` takes a preset's `MoEConfig` (any `MoEConfig`) and the widths to replace;
`ShrinkSection` is the same widths as the ``model.shrink`` section of an eval config
(every kind reads it the same way), `PresetSection` the ``model`` section of a kind that
runs one shrunk preset.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxmoe.config import MoEConfig, load_config


@dataclasses.dataclass(frozen=True)
class ShrinkSection:
    """Smaller widths for a preset (`shrink_config`); None keeps the preset's."""

    d_model: int | None = None  # residual width
    expert_dim: int | None = None  # routed expert width (the shared expert keeps its ratio)
    shared_expert_dim: int | None = None  # 0: no shared expert
    num_experts: int | None = None  # at most the preset's
    top_k: int | None = None  # at most the preset's and num_experts

    def widths(self) -> dict[str, int]:
        """The widths that are set, as keyword arguments of `shrink_config`."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}


#: The keys of `ShrinkSection` (and the width keywords of `shrink_config`).
SHRINK_KEYS = tuple(f.name for f in dataclasses.fields(ShrinkSection))


def shrink_config(cfg: MoEConfig, *, num_layers: int | None = None, **widths: int | None) -> MoEConfig:
    """``cfg`` at smaller ``widths`` (keywords `SHRINK_KEYS`; None keeps a width).

    - ``num_experts`` and ``top_k`` never grow: each is at most the preset's (and ``top_k``
      at most the expert count);
    - a group limit (``n_group > 1``) is kept; an expert count that cannot keep it (not a
      multiple of ``n_group``, groups too small for the group score, or ``top_k`` beyond
      ``topk_group`` groups) is a ValueError;
    - the shared expert keeps its width ratio to a routed expert unless
      ``shared_expert_dim`` is given (0 drops it; a preset without one stays without);
    - the dense layers' width is unknown at the new size: ``dense_dim`` becomes 0;
    - ``num_layers``: a stack of that many MoE layers (``dense_layers`` dropped).

    Any other invalid width is the ValueError of `MoEConfig` naming the field; an unknown
    keyword is a TypeError.
    """
    unknown = sorted(set(widths) - set(SHRINK_KEYS))
    if unknown:
        raise TypeError(f"shrink_config: unknown width(s) {unknown}; known: {list(SHRINK_KEYS)}")
    d_model, expert_dim, shared_expert_dim, num_experts, top_k = (widths.get(k) for k in SHRINK_KEYS)
    rc = cfg.router
    e = min(rc.num_experts, num_experts or rc.num_experts)
    k = min(rc.top_k, top_k or rc.top_k, e)
    if rc.n_group > 1:
        per = e // rc.n_group if e % rc.n_group == 0 else 0
        if per < (2 if rc.group_score == "top2_sum" else 1) or k > rc.topk_group * per:
            raise ValueError(
                f"num_experts={e} cannot keep the group limit of {cfg.name or 'this config'} "
                f"(n_group={rc.n_group}, topk_group={rc.topk_group}, top_k={k})"
            )
    f = expert_dim or cfg.expert_dim
    fs = cfg.shared_expert_dim
    if fs and shared_expert_dim is not None:
        fs = shared_expert_dim
    elif fs:
        fs = max(1, round(fs * f / cfg.expert_dim))
    shared: dict[str, Any] = {"shared_expert_dim": fs}
    if fs == 0:
        shared.update(num_shared_experts=0, shared_expert_gate=False)
    layers: dict[str, Any] = {} if num_layers is None else {"num_layers": num_layers, "dense_layers": ()}
    return dataclasses.replace(
        cfg,
        d_model=d_model or cfg.d_model,
        expert_dim=f,
        router=dataclasses.replace(rc, num_experts=e, top_k=k),
        dense_dim=0,
        **shared,
        **layers,
    )


@dataclasses.dataclass(frozen=True)
class PresetSection:
    """A ``model`` section of one preset with seeded random weights: the preset, its widths
    (``shrink``) and the weights' seed."""

    preset: str
    shrink: ShrinkSection | None = None
    seed: int = 0

    def config(self, num_layers: int | None = None) -> MoEConfig:
        """The preset's `MoEConfig` shrunk by ``shrink`` (`shrink_config`)."""
        return shrink_config(
            load_config(self.preset), num_layers=num_layers, **(self.shrink or ShrinkSection()).widths()
        )


__all__ = ["SHRINK_KEYS", "PresetSection", "ShrinkSection", "shrink_config"]

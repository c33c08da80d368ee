"""Frozen, validated configuration of one MoE layer and its router.

`RouterConfig` holds every option of the routing rule (docs/routing.md, "RouterConfig fields");
`MoEConfig` holds the layer's widths, the expert flavour and the shared expert.
Both validate in `__post_init__`, so `dataclasses.replace` re-validates too; every
violation is a `ValueError` that names the field.

Presets live in `configs/models/*.yaml`; `load_config(name_or_path)` reads one (a
preset name or a YAML path). `jaxmoe.load_config` (`jaxmoe.io.load_config`) also takes
a GGUF file or a checkpoint directory.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

import yaml

from jaxmoe.execution import REMOVED

SCORE_FNS = ("softmax", "sigmoid", "softmax_topk", "sigmoid_topk")
GROUP_SCORES = ("max", "top2_sum")
RENORMS = ("none", "sum", "clamp", "add")
ACTIVATIONS = ("swiglu", "swiglu_oai")

#: llama.cpp's renormalization floor: the smallest normal float16, 2^-14.
F16_MIN_NORMAL = 2.0**-14


#: The default of the removed `MoEConfig` fields (any value passed is an error).
_REMOVED: Any = type("_Removed", (), {"__repr__": lambda self: "<removed>"})()


def _fail(cls: str, field: str, msg: str) -> None:
    raise ValueError(f"{cls}.{field}: {msg}")


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """The routing rule of one MoE layer.

    Attributes:
      num_experts: E, routed experts.
      top_k: k, experts selected per token.
      score_fn: ``softmax`` over all E logits; ``sigmoid`` elementwise;
        ``softmax_topk`` softmax over the k selected logits (gpt-oss, granite);
        ``sigmoid_topk`` sigmoid of the k selected logits (Llama 4).
      n_group, topk_group: group-limited selection (DeepSeek); ``n_group == 1`` is
        plain top-k.
      group_score: how a group is scored: ``max`` (DeepSeek-V2) or ``top2_sum``
        (DeepSeek-V3 family), over the selection scores.
      use_selection_bias: the layer has a selection bias (``e_score_correction_bias``)
        added to the scores for selection only.
      router_bias: the router linear layer has a bias (gpt-oss).
      renorm: ``none``; ``sum`` w / sum; ``clamp`` w / max(sum, renorm_eps);
        ``add`` w / (sum + renorm_eps).
      renorm_eps: the floor of ``clamp`` / ``add``.
      routed_scaling_factor: multiplies the weights after renormalization.
    """

    num_experts: int
    top_k: int
    score_fn: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "top2_sum"
    use_selection_bias: bool = False
    router_bias: bool = False
    renorm: str = "sum"
    renorm_eps: float = 0.0
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        c = "RouterConfig"
        for f in ("num_experts", "top_k", "n_group", "topk_group"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                _fail(c, f, f"must be a positive int, got {v!r}")
        if self.top_k > self.num_experts:
            _fail(c, "top_k", f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if self.score_fn not in SCORE_FNS:
            _fail(c, "score_fn", f"unknown {self.score_fn!r}; expected one of {SCORE_FNS}")
        if self.group_score not in GROUP_SCORES:
            _fail(c, "group_score", f"unknown {self.group_score!r}; expected one of {GROUP_SCORES}")
        if self.renorm not in RENORMS:
            _fail(c, "renorm", f"unknown {self.renorm!r}; expected one of {RENORMS}")
        if self.num_experts % self.n_group:
            _fail(c, "n_group", f"num_experts={self.num_experts} is not divisible by n_group={self.n_group}")
        if self.topk_group > self.n_group:
            _fail(c, "topk_group", f"topk_group={self.topk_group} exceeds n_group={self.n_group}")
        if self.n_group > 1:
            per = self.num_experts // self.n_group
            if self.group_score == "top2_sum" and per < 2:
                _fail(c, "n_group", f"group_score='top2_sum' needs >= 2 experts per group, got {per}")
            if self.top_k > self.topk_group * per:
                _fail(c, "top_k", f"top_k={self.top_k} exceeds the {self.topk_group * per} experts of the kept groups")
            if self.score_fn in ("softmax_topk", "sigmoid_topk"):
                _fail(c, "n_group", f"group-limited selection is not defined for score_fn={self.score_fn!r}")
        if self.renorm in ("clamp", "add") and not self.renorm_eps > 0:
            _fail(c, "renorm_eps", f"renorm={self.renorm!r} needs renorm_eps > 0, got {self.renorm_eps}")
        if not (
            isinstance(self.routed_scaling_factor, (int, float))
            and math.isfinite(self.routed_scaling_factor)
            and self.routed_scaling_factor > 0
        ):
            _fail(c, "routed_scaling_factor", f"must be a finite positive number, got {self.routed_scaling_factor!r}")

    @property
    def experts_per_group(self) -> int:
        return self.num_experts // self.n_group


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """One MoE layer: widths, expert flavour, shared expert, and its router.

    Attributes:
      d_model: d, the hidden width.
      expert_dim: F, each routed expert's intermediate width.
      router: the `RouterConfig`.
      shared_expert_dim: total intermediate width of the shared expert(s), 0 if none.
        Several shared experts of width f are one SwiGLU of width n * f (as HF stores
        DeepSeek's), so this is ``num_shared_experts * f``.
      num_shared_experts: how many shared experts that width holds (0 when none).
      shared_expert_gate: the shared output is scaled by ``sigmoid(x . w_sg)`` (Qwen).
      activation: ``swiglu`` ``down(silu(gate) * up)``; ``swiglu_oai`` the gpt-oss
        clamped variant ``(clip(up, -L, L) + 1) * g * sigmoid(alpha * g)``, g = min(gate, L).
      expert_bias: routed experts have biases (gpt-oss).
      swiglu_alpha, swiglu_limit: the ``swiglu_oai`` constants.
      weight_on_input: the routing weight multiplies the expert input (Llama 4).
      num_layers: layers of the model this layer comes from.
      dense_layers: indices of layers that are dense, not MoE (e.g. DeepSeek's first 3).
      dense_dim: intermediate width of those dense layers (0 when unknown / none).
      name, family: preset name and model family (informational).

    How to run the layer (strategy, batch invariance, activation arithmetic) is not part
    of the model: `jaxmoe.execution.ExecConfig`. The removed fields ``batch_invariant``
    and ``int8_activations`` are a ValueError naming it.
    """

    d_model: int
    expert_dim: int
    router: RouterConfig
    shared_expert_dim: int = 0
    num_shared_experts: int = 0
    shared_expert_gate: bool = False
    activation: str = "swiglu"
    expert_bias: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    weight_on_input: bool = False
    num_layers: int = 1
    dense_layers: tuple[int, ...] = ()
    dense_dim: int = 0
    name: str = ""
    family: str = ""
    batch_invariant: dataclasses.InitVar[object] = _REMOVED
    int8_activations: dataclasses.InitVar[object] = _REMOVED

    def __post_init__(self, batch_invariant: object = _REMOVED, int8_activations: object = _REMOVED) -> None:
        c = "MoEConfig"
        for name, v in (("batch_invariant", batch_invariant), ("int8_activations", int8_activations)):
            if v is not _REMOVED:
                _fail(c, name, f"was removed: how to run is not part of the model; use {REMOVED[name]}")
        if not isinstance(self.router, RouterConfig):
            _fail(c, "router", f"must be a RouterConfig, got {type(self.router).__name__}")
        for f in ("d_model", "expert_dim", "num_layers"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                _fail(c, f, f"must be a positive int, got {v!r}")
        for f in ("shared_expert_dim", "num_shared_experts", "dense_dim"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                _fail(c, f, f"must be a non-negative int, got {v!r}")
        if (self.shared_expert_dim == 0) != (self.num_shared_experts == 0):
            _fail(
                c,
                "num_shared_experts",
                f"shared_expert_dim={self.shared_expert_dim} and num_shared_experts={self.num_shared_experts} "
                "must both be 0 or both positive",
            )
        if self.shared_expert_gate and self.shared_expert_dim == 0:
            _fail(c, "shared_expert_gate", "a shared-expert gate needs a shared expert (shared_expert_dim > 0)")
        if self.activation not in ACTIVATIONS:
            _fail(c, "activation", f"unknown {self.activation!r}; expected one of {ACTIVATIONS}")
        if not self.swiglu_limit > 0:
            _fail(c, "swiglu_limit", f"must be positive, got {self.swiglu_limit}")
        dl = tuple(self.dense_layers)
        object.__setattr__(self, "dense_layers", dl)
        for i in dl:
            if not isinstance(i, int) or not 0 <= i < self.num_layers:
                _fail(c, "dense_layers", f"layer index {i!r} is outside [0, {self.num_layers})")

    @property
    def num_experts(self) -> int:
        return self.router.num_experts

    @property
    def top_k(self) -> int:
        return self.router.top_k

    def is_moe_layer(self, layer: int) -> bool:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} is outside [0, {self.num_layers}) for {self.name or 'this config'}")
        return layer not in self.dense_layers

    def expert_param_count(self) -> int:
        """Parameters of the routed experts (gate, up, down of all E)."""
        return 3 * self.num_experts * self.d_model * self.expert_dim

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["dense_layers"] = list(self.dense_layers)
        return d


_ROUTER_FIELDS = {f.name for f in dataclasses.fields(RouterConfig)}
_MOE_FIELDS = {f.name for f in dataclasses.fields(MoEConfig)}


def config_from_dict(d: dict[str, Any], *, source: str = "<dict>") -> MoEConfig:
    """Builds an `MoEConfig` from a plain dict (the YAML schema); unknown keys are errors."""
    if not isinstance(d, dict):
        raise ValueError(f"{source}: expected a mapping, got {type(d).__name__}")
    d = dict(d)
    r = d.pop("router", None)
    if not isinstance(r, dict):
        raise ValueError(f"{source}: key 'router' must be a mapping with num_experts and top_k")
    bad = set(r) - _ROUTER_FIELDS
    if bad:
        raise ValueError(f"{source}: unknown router key(s) {sorted(bad)}; known: {sorted(_ROUTER_FIELDS)}")
    gone = sorted(set(d) & set(REMOVED))
    if gone:
        raise ValueError(f"{source}: key {gone[0]!r} was removed from the model config; use {REMOVED[gone[0]]}")
    bad = set(d) - _MOE_FIELDS
    if bad:
        raise ValueError(f"{source}: unknown key(s) {sorted(bad)}; known: {sorted(_MOE_FIELDS - {'router'})}")
    if "dense_layers" in d:
        d["dense_layers"] = tuple(d["dense_layers"] or ())
    try:
        return MoEConfig(router=RouterConfig(**r), **d)
    except TypeError as e:  # missing required field
        raise ValueError(f"{source}: {e}") from None
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def configs_root() -> Path:
    """Directory of the shipped configs: ``models/`` (presets) and ``evals/`` (eval runs).

    ``$JAXMOE_CONFIGS`` overrides it. The package holds them as ``jaxmoe/configs``, a link
    to the checkout's top-level ``configs/`` that a wheel stores as plain files.
    """
    env = os.environ.get("JAXMOE_CONFIGS")
    if env:
        return Path(env)
    return Path(__file__).resolve().parent / "configs"


def presets_dir() -> Path:
    """Directory of the shipped model presets (``configs/models``)."""
    return configs_root() / "models"


def list_presets() -> list[str]:
    return sorted(p.stem for p in presets_dir().glob("*.yaml"))


def load_config(name_or_path: str | os.PathLike) -> MoEConfig:
    """A preset name (``qwen3.6-35b-a3b``) or a model YAML path.

    Checkpoints (a GGUF file, an HF / MLX directory) are read by `jaxmoe.io.load_config`,
    which `jaxmoe.load_config` is: this module knows no file format.
    """
    p = Path(name_or_path)
    s = str(name_or_path)
    if p.suffix == ".gguf" or (p.is_dir() and (p / "config.json").exists()):
        raise ValueError(
            f"{p} is a checkpoint, not a model YAML or preset: read its config with "
            "jaxmoe.load_config (jaxmoe.io.load_config)"
        )
    if p.suffix in (".yaml", ".yml") or p.is_file():
        if not p.is_file():
            raise FileNotFoundError(f"config file not found: {p}")
        with open(p) as f:
            data = yaml.safe_load(f)
        data = dict(data or {})
        data.setdefault("name", p.stem)
        return config_from_dict(data, source=str(p))
    cand = presets_dir() / f"{s}.yaml"
    if not cand.is_file():
        raise ValueError(f"unknown preset {s!r}; available: {', '.join(list_presets())}")
    return load_config(cand)

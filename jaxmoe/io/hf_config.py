"""Hugging Face ``config.json`` -> `MoEConfig`, one rule per model family.

Each family reads the fields its transformers 5.x modeling file reads, with that
config class's default where a field is absent (the defaults are quoted below from
``transformers/models/<family>/configuration_<family>.py``). What each family does
with them (docs/routing.md, "Families"):

- ``qwen2_moe``, ``qwen3_moe``, ``qwen3_next``, ``olmoe``: softmax over E, top-k,
  ``w / sum`` when ``norm_topk_prob`` (default False, except qwen3_next True).
  Qwen2/Qwen3-Next have one sigmoid-gated shared expert. Dense layers: index in
  ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``.
- ``qwen3_5_moe`` (and ``qwen3_5_moe_text``): always ``w / sum``; gated shared expert.
- ``mixtral``: always ``w / sum``.
- ``deepseek_v2``: softmax, ``topk_method`` greedy or group_limited_greedy (group
  score = max), no renormalization (HF ignores ``norm_topk_prob``), ``* routed_scaling_factor``.
- ``deepseek_v3``, ``glm4_moe``, ``bailing_hybrid`` / ``bailing_moe_v2`` (Ling 2.x, edge0-8b):
  sigmoid, selection bias, group score = sum of the top 2,
  masked with ``-inf``, ``w / (sum + 1e-20)`` when ``norm_topk_prob``, then the scale.
  Shared experts ungated, width ``moe_intermediate_size * n_shared_experts``; the
  first ``first_k_dense_replace`` layers are dense.
- ``gpt_oss``: router with bias, softmax over the k selected logits, experts with
  biases and the clamped SwiGLU (``swiglu_alpha``, ``swiglu_limit``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from jaxmoe.config import MoEConfig, RouterConfig

#: model_type values this module maps (``qwen3_5_moe_text`` is the text-only config).
FAMILIES = (
    "qwen2_moe",
    "qwen3_moe",
    "qwen3_next",
    "qwen3_5_moe",
    "olmoe",
    "mixtral",
    "deepseek_v2",
    "deepseek_v3",
    "glm4_moe",
    "bailing_hybrid",
    "bailing_moe_v2",
    "gpt_oss",
)

#: Alternative spellings of the same field (transformers' ``attribute_map`` of bailing_hybrid,
#: whose saved config.json uses the right-hand names, as Ling's own configs do).
_ALT_KEYS = {
    "num_experts_per_tok": "num_experts_per_token",
    "n_group": "num_expert_group",
    "norm_topk_prob": "moe_renormalize",
    "n_shared_experts": "num_shared_experts",
    "n_routed_experts": "num_experts",
}

_ALIASES = {"qwen3_5_moe_text": "qwen3_5_moe"}


def read_config_json(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed ``config.json`` of a checkpoint directory."""
    p = Path(path)
    cfgp = p / "config.json" if p.is_dir() else p
    if not cfgp.is_file():
        raise ValueError(f"{p}: no config.json")
    try:
        with open(cfgp) as f:
            d = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfgp}: config.json is not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{cfgp}: config.json must hold a JSON object")
    return d


def text_config(d: dict[str, Any]) -> dict[str, Any]:
    """The language-model part of a config (``text_config`` of multimodal wrappers).

    Keys of the outer config that the text config lacks (e.g. mlx-lm's ``quantization``)
    are kept.
    """
    tc = d.get("text_config")
    if isinstance(tc, dict) and ("hidden_size" in tc or "num_experts" in tc):
        out = dict(tc)
        out.setdefault("model_type", d.get("model_type"))
        for k, v in d.items():
            if k not in out and k != "text_config":
                out[k] = v
        return out
    return d


def family_of(d: dict[str, Any], source: str = "config.json") -> str:
    mt = d.get("model_type")
    mt = _ALIASES.get(mt, mt)
    if mt not in FAMILIES:
        raise ValueError(
            f"{source}: unknown or unsupported model_type {d.get('model_type')!r}; supported: {', '.join(FAMILIES)}"
        )
    return mt


def _get(d: dict[str, Any], key: str, default: Any, source: str) -> Any:
    v = d.get(key)
    if v is None and key in _ALT_KEYS:
        v = d.get(_ALT_KEYS[key])
    if v is None:
        v = default
    if v is None:
        v = default
    if v is None:
        raise ValueError(f"{source}: config.json needs key {key!r}")
    return v


def _int(d, key, default, source) -> int:
    v = _get(d, key, default, source)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{source}: config key {key!r} must be a non-negative int, got {v!r}")
    return v


def dense_layers(d: dict[str, Any], family: str, num_layers: int, source: str) -> tuple[int, ...]:
    """Indices of the layers whose MLP is dense, as the family's modeling file decides."""
    if family in ("qwen2_moe", "qwen3_moe", "qwen3_next"):
        only = d.get("mlp_only_layers") or []
        step = _int(d, "decoder_sparse_step", 1, source)
        if step < 1:
            raise ValueError(f"{source}: decoder_sparse_step must be >= 1, got {step}")
        return tuple(i for i in range(num_layers) if i in only or (i + 1) % step != 0)
    if family.startswith("bailing") and isinstance(d.get("mlp_layer_types"), list):
        types = d["mlp_layer_types"]
        if len(types) != num_layers or set(types) - {"dense", "sparse"}:
            raise ValueError(
                f"{source}: mlp_layer_types must list 'dense' / 'sparse' for each of the {num_layers} "
                f"layers, got {types!r}"
            )
        return tuple(i for i, t in enumerate(types) if t == "dense")
    if family in ("deepseek_v2", "deepseek_v3", "glm4_moe", "bailing_hybrid", "bailing_moe_v2"):
        default = {"deepseek_v2": 0, "deepseek_v3": 3, "glm4_moe": 1}.get(family, 2)
        k = _int(d, "first_k_dense_replace", default, source)
        return tuple(range(min(k, num_layers)))
    return ()


def moe_config_from_hf(d: dict[str, Any], source: str = "config.json", name: str = "") -> MoEConfig:
    """Maps a (text) ``config.json`` dict to the `MoEConfig` of its MoE layers.

    Raises ValueError naming the key for an unknown family or a bad / missing value.
    """
    d = text_config(d)
    fam = family_of(d, source)
    hidden = _int(d, "hidden_size", None, source)
    layers = _int(d, "num_hidden_layers", None, source)
    k = _int(d, "num_experts_per_tok", None, source)
    kw: dict[str, Any] = {}
    rk: dict[str, Any] = {}
    dense_dim = 0
    if fam in ("qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe"):
        e = _int(d, "num_experts", d.get("num_local_experts"), source)
        f = _int(d, "moe_intermediate_size", None, source)
        if fam == "qwen3_5_moe":
            renorm = "sum"
        else:
            renorm = "sum" if _get(d, "norm_topk_prob", fam == "qwen3_next", source) else "none"
        rk.update(score_fn="softmax", renorm=renorm)
        if fam != "qwen3_moe":
            fs = _int(d, "shared_expert_intermediate_size", None, source)
            if fs:
                kw.update(shared_expert_dim=fs, num_shared_experts=1, shared_expert_gate=True)
        dense_dim = int(d.get("intermediate_size") or 0)
    elif fam == "olmoe":
        e = _int(d, "num_experts", d.get("num_local_experts"), source)
        f = _int(d, "intermediate_size", None, source)
        rk.update(score_fn="softmax", renorm="sum" if _get(d, "norm_topk_prob", False, source) else "none")
    elif fam == "mixtral":
        e = _int(d, "num_local_experts", None, source)
        f = _int(d, "intermediate_size", None, source)
        rk.update(score_fn="softmax", renorm="sum")
    elif fam == "gpt_oss":
        e = _int(d, "num_local_experts", None, source)
        f = _int(d, "intermediate_size", None, source)
        rk.update(score_fn="softmax_topk", router_bias=True, renorm="none")
        kw.update(
            activation="swiglu_oai",
            expert_bias=True,
            swiglu_alpha=float(_get(d, "swiglu_alpha", 1.702, source)),
            swiglu_limit=float(_get(d, "swiglu_limit", 7.0, source)),
        )
    else:  # deepseek_v2, deepseek_v3, glm4_moe, bailing_*
        e = _int(d, "n_routed_experts", d.get("num_local_experts"), source)
        if fam.startswith("bailing") and d.get("score_function", "sigmoid") != "sigmoid":
            raise ValueError(f"{source}: {fam} score_function {d['score_function']!r} is not supported (sigmoid)")
        f = _int(d, "moe_intermediate_size", None, source)
        ns = _int(d, "n_shared_experts", {"deepseek_v2": 2}.get(fam, 1), source)
        if ns:
            kw.update(shared_expert_dim=f * ns, num_shared_experts=ns)
        scale = float(_get(d, "routed_scaling_factor", 1.0 if fam in ("deepseek_v2", "glm4_moe") else 2.5, source))
        if fam == "deepseek_v2":
            method = _get(d, "topk_method", "greedy", source)
            if method == "greedy":
                rk.update(n_group=1, topk_group=1)
            elif method == "group_limited_greedy":
                rk.update(n_group=_int(d, "n_group", None, source), topk_group=_int(d, "topk_group", None, source))
            else:
                raise ValueError(
                    f"{source}: deepseek_v2 topk_method {method!r} is not one of "
                    "'greedy', 'group_limited_greedy' (the ones transformers implements)"
                )
            rk.update(score_fn="softmax", group_score="max", renorm="none", routed_scaling_factor=scale)
        else:
            g_default, tg_default = (1, 1) if fam == "glm4_moe" else (8, 4)
            norm = _get(d, "norm_topk_prob", True, source)
            rk.update(
                score_fn="sigmoid",
                use_selection_bias=True,
                group_score="top2_sum",
                n_group=_int(d, "n_group", g_default, source),
                topk_group=_int(d, "topk_group", tg_default, source),
                renorm="add" if norm else "none",
                renorm_eps=1e-20 if norm else 0.0,
                routed_scaling_factor=scale,
            )
        dense_dim = int(d.get("intermediate_size") or 0)
    dl = dense_layers(d, fam, layers, source)
    try:
        router = RouterConfig(num_experts=e, top_k=k, **rk)
        return MoEConfig(
            d_model=hidden,
            expert_dim=f,
            router=router,
            num_layers=layers,
            dense_layers=dl,
            dense_dim=dense_dim if dl else 0,
            name=name,
            family=fam,
            **kw,
        )
    except ValueError as err:
        raise ValueError(f"{source}: {err}") from None


def load_config(path: str | os.PathLike) -> MoEConfig:
    """The `MoEConfig` of an HF checkpoint directory (reads ``config.json`` only)."""
    p = Path(path)
    return moe_config_from_hf(read_config_json(p), source=str(p / "config.json"), name=p.name)

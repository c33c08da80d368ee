"""GGUF (llama.cpp) checkpoints: one MoE layer in, one MoE layer out.

``load_layer(path, layer=i)`` returns ``(MoEConfig, MoEParams)``: it reads the MoE metadata keys of ``path``
(``{arch}.expert_count``, ``expert_used_count``, ``expert_shared_count``,
``expert_group_count``, ``expert_group_used_count``, ``expert_weights_scale``,
``expert_weights_norm``, ``expert_gating_func``, ``expert_feed_forward_length``,
``expert_shared_feed_forward_length``, ``leading_dense_block_count``, ``block_count``,
``embedding_length``, ``feed_forward_length``), maps the architecture to an `MoEConfig`
the way llama.cpp's model builders do (``src/models/<arch>.cpp`` + ``build_moe_ffn``),
and reads the tensors ``blk.{i}.*`` of that one layer through ``gguf.GGUFReader``'s memory
map: the other layers' bytes are never touched.

llama.cpp semantics this follows (read from llama.cpp, not from HF):

- renormalization, where llama.cpp renormalizes, divides by ``max(sum, 2^-14)``
  (``renorm="clamp"``); qwen3moe / qwen35moe / qwen3next / llama (Mixtral) always
  renormalize, qwen2moe / olmoe / gpt-oss never, deepseek2 / glm4moe / bailingmoe2 follow
  ``expert_weights_norm`` (default false);
- the gating function is fixed per arch except deepseek2 (default softmax), glm4moe
  (default sigmoid) and bailingmoe2 (required); 3 = softmax over the selected logits;
- group-limited selection (``expert_group_count > 1``) scores a group by the sum of its
  top-2 biased scores, for every arch;
- ``expert_weights_scale`` is read by deepseek2 / glm4moe / bailingmoe2 only (0 or absent
  = no scaling);
- shared experts: one sigmoid-gated shared expert for the Qwen MoE archs (width
  ``expert_shared_feed_forward_length``, default ``feed_forward_length``); ungated, width
  ``expert_feed_forward_length * expert_shared_count`` for deepseek2 / glm4moe
  (``expert_shared_feed_forward_length * expert_shared_count`` for bailingmoe2);
- gpt-oss: softmax over the k selected logits of a router with bias, experts with biases
  and the clamped SwiGLU (alpha 1.702, limit 7, hard-coded in llama.cpp).

Tensors Q8_0, Q4_0 and the GGUF block types (`jaxmoe.quant.GGUF_BLOCKS`: Q4_1 ... Q6_K,
Q2_K, Q3_K, IQ4_NL, IQ4_XS, MXFP4, the IQ1-3 and TQ types)
stay quantized
(`jaxmoe.quant.QuantizedTensor`, see `jaxmoe.io.gguf_codec`); everything else is
dequantized with gguf-py at load. Routers,
biases and the shared gate vector are loaded as float32.

``save_gguf((cfg, params), path, layer=i, dtype=...)`` writes the layer back with
llama.cpp's names and keys (only the MoE-relevant keys plus ``block_count`` /
``embedding_length``). `jaxmoe.pretrained` builds an `MoEBlock` from ``load_layer`` and
saves one with ``save_gguf``; this module knows only configs and parameter pytrees.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import jax.numpy as jnp
import numpy as np

from jaxmoe.config import F16_MIN_NORMAL, MoEConfig, RouterConfig
from jaxmoe.experts import ExpertWeights, SharedWeights
from jaxmoe.io import gguf_codec as gc
from jaxmoe.io.errors import CheckpointError
from jaxmoe.params import MoEParams
from jaxmoe.quant import QuantizedTensor

# llama.cpp's expert gating function ids (LLAMA_EXPERT_GATING_FUNC_TYPE_*).
GATING_SOFTMAX, GATING_SIGMOID, GATING_SOFTMAX_WEIGHT = 1, 2, 3
_GATING_TO_SCORE = {GATING_SOFTMAX: "softmax", GATING_SIGMOID: "sigmoid", GATING_SOFTMAX_WEIGHT: "softmax_topk"}
_SCORE_TO_GATING = {v: k for k, v in _GATING_TO_SCORE.items()}


@dataclasses.dataclass(frozen=True)
class ArchSpec:
    """How llama.cpp builds the MoE layer of one GGUF architecture.

    Attributes:
      family: the jaxmoe family name given to the loaded config.
      norm: fixed renormalization, or None when ``expert_weights_norm`` decides.
      gating: fixed gating function id, or None when ``expert_gating_func`` decides.
      gating_default: the id used when that key is absent (None: the key is required).
      shared: ``none``; ``gated`` one sigmoid-gated shared expert (Qwen), present when the
        file has ``ffn_up_shexp`` tensors; ``count`` ``expert_shared_count`` ungated shared experts.
      expert_ff: where the expert width comes from: ``exp`` ``expert_feed_forward_length``
        (required); ``exp_or_ff_over_k`` that, else ``feed_forward_length / expert_used_count``;
        ``exp_or_ff`` that, else ``feed_forward_length``; ``ff`` ``feed_forward_length``
        (llama / Mixtral, whose expert tensors are ``{n_embd, n_ff, n_expert}``).
      reads_scale: the builder applies ``expert_weights_scale``.
      reads_dense_lead: the builder honours ``leading_dense_block_count``.
      selection_bias: the arch may carry ``exp_probs_b.bias``.
      gpt_oss: router / expert biases and the clamped SwiGLU.
    """

    family: str
    norm: bool | None
    gating: int | None
    gating_default: int | None
    shared: str
    expert_ff: str
    reads_scale: bool = False
    reads_dense_lead: bool = False
    selection_bias: bool = False
    gpt_oss: bool = False


ARCHS: dict[str, ArchSpec] = {
    "qwen35moe": ArchSpec("qwen3_5_moe", True, GATING_SOFTMAX, None, "gated", "exp_or_ff_over_k"),
    "qwen3next": ArchSpec("qwen3_next", True, GATING_SOFTMAX, None, "gated", "exp_or_ff_over_k"),
    "qwen2moe": ArchSpec("qwen2_moe", False, GATING_SOFTMAX, None, "gated", "exp_or_ff_over_k"),
    "qwen3moe": ArchSpec("qwen3_moe", True, GATING_SOFTMAX, None, "none", "exp_or_ff_over_k"),
    "llama": ArchSpec("mixtral", True, GATING_SOFTMAX, None, "none", "ff"),
    "olmoe": ArchSpec("olmoe", False, GATING_SOFTMAX, None, "none", "exp_or_ff"),
    "deepseek2": ArchSpec(
        "deepseek_v2",
        None,
        None,
        GATING_SOFTMAX,
        "count",
        "exp",
        reads_scale=True,
        reads_dense_lead=True,
        selection_bias=True,
    ),
    "glm4moe": ArchSpec(
        "glm4_moe",
        None,
        None,
        GATING_SIGMOID,
        "count",
        "exp",
        reads_scale=True,
        reads_dense_lead=True,
        selection_bias=True,
    ),
    "bailingmoe2": ArchSpec(
        "bailing_moe_v2", None, None, None, "count", "exp", reads_scale=True, reads_dense_lead=True, selection_bias=True
    ),
    "gpt-oss": ArchSpec("gpt_oss", False, GATING_SOFTMAX_WEIGHT, None, "none", "exp", gpt_oss=True),
}

#: jaxmoe family -> GGUF arch written by `save_gguf`.
FAMILY_TO_ARCH = {
    "qwen3_5_moe": "qwen35moe",
    "qwen3_next": "qwen3next",
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
    "mixtral": "llama",
    "olmoe": "olmoe",
    "deepseek_v2": "deepseek2",
    "deepseek_v3": "deepseek2",
    "glm4_moe": "glm4moe",
    "bailing_moe_v2": "bailingmoe2",
    "gpt_oss": "gpt-oss",
}


# --------------------------------------------------------------------------- reading


def open_reader(path: str | os.PathLike) -> gguf.GGUFReader:
    """A memory-mapped ``GGUFReader`` for ``path``; bad files raise `CheckpointError`."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"GGUF file not found: {p}")
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise CheckpointError(f"{p}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
    try:
        reader = gguf.GGUFReader(p, "r")
    except Exception as e:  # gguf-py raises ValueError / IndexError / ... on a cut or corrupt header
        raise CheckpointError(f"{p}: truncated or corrupt GGUF file ({type(e).__name__}: {e})") from e
    size = p.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise CheckpointError(
                f"{p}: truncated GGUF file: tensor {t.name} ends at byte "
                f"{t.data_offset + t.n_bytes} but the file has {size} bytes"
            )
    _check_tensor_layout(p, reader)
    return reader


def _check_tensor_layout(p: Path, reader: gguf.GGUFReader) -> None:
    """Each tensor's data starts on the file's alignment (``general.alignment``, 32 by
    default) and no two tensors overlap: a corrupt offset in the header (which gguf-py
    reads as it is) would otherwise load another tensor's bytes, or bytes shifted within
    one, without an error."""
    align = int(getattr(reader, "alignment", 32)) or 32
    start = int(getattr(reader, "data_offset", 0))
    spans = sorted((int(t.data_offset), int(t.data_offset) + int(t.n_bytes), t.name) for t in reader.tensors)
    for lo, _, name in spans:
        if (lo - start) % align:
            raise CheckpointError(
                f"{p}: corrupt GGUF file: tensor {name}'s data offset {lo - start} is not a multiple of the "
                f"file's alignment {align}"
            )
    for (lo, hi, name), (lo2, _, name2) in zip(spans, spans[1:]):
        if lo2 < hi:
            raise CheckpointError(
                f"{p}: corrupt GGUF file: tensors {name} (bytes {lo}..{hi}) and {name2} (from byte {lo2}) overlap"
            )


def read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """All key/value metadata (``GGUF.*`` header fields left out) as Python values."""
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _arch(meta: dict[str, Any], path) -> str:
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise CheckpointError(f"{path}: key general.architecture is missing")
    if arch not in ARCHS:
        raise CheckpointError(
            f"{path}: unsupported GGUF architecture {arch!r} for an MoE layer; supported: {sorted(ARCHS)}"
        )
    return arch


class _Keys:
    """Typed access to ``{arch}.*`` keys with messages that name the key."""

    def __init__(self, meta: dict[str, Any], arch: str, path, layer: int | None = None):
        self.meta, self.arch, self.path, self.layer = meta, arch, path, layer

    def full(self, key: str) -> str:
        return f"{self.arch}.{key}"

    def raw(self, key: str, default=None, required: bool = False):
        k = self.full(key)
        if k not in self.meta:
            if required:
                raise CheckpointError(f"{self.path}: required key {k} is missing")
            return default
        return self.meta[k]

    def int(self, key: str, default: int | None = None, required: bool = False, layer: int | None = None):
        v = self.raw(key, default, required)
        layer = self.layer if layer is None else layer
        if isinstance(v, list):  # per-layer arrays (get_key_or_arr): the entry of `layer` (0 if none given)
            if not v:
                raise CheckpointError(f"{self.path}: key {self.full(key)} is an empty array")
            if layer is not None and not 0 <= layer < len(v):
                raise CheckpointError(
                    f"{self.path}: per-layer key {self.full(key)} has {len(v)} entries, no entry for layer {layer}"
                )
            v = v[0 if layer is None else layer]
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise CheckpointError(f"{self.path}: key {self.full(key)} must be a non-negative integer, got {v!r}")
        return int(v)


def config_from_reader(reader: gguf.GGUFReader, path="<gguf>", layer: int | None = None) -> MoEConfig:
    """The `MoEConfig` of a GGUF file's MoE layers (metadata and tensor names only).

    A per-layer array key takes its entry ``layer`` (entry 0 when ``layer`` is None); an
    array with no entry for ``layer`` is a `CheckpointError`.
    """
    meta = read_metadata(reader)
    arch = _arch(meta, path)
    spec = ARCHS[arch]
    k = _Keys(meta, arch, path, layer)
    n_layers = k.int("block_count", required=True)
    d = k.int("embedding_length", required=True)
    e = k.int("expert_count")
    if not e:
        raise CheckpointError(
            f"{path}: {arch} file has no experts ({k.full('expert_count')} is "
            f"{'missing' if e is None else e}); it is not an MoE model"
        )
    top_k = k.int("expert_used_count", required=True)
    if not 0 < top_k <= e:
        raise CheckpointError(f"{path}: {k.full('expert_used_count')}={top_k} must lie in [1, expert_count={e}]")
    n_ff = k.int("feed_forward_length")
    f_exp = n_ff if spec.expert_ff == "ff" else k.int("expert_feed_forward_length")
    if f_exp is None:
        if spec.expert_ff == "exp_or_ff_over_k" and n_ff:
            f_exp = n_ff // top_k
        elif spec.expert_ff in ("exp_or_ff", "ff") and n_ff:
            f_exp = n_ff
        else:
            key = "feed_forward_length" if spec.expert_ff == "ff" else "expert_feed_forward_length"
            raise CheckpointError(f"{path}: required key {k.full(key)} is missing")
    if not f_exp:
        raise CheckpointError(f"{path}: the expert width ({k.full('expert_feed_forward_length')}) is 0")

    n_group = k.int("expert_group_count", default=0) or 1
    topk_group = k.int("expert_group_used_count", required=n_group > 1, default=1)
    if n_group > 1:
        if e % n_group:
            raise CheckpointError(
                f"{path}: {k.full('expert_count')}={e} is not divisible by {k.full('expert_group_count')}={n_group}"
            )
        if not 0 < topk_group < n_group:
            raise CheckpointError(
                f"{path}: {k.full('expert_group_used_count')}={topk_group} must lie in "
                f"[1, expert_group_count={n_group})"
            )

    if spec.gating is not None:
        gating = spec.gating
    else:
        gating = k.int("expert_gating_func", default=0) or spec.gating_default
        if gating is None:
            raise CheckpointError(f"{path}: required key {k.full('expert_gating_func')} is missing")
    if gating not in _GATING_TO_SCORE:
        raise CheckpointError(
            f"{path}: {k.full('expert_gating_func')}={gating} is not supported "
            f"(1 softmax, 2 sigmoid, 3 softmax over the selected)"
        )
    norm = spec.norm if spec.norm is not None else bool(k.raw("expert_weights_norm", False))
    scale = 1.0
    if spec.reads_scale:
        s = k.raw("expert_weights_scale", 0.0)
        if not isinstance(s, (int, float)) or isinstance(s, bool) or not np.isfinite(s) or s < 0:
            raise CheckpointError(f"{path}: {k.full('expert_weights_scale')} must be a finite number >= 0, got {s!r}")
        scale = float(s) if s not in (0, 0.0) else 1.0

    names = {t.name for t in reader.tensors}
    use_bias = spec.selection_bias and any(n.endswith(".exp_probs_b.bias") for n in names)

    dense_lead = k.int("leading_dense_block_count", default=0) if spec.reads_dense_lead else 0
    if dense_lead > n_layers:
        raise CheckpointError(
            f"{path}: {k.full('leading_dense_block_count')}={dense_lead} exceeds block_count={n_layers}"
        )

    shared_dim = n_shared = 0
    gated = False
    if spec.shared == "gated" and any(n.endswith(".ffn_up_shexp.weight") for n in names):
        # llama.cpp builds the shared branch only where its tensors exist (qwen3next)
        fs = k.int("expert_shared_feed_forward_length") or n_ff
        if not fs:
            raise CheckpointError(
                f"{path}: {arch} has a shared expert but neither "
                f"{k.full('expert_shared_feed_forward_length')} nor "
                f"{k.full('feed_forward_length')} gives its width"
            )
        shared_dim, n_shared, gated = fs, 1, True
    elif spec.shared == "count":
        n_shared = k.int("expert_shared_count", default=0)
        if n_shared:
            per = f_exp
            if arch == "bailingmoe2":
                per = k.int("expert_shared_feed_forward_length") or f_exp
            shared_dim = per * n_shared

    router = RouterConfig(
        num_experts=e,
        top_k=top_k,
        score_fn=_GATING_TO_SCORE[gating],
        n_group=n_group,
        topk_group=topk_group if n_group > 1 else 1,
        group_score="top2_sum",
        use_selection_bias=use_bias,
        router_bias=spec.gpt_oss,
        renorm="clamp" if norm else "none",
        renorm_eps=F16_MIN_NORMAL if norm else 0.0,
        routed_scaling_factor=scale,
    )
    family = spec.family
    if arch == "deepseek2" and gating == GATING_SIGMOID:
        family = "deepseek_v3"
    name = meta.get("general.name")
    try:
        return MoEConfig(
            d_model=d,
            expert_dim=f_exp,
            activation="swiglu_oai" if spec.gpt_oss else "swiglu",
            expert_bias=spec.gpt_oss,
            router=router,
            shared_expert_dim=shared_dim,
            num_shared_experts=n_shared,
            shared_expert_gate=gated,
            num_layers=n_layers,
            dense_layers=tuple(range(dense_lead)),
            dense_dim=(n_ff or 0) if dense_lead else 0,
            name=name if isinstance(name, str) else "",
            family=family,
        )
    except ValueError as err:
        raise CheckpointError(f"{path}: the metadata gives an invalid MoE config: {err}") from err


def load_config(path: str | os.PathLike) -> MoEConfig:
    """The `MoEConfig` of a GGUF file (no tensor data read)."""
    return config_from_reader(open_reader(path), path)


def _np_shape(t) -> tuple[int, ...]:
    """A reader tensor's logical numpy shape (GGUF dims reversed), from the header only."""
    return tuple(int(x) for x in reversed(t.shape.tolist()))


def _layer_plan(reader, cfg: MoEConfig, layer: int, path) -> dict[str, tuple[Any, tuple[int, ...]]]:
    """``{role: (reader tensor, expected numpy shape)}`` for one layer; validates names,
    shapes and types before any data is read."""
    if not isinstance(layer, (int, np.integer)) or isinstance(layer, bool):
        raise CheckpointError(f"{path}: layer must be an int, got {layer!r}")
    if not 0 <= layer < cfg.num_layers:
        raise CheckpointError(f"{path}: layer {layer} is outside [0, block_count={cfg.num_layers})")
    if layer in cfg.dense_layers:
        raise CheckpointError(
            f"{path}: layer {layer} is a dense layer (leading_dense_block_count="
            f"{len(cfg.dense_layers)}); it has no experts"
        )
    tensors = {t.name: t for t in reader.tensors}
    pre = f"blk.{layer}."
    e, d, f, fs = cfg.num_experts, cfg.d_model, cfg.expert_dim, cfg.shared_expert_dim
    plan: dict[str, tuple[Any, tuple[int, ...]]] = {}

    def need(role: str, name: str, shape: tuple[int, ...], alt_shapes=()):
        t = tensors.get(pre + name)
        if t is None:
            have = sorted(n[len(pre) :] for n in tensors if n.startswith(pre))
            raise CheckpointError(f"{path}: tensor {pre + name} is missing (layer {layer} has: {have})")
        got = _np_shape(t)
        if got != shape and got not in alt_shapes:
            raise CheckpointError(
                f"{path}: tensor {pre + name} has shape {got} but the metadata (expert_count={e}, "
                f"embedding_length={d}, expert width={f}, shared width={fs}) implies {shape}"
            )
        if not gc.can_dequantize(t.tensor_type):
            raise CheckpointError(
                f"{path}: tensor {pre + name} has type {t.tensor_type.name}, which gguf-py cannot dequantize"
            )
        plan[role] = (t, shape)

    need("router", "ffn_gate_inp.weight", (e, d))
    if pre + "ffn_gate_up_exps.weight" in tensors:
        need("gate_up", "ffn_gate_up_exps.weight", (e, 2 * f, d))
    else:
        need("gate", "ffn_gate_exps.weight", (e, f, d))
        need("up", "ffn_up_exps.weight", (e, f, d))
    need("down", "ffn_down_exps.weight", (e, d, f))
    if cfg.router.use_selection_bias:
        need("selection_bias", "exp_probs_b.bias", (e,))
    if cfg.router.router_bias:
        need("router_bias", "ffn_gate_inp.bias", (e,))
    if cfg.expert_bias:
        if "gate_up" in plan:
            need("b_gate_up", "ffn_gate_up_exps.bias", (e, 2 * f))
        else:
            need("b_gate", "ffn_gate_exps.bias", (e, f))
            need("b_up", "ffn_up_exps.bias", (e, f))
        need("b_down", "ffn_down_exps.bias", (e, d))
    if fs:
        need("s_gate", "ffn_gate_shexp.weight", (fs, d))
        need("s_up", "ffn_up_shexp.weight", (fs, d))
        need("s_down", "ffn_down_shexp.weight", (d, fs))
        if cfg.shared_expert_gate:
            need("s_sigmoid_gate", "ffn_gate_inp_shexp.weight", (d,), alt_shapes=((1, d),))
    return plan


def load_layer_params(
    reader, cfg: MoEConfig, layer: int, dtype=jnp.float32, path="<gguf>", on_read: Callable[[str], Any] | None = None
) -> MoEParams:
    """The `MoEParams` of layer ``layer`` (only that layer's tensors are read).

    ``on_read(name)`` is called with each tensor name before its bytes are touched (tests
    use it to check that no other layer is read).
    """
    plan = _layer_plan(reader, cfg, layer, path)
    f = cfg.expert_dim

    def data(role):
        t, _ = plan[role]
        if on_read is not None:
            on_read(t.name)
        return t.data, t.tensor_type

    file = getattr(reader.data, "filename", None)  # read with pread: the file's pages stay unmapped

    def mat(role, rows=None):  # [..., out, in] in the file -> [..., in, out]
        raw, qt = data(role)
        t = plan[role][0]
        # rows: output rows of a merged tensor (quant blocks run along `in`)
        ft = gc.FileTensor(raw, qt, file, int(t.data_offset), rows)
        return gc.to_device(gc.host_weight_from_file(ft, dtype, name=f"{path}: tensor {t.name}"))

    def vec(role) -> jnp.ndarray:
        raw, qt = data(role)
        return jnp.asarray(gc.dequantize_raw(raw, qt).reshape(plan[role][1]).astype(np.float32))

    raw, qt = data("router")
    w_router = jnp.asarray(np.ascontiguousarray(gc.dequantize_raw(raw, qt).T))  # [d, E] float32
    if "gate_up" in plan:  # rows [0:F] gate, [F:2F] up
        w_gate, w_up = mat("gate_up", (0, f)), mat("gate_up", (f, 2 * f))
    else:
        w_gate, w_up = mat("gate"), mat("up")
    w_down = mat("down")
    b_gate = b_up = b_down = None
    if cfg.expert_bias:
        if "b_gate_up" in plan:
            raw, qt = data("b_gate_up")
            bgu = gc.dequantize_raw(raw, qt).reshape(plan["b_gate_up"][1])
            b_gate, b_up = jnp.asarray(np.ascontiguousarray(bgu[:, :f])), jnp.asarray(np.ascontiguousarray(bgu[:, f:]))
        else:
            b_gate, b_up = vec("b_gate"), vec("b_up")
        b_down = vec("b_down")
    experts = ExpertWeights(w_gate, w_up, w_down, b_gate, b_up, b_down)
    shared = None
    if cfg.shared_expert_dim:
        gate = vec("s_sigmoid_gate") if cfg.shared_expert_gate else None
        shared = SharedWeights(mat("s_gate"), mat("s_up"), mat("s_down"), gate)
    params = MoEParams(
        w_router=w_router,
        experts=experts,
        b_router=vec("router_bias") if cfg.router.router_bias else None,
        selection_bias=vec("selection_bias") if cfg.router.use_selection_bias else None,
        shared=shared,
    )
    try:
        params.check(cfg)
    except ValueError as err:
        raise CheckpointError(f"{path}: layer {layer}: {err}") from err
    return params


def load_layer(
    path: str | os.PathLike, layer: int = 0, dtype=jnp.float32, on_read: Callable[[str], Any] | None = None
) -> tuple[MoEConfig, MoEParams]:
    """``(MoEConfig, MoEParams)`` of MoE layer ``layer`` of the GGUF file ``path``.

    Args:
      path: the ``.gguf`` file.
      layer: the block index ``i`` of ``blk.{i}.*``.
      dtype: dtype of the float expert and shared-expert weights (Q8_0 / Q4_0 and the GGUF
        block types of `jaxmoe.quant.GGUF_BLOCKS`, Q4_1 ... Q6_K, Q2_K, Q3_K, IQ4_NL,
        IQ4_XS, MXFP4, IQ1-3, TQ1_0, TQ2_0, stay quantized; routers and biases are float32).
      on_read: called with each tensor name before its bytes are read.
    """
    reader = open_reader(path)
    cfg = config_from_reader(reader, path, layer)
    return cfg, load_layer_params(reader, cfg, layer, dtype=dtype, path=path, on_read=on_read)


# --------------------------------------------------------------------------- writing


def _check_exportable(cfg: MoEConfig, arch: str, layer: int) -> ArchSpec:
    """Raises ValueError naming the option of ``cfg`` that ``arch`` cannot express."""
    if arch not in ARCHS:
        raise ValueError(f"save_gguf: unknown arch {arch!r}; supported: {sorted(ARCHS)}")
    spec = ARCHS[arch]
    r = cfg.router

    def bad(opt, msg):
        raise ValueError(f"save_gguf: cfg.{opt} {msg} cannot be expressed by GGUF arch {arch!r}")

    if not 0 <= layer < cfg.num_layers:
        raise ValueError(f"save_gguf: layer {layer} is outside [0, num_layers={cfg.num_layers})")
    if layer in cfg.dense_layers:
        raise ValueError(f"save_gguf: layer {layer} is a dense layer of this config")
    gating = _SCORE_TO_GATING.get(r.score_fn)
    if gating is None:
        bad("router.score_fn", f"={r.score_fn!r}")
    if spec.gating is not None and gating != spec.gating:
        bad("router.score_fn", f"={r.score_fn!r} (llama.cpp uses {_GATING_TO_SCORE[spec.gating]!r})")
    norm = r.renorm != "none"
    if spec.norm is not None and norm != spec.norm:
        bad("router.renorm", f"={r.renorm!r} (llama.cpp {'always' if spec.norm else 'never'} renormalizes)")
    if r.n_group > 1 and r.topk_group < r.n_group and r.group_score != "top2_sum":
        bad("router.group_score", f"={r.group_score!r} (llama.cpp scores groups by their top-2 sum)")
    if r.routed_scaling_factor != 1.0 and not spec.reads_scale:
        bad("router.routed_scaling_factor", f"={r.routed_scaling_factor}")
    if r.use_selection_bias and not spec.selection_bias:
        bad("router.use_selection_bias", "=True")
    if r.router_bias != spec.gpt_oss:
        bad("router.router_bias", f"={r.router_bias}")
    if cfg.expert_bias != spec.gpt_oss:
        bad("expert_bias", f"={cfg.expert_bias}")
    if cfg.activation != ("swiglu_oai" if spec.gpt_oss else "swiglu"):
        bad("activation", f"={cfg.activation!r}")
    if spec.gpt_oss and (cfg.swiglu_alpha != 1.702 or cfg.swiglu_limit != 7.0):
        bad("swiglu_alpha/swiglu_limit", f"={cfg.swiglu_alpha}/{cfg.swiglu_limit} (llama.cpp: 1.702/7)")
    if cfg.weight_on_input:
        bad("weight_on_input", "=True")
    if cfg.dense_layers and (not spec.reads_dense_lead or cfg.dense_layers != tuple(range(len(cfg.dense_layers)))):
        bad("dense_layers", f"={cfg.dense_layers}")
    if cfg.shared_expert_dim:
        if spec.shared == "none":
            bad("shared_expert_dim", f"={cfg.shared_expert_dim}")
        if spec.shared == "gated" and (not cfg.shared_expert_gate or cfg.num_shared_experts != 1):
            bad("shared_expert_gate", f"={cfg.shared_expert_gate} / num_shared_experts={cfg.num_shared_experts}")
        if spec.shared == "count":
            if cfg.shared_expert_gate:
                bad("shared_expert_gate", "=True")
            per, rem = divmod(cfg.shared_expert_dim, cfg.num_shared_experts)
            if rem or (arch != "bailingmoe2" and per != cfg.expert_dim):
                bad("shared_expert_dim", f"={cfg.shared_expert_dim} (must be expert_dim * num_shared_experts)")
    return spec


def cfg_and_params(model, who: str = "save_gguf") -> tuple[MoEConfig, MoEParams]:
    """``(cfg, params)`` of ``model``: a ``(MoEConfig, MoEParams)`` pair, or an object with
    ``.cfg`` and ``.params()`` (an `MoEBlock`). Anything else is a ValueError naming what it got."""
    if isinstance(model, tuple) and len(model) == 2:
        cfg, params = model
    elif hasattr(model, "cfg") and callable(getattr(model, "params", None)):
        cfg, params = model.cfg, model.params()
    else:
        raise ValueError(
            f"{who}: expected (MoEConfig, MoEParams) or an object with .cfg and .params() (an MoEBlock), "
            f"got {type(model).__name__}"
        )
    if not isinstance(cfg, MoEConfig):
        raise ValueError(f"{who}: the config must be an MoEConfig, got {type(cfg).__name__}")
    if not isinstance(params, MoEParams):
        raise ValueError(f"{who}: the parameters must be an MoEParams, got {type(params).__name__}")
    params.check(cfg)
    return cfg, params


def save_gguf(
    model, path: str | os.PathLike, layer: int = 0, dtype: str = "f16", arch: str | None = None, name: str | None = None
) -> Path:
    """Writes one MoE layer as a GGUF file with llama.cpp's names and keys.

    Args:
      model: ``(MoEConfig, MoEParams)``, or an object with ``.cfg`` and ``.params()``
        (an `MoEBlock`).
      path: the output ``.gguf`` path.
      layer: the block index the tensors get (``blk.{layer}.*``).
      dtype: ``f32``, ``f16``, ``bf16``, ``q8_0``, ``q4_0``, ``q4_1``, ``q5_0``, ``q5_1``,
        ``mxfp4`` (quantized by gguf-py), ``q2_k``, ``q3_k``, ``q4_k``, ``q5_k``, ``q6_k``,
        ``iq4_nl``, ``iq4_xs``, the IQ1-3 / TQ kinds (only for weights already stored so), or ``keep``: each
        matrix in the type it is stored in exactly
        (`jaxmoe.io.gguf_codec.native_qtype`), so a loaded Q4_K_M layer is written back
        byte for byte. Routers and biases are always F32. Experts already quantized
        exactly in the target format are written byte for byte.
      arch: the GGUF architecture; by default from ``cfg.family``.
      name: ``general.name`` (default ``cfg.name``).
    Returns:
      the path written.
    """
    cfg, p = cfg_and_params(model)
    if dtype not in gc.EXPORT_TYPES and dtype != gc.KEEP:
        raise ValueError(f"save_gguf: unknown dtype {dtype!r}; expected one of {sorted([*gc.EXPORT_TYPES, gc.KEEP])}")
    qtype = gc.EXPORT_TYPES.get(dtype)
    if arch is None:
        arch = FAMILY_TO_ARCH.get(cfg.family)
        if arch is None:
            raise ValueError(f"save_gguf: no GGUF arch for family {cfg.family!r}; pass arch= (one of {sorted(ARCHS)})")
    spec = _check_exportable(cfg, arch, layer)
    r = cfg.router
    path = Path(path)

    w = gguf.GGUFWriter(path, arch)
    w.add_name(name if name is not None else (cfg.name or arch))
    w.add_block_count(cfg.num_layers)
    w.add_embedding_length(cfg.d_model)
    w.add_expert_count(r.num_experts)
    w.add_expert_used_count(r.top_k)
    w.add_expert_feed_forward_length(cfg.expert_dim)
    w.add_feed_forward_length(cfg.expert_dim if arch == "llama" else (cfg.dense_dim or cfg.expert_dim))
    if r.n_group > 1 and r.topk_group < r.n_group:
        w.add_expert_group_count(r.n_group)
        w.add_expert_group_used_count(r.topk_group)
    if spec.norm is None:
        w.add_expert_weights_norm(r.renorm != "none")
    if spec.gating is None:
        w.add_expert_gating_func(gguf.ExpertGatingFuncType(_SCORE_TO_GATING[r.score_fn]))
    if spec.reads_scale:
        w.add_expert_weights_scale(float(r.routed_scaling_factor))
    if spec.reads_dense_lead:
        w.add_leading_dense_block_count(len(cfg.dense_layers))
    if cfg.shared_expert_dim:
        if spec.shared == "gated":
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_dim)
        else:
            w.add_expert_shared_count(cfg.num_shared_experts)
            if arch == "bailingmoe2":
                w.add_expert_shared_feed_forward_length(cfg.shared_expert_dim // cfg.num_shared_experts)
    elif spec.shared == "count":
        w.add_expert_shared_count(0)

    pre = f"blk.{layer}."

    def f32(x) -> np.ndarray:
        return np.ascontiguousarray(gc.to_numpy_f32(x) if isinstance(x, QuantizedTensor) else np.asarray(x, np.float32))

    def mat(tname, x):
        data, raw = gc.weight_to_gguf(x, gc.native_qtype(x) if qtype is None else qtype, pre + tname)
        w.add_tensor(pre + tname, data, raw_dtype=raw)

    w.add_tensor(pre + "ffn_gate_inp.weight", np.ascontiguousarray(f32(p.w_router).T))
    if r.router_bias:
        w.add_tensor(pre + "ffn_gate_inp.bias", f32(p.b_router))
    if r.use_selection_bias:
        w.add_tensor(pre + "exp_probs_b.bias", f32(p.selection_bias))
    ew = p.experts
    mat("ffn_gate_exps.weight", ew.w_gate)
    mat("ffn_up_exps.weight", ew.w_up)
    mat("ffn_down_exps.weight", ew.w_down)
    if cfg.expert_bias:
        w.add_tensor(pre + "ffn_gate_exps.bias", f32(ew.b_gate))
        w.add_tensor(pre + "ffn_up_exps.bias", f32(ew.b_up))
        w.add_tensor(pre + "ffn_down_exps.bias", f32(ew.b_down))
    if p.shared is not None and cfg.shared_expert_dim:
        mat("ffn_gate_shexp.weight", p.shared.w_gate)
        mat("ffn_up_shexp.weight", p.shared.w_up)
        mat("ffn_down_shexp.weight", p.shared.w_down)
        if cfg.shared_expert_gate:
            w.add_tensor(pre + "ffn_gate_inp_shexp.weight", f32(p.shared.gate))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


__all__ = [
    "ARCHS",
    "ArchSpec",
    "CheckpointError",
    "FAMILY_TO_ARCH",
    "cfg_and_params",
    "config_from_reader",
    "load_config",
    "load_layer",
    "load_layer_params",
    "open_reader",
    "read_metadata",
    "save_gguf",
]

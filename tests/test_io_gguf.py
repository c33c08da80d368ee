"""GGUF loading and export against a float64 numpy reference written from llama.cpp.

Every file here is written in the test with ``gguf.GGUFWriter``; the reference forward
below (``np_moe``) is written from llama.cpp's ``build_moe_ffn`` and per-arch builders, on
weights dequantized with ``gguf.quants.dequantize``, never from jaxmoe code.
"""

from __future__ import annotations

import dataclasses

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from helpers import assert_same_params, gguf_block_bytes

import jaxmoe
from jaxmoe import io as jio
from jaxmoe.config import MoEConfig
from jaxmoe.config import load_config as load_preset_config
from jaxmoe.io import gguf as jgguf
from jaxmoe.io import gguf_codec as gq
from jaxmoe.io.errors import CheckpointError
from jaxmoe.io.inspect import inspect_gguf
from jaxmoe.offload.store import GGUFStore
from jaxmoe.params import MoEParams
from jaxmoe.quant import GGUF_BLOCKS, QuantizedTensor, quantize_int4_affine

# ----------------------------------------------------------------------------- writing helpers


def kquant_bytes(rng, shape, qtype) -> np.ndarray:
    """Valid random K-quant bytes for a logical numpy ``shape`` (last dim multiple of 256),
    with finite, small f16 super-block scales."""
    block, size = GGML_QUANT_SIZES[qtype]
    n_blocks = int(np.prod(shape)) // block
    b = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    if qtype in (QT.Q4_K, QT.Q5_K):  # d, dmin at bytes 0:4
        b[:, 0:2] = rng.uniform(1e-3, 4e-3, (n_blocks, 1)).astype(np.float16).view(np.uint8)
        b[:, 2:4] = rng.uniform(1e-3, 4e-3, (n_blocks, 1)).astype(np.float16).view(np.uint8)
    elif qtype == QT.Q6_K:  # d at the end
        b[:, size - 2 :] = rng.uniform(1e-4, 4e-4, (n_blocks, 1)).astype(np.float16).view(np.uint8)
    else:
        raise ValueError(qtype)
    return b.reshape(*shape[:-1], shape[-1] // block * size)


#: The IQ1-3 types (llama.cpp makes them with an importance matrix; gguf-py cannot quantize
#: them): random valid blocks with small finite scales. TQ1_0 / TQ2_0 gguf-py quantizes.
IQ_TYPES = (QT.IQ2_XXS, QT.IQ2_XS, QT.IQ2_S, QT.IQ3_XXS, QT.IQ3_S, QT.IQ1_S, QT.IQ1_M)


def encode(rng, w: np.ndarray, qtype):
    """A float numpy tensor (GGUF numpy orientation) -> (data, raw_dtype) for add_tensor."""
    if qtype == QT.F32:
        return w.astype(np.float32), None
    if qtype == QT.F16:
        return w.astype(np.float16), None
    if qtype in (QT.Q4_K, QT.Q5_K, QT.Q6_K):
        return kquant_bytes(rng, w.shape, qtype), qtype
    if qtype in (
        QT.Q2_K,
        QT.Q3_K,
        QT.IQ4_NL,
        QT.IQ4_XS,
        *IQ_TYPES,
    ):  # gguf-py cannot quantize these: random valid blocks
        return gguf_block_bytes(rng, qtype, w.shape), qtype
    if qtype in (QT.Q4_1, QT.Q5_0, QT.Q5_1):  # quantize the values the test drew
        return gguf.quants.quantize(w.astype(np.float32), qtype), qtype
    return gguf.quants.quantize(w.astype(np.float32), qtype), qtype


def write_gguf(path, arch: str, kv: dict, tensors: dict) -> None:
    """``kv`` keys without the ``{arch}.`` prefix; ``tensors`` name -> (data, raw_dtype)."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, v in kv.items():
        full = key if key.startswith("general.") else f"{arch}.{key}"
        if isinstance(v, bool):
            w.add_bool(full, v)
        elif isinstance(v, int):
            w.add_uint32(full, v)
        elif isinstance(v, float):
            w.add_float32(full, v)
        else:
            w.add_string(full, v)
    for name, (data, raw) in tensors.items():
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def deq(data, raw) -> np.ndarray:
    """The float64 values llama.cpp sees for a tensor written as (data, raw_dtype)."""
    if raw is None:
        return np.asarray(data, np.float64)
    return gguf.quants.dequantize(np.asarray(data), raw).astype(np.float64)


# ----------------------------------------------------------------------------- the reference


def _silu(v):
    return v / (1.0 + np.exp(-v))


def np_moe(x, t: dict, *, k, gating, norm, scale=1.0, n_group=1, group_used=1, oai=False, gated_shared=False):
    """float64 MoE layer on GGUF-orientation tensors (llama.cpp build_moe_ffn semantics).

    ``t``: router (E, d) [+ router_b (E,)], gate / up (E, F, d), down (E, d, F),
    optional probs_b (E,), gate_b / up_b (E, F), down_b (E, d), sh_gate / sh_up (Fs, d),
    sh_down (d, Fs), sh_inp (d,).
    """
    x = np.asarray(x, np.float64)
    y = np.zeros_like(x)
    e = t["router"].shape[0]
    for i, xi in enumerate(x):
        z = t["router"] @ xi + t.get("router_b", 0.0)
        if gating == "softmax":
            p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
        elif gating == "sigmoid":
            p = 1.0 / (1.0 + np.exp(-z))
        else:  # softmax over the selected: select on the logits
            p = z
        c = p + t.get("probs_b", 0.0)
        if n_group > 1:
            per = e // n_group
            gs = [np.sort(c[g * per : (g + 1) * per])[-2:].sum() for g in range(n_group)]
            keep = np.argsort(-np.asarray(gs), kind="stable")[:group_used]
            c = np.where(np.isin(np.arange(e) // per, keep), c, -np.inf)
        ids = np.argsort(-c, kind="stable")[:k]
        w = p[ids]
        if gating == "softmax_weight":
            w = np.exp(w - w.max()) / np.exp(w - w.max()).sum()
        if norm:
            w = w / max(w.sum(), 2.0**-14)
        w = w * scale
        for wj, j in zip(w, ids):
            g = t["gate"][j] @ xi + (t["gate_b"][j] if "gate_b" in t else 0.0)
            u = t["up"][j] @ xi + (t["up_b"][j] if "up_b" in t else 0.0)
            if oai:
                g = np.minimum(g, 7.0)
                u = np.clip(u, -7.0, 7.0)
                h = g / (1.0 + np.exp(-1.702 * g)) * (u + 1.0)
            else:
                h = _silu(g) * u
            out = t["down"][j] @ h + (t["down_b"][j] if "down_b" in t else 0.0)
            y[i] += wj * out
        if "sh_gate" in t:
            hs = _silu(t["sh_gate"] @ xi) * (t["sh_up"] @ xi)
            ys = t["sh_down"] @ hs
            if gated_shared:
                ys = ys / (1.0 + np.exp(-(t["sh_inp"] @ xi)))
            y[i] += ys
    return y


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


# ----------------------------------------------------------------------------- one arch = one case


@dataclasses.dataclass
class Case:
    arch: str
    kv: dict
    ref: dict  # np_moe keyword arguments
    e: int = 16
    d: int = 64
    f: int = 32
    fs: int = 0
    qtypes: tuple = (QT.F32, QT.F32, QT.F32)  # gate, up, down
    shared_q: object = QT.F32
    shared_down_q: object = None  # default: shared_q
    probs_b: bool = False
    oai: bool = False
    gated_shared: bool = False
    merged: bool = False
    layer: int = 1
    n_layers: int = 3


def make_layer(rng, c: Case, layer: int):
    """(tensors to write, float64 reference tensors) of one layer."""
    e, d, f, fs = c.e, c.d, c.f, c.fs
    pre = f"blk.{layer}."
    out, ref = {}, {}

    def put(name, key, arr, qtype=QT.F32):
        data, raw = encode(rng, arr, qtype)
        out[pre + name] = (data, raw)
        ref[key] = deq(data, raw).reshape(arr.shape)

    put("ffn_gate_inp.weight", "router", rng.standard_normal((e, d)).astype(np.float32) * 0.5)
    sc = 1.0 / np.sqrt(d)
    wg = (rng.standard_normal((e, f, d)) * sc).astype(np.float32)
    wu = (rng.standard_normal((e, f, d)) * sc).astype(np.float32)
    if c.merged:
        data, raw = encode(rng, np.concatenate([wg, wu], axis=1), c.qtypes[0])
        out[pre + "ffn_gate_up_exps.weight"] = (data, raw)
        full = deq(data, raw).reshape(e, 2 * f, d)
        ref["gate"], ref["up"] = full[:, :f], full[:, f:]
    else:
        put("ffn_gate_exps.weight", "gate", wg, c.qtypes[0])
        put("ffn_up_exps.weight", "up", wu, c.qtypes[1])
    put("ffn_down_exps.weight", "down", (rng.standard_normal((e, d, f)) / np.sqrt(f)).astype(np.float32), c.qtypes[2])
    if c.probs_b:
        put("exp_probs_b.bias", "probs_b", rng.standard_normal(e).astype(np.float32) * 0.1)
    if c.oai:
        put("ffn_gate_inp.bias", "router_b", rng.standard_normal(e).astype(np.float32) * 0.3)
        put("ffn_gate_exps.bias", "gate_b", rng.standard_normal((e, f)).astype(np.float32) * 0.3)
        put("ffn_up_exps.bias", "up_b", rng.standard_normal((e, f)).astype(np.float32) * 0.3)
        put("ffn_down_exps.bias", "down_b", rng.standard_normal((e, d)).astype(np.float32) * 0.3)
    if fs:
        put("ffn_gate_shexp.weight", "sh_gate", (rng.standard_normal((fs, d)) * sc).astype(np.float32), c.shared_q)
        put("ffn_up_shexp.weight", "sh_up", (rng.standard_normal((fs, d)) * sc).astype(np.float32), c.shared_q)
        put(
            "ffn_down_shexp.weight",
            "sh_down",
            (rng.standard_normal((d, fs)) / np.sqrt(fs)).astype(np.float32),
            c.shared_q if c.shared_down_q is None else c.shared_down_q,
        )
        if c.gated_shared:
            put("ffn_gate_inp_shexp.weight", "sh_inp", rng.standard_normal(d).astype(np.float32) * sc)
    return out, ref


def write_case(rng, path, c: Case, layers=None):
    """Writes every layer in ``layers`` (default: just ``c.layer``); returns {layer: ref}."""
    layers = [c.layer] if layers is None else layers
    kv = {"block_count": c.n_layers, "embedding_length": c.d, "expert_count": c.e, **c.kv}
    tensors, refs = {}, {}
    for li in layers:
        t, r = make_layer(rng, c, li)
        tensors.update(t)
        refs[li] = r
    write_gguf(path, c.arch, kv, tensors)
    return refs


CASES = {
    "qwen35moe-f32-merged": Case(
        "qwen35moe",
        {"expert_used_count": 4, "expert_feed_forward_length": 32, "expert_shared_feed_forward_length": 48},
        dict(k=4, gating="softmax", norm=True, gated_shared=True),
        fs=48,
        gated_shared=True,
        merged=True,
    ),
    "qwen35moe-q8_0-shared-q8_0": Case(
        "qwen35moe",
        {"expert_used_count": 4, "expert_feed_forward_length": 32, "expert_shared_feed_forward_length": 64},
        dict(k=4, gating="softmax", norm=True, gated_shared=True),
        fs=64,
        gated_shared=True,
        qtypes=(QT.Q8_0,) * 3,
        shared_q=QT.Q8_0,
    ),
    "qwen3moe-q8_0": Case(
        "qwen3moe",
        {"expert_used_count": 4, "expert_feed_forward_length": 32},
        dict(k=4, gating="softmax", norm=True),
        qtypes=(QT.Q8_0,) * 3,
    ),
    "qwen3moe-f16-ff-over-k": Case(
        "qwen3moe",
        {"expert_used_count": 2, "feed_forward_length": 64},
        dict(k=2, gating="softmax", norm=True),
        qtypes=(QT.F16,) * 3,
    ),
    "qwen3moe-kquants": Case(
        "qwen3moe",
        {"expert_used_count": 2, "expert_feed_forward_length": 256},
        dict(k=2, gating="softmax", norm=True),
        e=4,
        d=256,
        f=256,
        qtypes=(QT.Q4_K, QT.Q5_K, QT.Q6_K),
    ),
    "qwen2moe-q4_0": Case(
        "qwen2moe",
        {"expert_used_count": 4, "expert_feed_forward_length": 32, "feed_forward_length": 96},
        dict(k=4, gating="softmax", norm=False, gated_shared=True),
        fs=96,
        gated_shared=True,
        qtypes=(QT.Q4_0,) * 3,
        shared_q=QT.Q4_0,
    ),
    "qwen3next-q5_0": Case(
        "qwen3next",
        {"expert_used_count": 4, "expert_feed_forward_length": 32, "expert_shared_feed_forward_length": 32},
        dict(k=4, gating="softmax", norm=True, gated_shared=True),
        fs=32,
        gated_shared=True,
        qtypes=(QT.Q5_0, QT.Q5_1, QT.Q4_1),
    ),
    "qwen3next-no-shared": Case(
        "qwen3next", {"expert_used_count": 4, "expert_feed_forward_length": 32}, dict(k=4, gating="softmax", norm=True)
    ),
    "deepseek2-v3-q4_0": Case(
        "deepseek2",
        {
            "expert_used_count": 4,
            "expert_feed_forward_length": 32,
            "expert_shared_count": 2,
            "expert_group_count": 4,
            "expert_group_used_count": 2,
            "expert_weights_scale": 2.5,
            "expert_weights_norm": True,
            "expert_gating_func": 2,
            "leading_dense_block_count": 1,
            "feed_forward_length": 128,
        },
        dict(k=4, gating="sigmoid", norm=True, scale=2.5, n_group=4, group_used=2),
        fs=64,
        probs_b=True,
        qtypes=(QT.Q4_0,) * 3,
    ),
    "deepseek2-v2-defaults": Case(
        "deepseek2",
        {
            "expert_used_count": 3,
            "expert_feed_forward_length": 32,
            "expert_shared_count": 1,
            "expert_weights_scale": 1.0,
        },
        dict(k=3, gating="softmax", norm=False),
        fs=32,
    ),
    "glm4moe-defaults": Case(
        "glm4moe",
        {
            "expert_used_count": 4,
            "expert_feed_forward_length": 32,
            "expert_shared_count": 1,
            "expert_weights_scale": 1.5,
            "expert_weights_norm": True,
        },
        dict(k=4, gating="sigmoid", norm=True, scale=1.5),
        fs=32,
        probs_b=True,
        merged=True,
    ),
    "bailingmoe2": Case(
        "bailingmoe2",
        {
            "expert_used_count": 4,
            "expert_feed_forward_length": 32,
            "expert_shared_count": 1,
            "expert_shared_feed_forward_length": 64,
            "expert_weights_scale": 2.5,
            "expert_weights_norm": True,
            "expert_gating_func": 2,
            "expert_group_count": 8,
            "expert_group_used_count": 4,
        },
        dict(k=4, gating="sigmoid", norm=True, scale=2.5, n_group=8, group_used=4),
        fs=64,
        probs_b=True,
    ),
    "gpt-oss-mxfp4": Case(
        "gpt-oss",
        {"expert_used_count": 4, "expert_feed_forward_length": 32},
        dict(k=4, gating="softmax_weight", norm=False, oai=True),
        oai=True,
        qtypes=(QT.MXFP4,) * 3,
    ),
    "llama-mixtral-bf16": Case(
        "llama",
        {"expert_used_count": 2, "feed_forward_length": 32},
        dict(k=2, gating="softmax", norm=True),
        e=8,
        qtypes=(QT.BF16,) * 3,
    ),
    "olmoe-f16": Case(
        "olmoe",
        {"expert_used_count": 8, "expert_feed_forward_length": 32},
        dict(k=8, gating="softmax", norm=False),
        qtypes=(QT.F16, QT.F32, QT.F16),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.slow
def test_gguf_layer_matches_llama_cpp_reference(name, rng, tmp_path):
    c = CASES[name]
    path = tmp_path / f"{name}.gguf"
    ref = write_case(rng, path, c)[c.layer]
    block = jaxmoe.from_pretrained(path, layer=c.layer, ex=jaxmoe.ExecConfig())  # float activations
    x = (rng.standard_normal((7, c.d)) * 0.5).astype(np.float32)
    # quantized cases take the decode path (per-token gathered experts), float ones the oracle
    impl = "gather" if any(q in gq.KEPT_QUANTIZED for q in c.qtypes) else "dense"
    y = np.asarray(block(x, impl=impl))
    assert rel_err(y, np_moe(x, ref, **c.ref)) < 2e-5, name
    # The loaded config is the arch's llama.cpp semantics, not the file's guesswork.
    rc = block.cfg.router
    assert rc.top_k == c.ref["k"] and rc.num_experts == c.e
    assert (rc.renorm, rc.renorm_eps) == (("clamp", 2.0**-14) if c.ref["norm"] else ("none", 0.0))
    assert rc.routed_scaling_factor == pytest.approx(c.ref.get("scale", 1.0))
    assert block.cfg.shared_expert_dim == c.fs
    # Q8_0 / Q4_0 / the GGUF block types stay quantized; everything else became floats.
    for wname, qt in zip(("w_gate", "w_up", "w_down"), c.qtypes):
        wt = getattr(block.params().experts, wname)
        assert isinstance(wt, QuantizedTensor) == (qt in gq.KEPT_QUANTIZED), (wname, qt)


@pytest.mark.parametrize(
    "qtype",
    [QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.MXFP4, QT.BF16, QT.F16, QT.Q4_K, QT.Q5_K, QT.Q6_K]
    + [QT.Q2_K, QT.Q3_K, QT.IQ4_NL, QT.IQ4_XS],
)
@pytest.mark.slow
def test_weight_conversion_bit_exact_with_gguf_dequantize(qtype, rng):
    shape = (3, 4, 256)  # [E, out, in]
    data, raw = encode(rng, rng.standard_normal(shape).astype(np.float32), qtype)
    want = gguf.quants.dequantize(np.asarray(data), raw) if raw is not None else np.asarray(data, np.float32)
    w = gq.weight_from_gguf(data, raw if raw is not None else QT.F16, jnp.float32)  # logical [E, in, out]
    got = np.swapaxes(np.asarray(w.dequantize(jnp.float32) if isinstance(w, QuantizedTensor) else w), -1, -2)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want.astype(np.float32))
    if qtype == QT.Q8_0:  # kept quantized, and back to the very same bytes
        assert isinstance(w, QuantizedTensor) and w.kind == "int8"
        np.testing.assert_array_equal(gq.quantized_to_q8_0(w), data)
    if qtype == QT.Q4_0:  # the file's bytes, as they are (18 per 32 weights)
        assert isinstance(w, QuantizedTensor) and w.kind == "q4_0" and w.nbytes == np.asarray(data).nbytes
        np.testing.assert_array_equal(np.asarray(w.qdata), data)


Q4_K_M = Case(  # llama.cpp's Q4_K_M mix: gate/up Q4_K, down Q6_K; fallbacks Q5_0 / Q8_0 per tensor
    "qwen35moe",
    {"expert_used_count": 2, "expert_feed_forward_length": 256, "expert_shared_feed_forward_length": 256},
    dict(k=2, gating="softmax", norm=True, gated_shared=True),
    e=4,
    d=256,
    f=256,
    fs=256,
    gated_shared=True,
    qtypes=(QT.Q4_K, QT.Q4_K, QT.Q6_K),
    shared_q=QT.Q5_0,
    shared_down_q=QT.Q8_0,
)


#: llama.cpp file types as layers: the case and the kinds jaxmoe holds (routed, shared experts).
#: The types gguf-py cannot quantize (Q2_K, Q3_K, IQ4_NL, IQ4_XS, `IQ_TYPES`) are random valid blocks.
MIXES = {
    "q4_k_m": (Q4_K_M, ["q4_k", "q4_k", "q6_k"], ["q5_0", "q5_0", "int8"]),
    "q3_k_m": (
        dataclasses.replace(Q4_K_M, qtypes=(QT.Q3_K, QT.Q3_K, QT.Q4_K), shared_q=QT.Q5_0, shared_down_q=QT.Q6_K),
        ["q3_k", "q3_k", "q4_k"],
        ["q5_0", "q5_0", "q6_k"],
    ),
    "q2_k": (
        dataclasses.replace(Q4_K_M, qtypes=(QT.Q2_K, QT.Q2_K, QT.Q3_K), shared_q=QT.Q2_K, shared_down_q=QT.Q4_K),
        ["q2_k", "q2_k", "q3_k"],
        ["q2_k", "q2_k", "q4_k"],
    ),
    "iq4_xs": (
        dataclasses.replace(Q4_K_M, qtypes=(QT.IQ4_XS, QT.IQ4_XS, QT.IQ4_NL), shared_q=QT.IQ4_NL, shared_down_q=None),
        ["iq4_xs", "iq4_xs", "iq4_nl"],
        ["iq4_nl", "iq4_nl", "iq4_nl"],
    ),
    "mxfp4_moe": (
        dataclasses.replace(Q4_K_M, qtypes=(QT.MXFP4,) * 3, shared_q=QT.Q8_0, shared_down_q=QT.MXFP4),
        ["mxfp4", "mxfp4", "mxfp4"],
        ["int8", "int8", "mxfp4"],
    ),
    "iq2_xxs": (  # the IQ2 / IQ3 kinds, routed and shared
        dataclasses.replace(
            Q4_K_M, qtypes=(QT.IQ2_XXS, QT.IQ2_XS, QT.IQ3_XXS), shared_q=QT.IQ2_S, shared_down_q=QT.IQ3_S
        ),
        ["iq2_xxs", "iq2_xs", "iq3_xxs"],
        ["iq2_s", "iq2_s", "iq3_s"],
    ),
    "iq1_s": (  # the IQ1 and ternary kinds
        dataclasses.replace(Q4_K_M, qtypes=(QT.IQ1_S, QT.IQ1_M, QT.TQ1_0), shared_q=QT.TQ2_0, shared_down_q=QT.IQ1_M),
        ["iq1_s", "iq1_m", "tq1_0"],
        ["tq2_0", "tq2_0", "iq1_m"],
    ),
}


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.slow
def test_quantized_layer_stays_quantized(mix, rng, tmp_path):
    """A layer of each llama.cpp file type written by gguf's writer loads with no float copy of
    its experts: QuantizedTensor leaves of the file's types, resident bytes = the file's bytes
    for the layer; the reference impls match a float64 forward of gguf-py's dequantized
    weights; the offload store hands out the same blocks; ``save_gguf(dtype="keep")`` writes
    every tensor back byte for byte."""
    c, routed_kinds, shared_kinds = MIXES[mix]
    path = tmp_path / f"{mix}.gguf"
    ref = write_case(rng, path, c)[c.layer]
    file_tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    layer_bytes = sum(int(t.n_bytes) for n, t in file_tensors.items() if n.startswith(f"blk.{c.layer}."))
    for loaded in (jaxmoe.from_pretrained(path, layer=c.layer).params(), jio.load_layer(path, layer=c.layer)[1]):
        ew, sh = loaded.experts, loaded.shared
        kinds = [w.kind if isinstance(w, QuantizedTensor) else None for w in (ew.w_gate, ew.w_up, ew.w_down)]
        assert kinds == routed_kinds
        assert [getattr(w, "kind", None) for w in (sh.w_gate, sh.w_up, sh.w_down)] == shared_kinds
        resident = sum(int(a.nbytes) for a in jax.tree.leaves(loaded))
        assert resident == layer_bytes  # no float copy anywhere (router / gate vector are F32 in the file too)
        # `jaxmoe inspect` says so before loading: its held bytes of the layer's tensors
        assert sum(r.held or 0 for r in inspect_gguf(path).tensors if r.layer == c.layer) == resident
        assert ew.w_gate.nbytes == int(file_tensors[f"blk.{c.layer}.ffn_gate_exps.weight"].n_bytes)
    block = jaxmoe.from_pretrained(path, layer=c.layer, ex=jaxmoe.ExecConfig())  # float activations
    for t in (1, 9):
        x = (rng.standard_normal((t, c.d)) * 0.5).astype(np.float32)
        want = np_moe(x, ref, **c.ref)
        for impl in ("xla", "gather", "dense", "auto"):
            assert rel_err(np.asarray(block(x, impl=impl)), want) < 2e-5, (impl, t)
    store = GGUFStore(path)  # store layer 0 = blk.1, the first block with a router
    one = store.load_expert(0, 3)
    assert one.w_down.kind == routed_kinds[2] and isinstance(one.w_down.qdata, np.ndarray)
    np.testing.assert_array_equal(one.w_down.qdata, np.asarray(block.params().experts.w_down.qdata)[3])
    np.testing.assert_array_equal(dense_np(one.w_gate), ref["gate"][3].T.astype(np.float32))
    out = jaxmoe.save_gguf(block, tmp_path / "again.gguf", layer=c.layer, dtype="keep")
    again = {t.name: t for t in gguf.GGUFReader(out).tensors}
    assert set(again) == set(file_tensors)
    for n, t in file_tensors.items():
        assert again[n].tensor_type == t.tensor_type, n
        np.testing.assert_array_equal(np.asarray(again[n].data), np.asarray(t.data), err_msg=n)


def test_block_types_bad_buffers_are_named(rng):
    raw = kquant_bytes(rng, (2, 4, 256), QT.Q4_K)
    with pytest.raises(ValueError, match=r"blk\.3\.ffn_up_exps\.weight \(Q4_K.*\(2, 4, 143\).*truncated"):
        gq.matrix_from_gguf(raw[..., :-1], QT.Q4_K, name="blk.3.ffn_up_exps.weight")
    with pytest.raises(ValueError, match=r"w \(Q6_K\).*\(2, 4, 144\).*width 256"):
        gq.block_tensor_from_gguf(raw, QT.Q6_K, name="w", n_in=256)
    mx = gguf_block_bytes(rng, QT.MXFP4, (2, 4, 64))  # 17-byte blocks: rows of 34 bytes
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_down_exps\.weight \(MXFP4.*\(2, 4, 33\).*truncated"):
        gq.matrix_from_gguf(mx[..., :-1], QT.MXFP4, name="blk.0.ffn_down_exps.weight")
    xs = gguf_block_bytes(rng, QT.IQ4_XS, (2, 4, 256))
    with pytest.raises(ValueError, match=r"w \(IQ4_NL\).*\(2, 4, 136\).*width 256.*144 bytes"):
        gq.block_tensor_from_gguf(xs, QT.IQ4_NL, name="w", n_in=256)
    with pytest.raises(ValueError, match=r"w \(Q5_1\): block data must be uint8 bytes, got float32"):
        gq.block_tensor_from_gguf(np.zeros((2, 24), np.float32), QT.Q5_1, name="w")
    # gguf-py cannot quantize to a K-quant: a float weight asked as q4_k is a named error
    with pytest.raises(ValueError, match=r"tensor blk\.0\.x .*cannot be quantized to Q4_K by gguf-py"):
        gq.weight_to_gguf(np.zeros((256, 4), np.float32), QT.Q4_K, "blk.0.x")


def test_q4_0_nibble_order(rng):
    """Q4_0 byte i holds element i (low) and i + 16 (high); jaxmoe packs 2j low, 2j+1 high."""
    w = rng.standard_normal((2, 32)).astype(np.float32)
    raw = gguf.quants.quantize(w, QT.Q4_0)
    qt = gq.q4_0_to_quantized(raw)
    codes = np.asarray(qt.codes())  # [out, in] 0..15
    byte = raw[:, 2:]
    np.testing.assert_array_equal(codes[:, :16], byte & 0xF)
    np.testing.assert_array_equal(codes[:, 16:], byte >> 4)
    np.testing.assert_array_equal(np.asarray(qt.qdata)[:, 0], (codes[:, 0] | (codes[:, 1] << 4)).astype(np.uint8))


def test_q4_0_extreme_scales_are_exact(rng):
    """|d| > 8188: the loader and the store keep the block bytes (kind q4_0), bit-exact with
    gguf-py; as an int4 tensor (q4_0_to_quantized) the bias -8 d overflows float16, so scales
    and biases are float32 there, still bit-exact and back to the same bytes. Normal scales
    stay float16."""
    w = rng.standard_normal((3, 4, 64)).astype(np.float32)
    w[0, 1, 5] = -1.2e5  # its block gets d = 15000 > 65504 / 8
    w[2, 3, 40] = 9e4  # d = -11250
    raw = gguf.quants.quantize(w, QT.Q4_0)
    want = gguf.quants.dequantize(raw, QT.Q4_0)
    d = np.ascontiguousarray(raw.reshape(3, 4, 2, 18)[..., :2]).view(np.float16)[..., 0].astype(np.float32)
    assert np.abs(d).max() > gq.F16_MAX_D_Q4 and np.isfinite(want).all()
    host = gq.matrix_from_gguf(raw, QT.Q4_0)  # the store's path: numpy leaves
    dev = gq.weight_from_gguf(raw, QT.Q4_0, jnp.float32)  # the loader's path: jax leaves
    assert isinstance(host.qdata, np.ndarray) and isinstance(dev.qdata, jax.Array)
    for qt in (host, dev):
        assert qt.kind == "q4_0" and qt.scales is None
        np.testing.assert_array_equal(np.asarray(qt.qdata), raw)
        got = np.swapaxes(np.asarray(qt.dequantize(jnp.float32)), -1, -2)
        np.testing.assert_array_equal(got, want)
    i4 = gq.q4_0_to_quantized(raw)
    for qt in (i4, jax.tree.map(jnp.asarray, i4)):
        assert qt.scales.dtype == np.float32 and qt.biases.dtype == np.float32
        assert np.isfinite(np.asarray(qt.biases)).all()
        got = np.swapaxes(np.asarray(qt.dequantize(jnp.float32)), -1, -2)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(gq.quantized_to_q4_0(qt), raw)
    small = gq.q4_0_to_quantized(gguf.quants.quantize(rng.standard_normal((2, 32)).astype(np.float32), QT.Q4_0))
    assert small.scales.dtype == np.float16 and small.biases.dtype == np.float16


def test_only_the_requested_layer_is_read(rng, tmp_path):
    """Loading layer 2 touches only blk.2.* and survives garbage in every other layer's bytes."""
    c = CASES["qwen3moe-q8_0"]
    c = dataclasses.replace(c, n_layers=5, layer=2)
    path = tmp_path / "multi.gguf"
    refs = write_case(rng, path, c, layers=[0, 1, 2, 3, 4])
    reader = gguf.GGUFReader(path)
    spans = [(t.data_offset, t.n_bytes) for t in reader.tensors if not t.name.startswith("blk.2.")]
    del reader
    with open(path, "r+b") as fh:  # overwrite the other layers with bytes that decode to NaN / garbage
        for off, n in spans:
            fh.seek(off)
            fh.write(b"\xff" * n)
    seen = []
    r = jgguf.open_reader(path)
    cfg = jgguf.config_from_reader(r, path)
    params = jgguf.load_layer_params(r, cfg, 2, path=path, on_read=seen.append)
    assert seen and all(s.startswith("blk.2.") for s in seen), seen
    block = jaxmoe.MoEBlock(cfg, params=params)
    x = rng.standard_normal((5, c.d)).astype(np.float32)
    y = np.asarray(block(x, impl="dense"))
    assert np.isfinite(y).all()
    assert rel_err(y, np_moe(x, refs[2], **c.ref)) < 2e-5
    first = jgguf.open_reader(path).tensors[0]  # the corruption is real: layer 0's router is all NaN now
    assert first.name == "blk.0.ffn_gate_inp.weight" and np.isnan(np.asarray(first.data)).all()


def test_load_config_accepts_a_gguf_path(rng, tmp_path):
    c = CASES["deepseek2-v3-q4_0"]
    path = tmp_path / "ds.gguf"
    write_case(rng, path, c)
    cfg = jaxmoe.load_config(str(path))
    r = cfg.router
    assert (cfg.d_model, cfg.expert_dim, cfg.num_layers, r.num_experts, r.top_k) == (64, 32, 3, 16, 4)
    assert (r.score_fn, r.n_group, r.topk_group, r.group_score) == ("sigmoid", 4, 2, "top2_sum")
    assert r.use_selection_bias and r.routed_scaling_factor == 2.5
    assert (cfg.shared_expert_dim, cfg.num_shared_experts, cfg.shared_expert_gate) == (64, 2, False)
    assert cfg.dense_layers == (0,) and cfg.dense_dim == 128 and cfg.family == "deepseek_v3"
    # the bailingmoe2 shared width is its own key times the count
    assert jgguf.load_config(_written(rng, tmp_path, "bailingmoe2")).shared_expert_dim == 64


def test_load_layer_returns_config_and_params(rng, tmp_path):
    """The format module, the path dispatch and from_pretrained give the same layer."""
    c = CASES["qwen3moe-q8_0"]
    path = tmp_path / "l.gguf"
    write_case(rng, path, c)
    cfg, params = jgguf.load_layer(path, layer=c.layer)
    assert isinstance(cfg, MoEConfig) and isinstance(params, MoEParams)
    assert jio.checkpoint_format(path) == "gguf"
    cfg2, params2 = jio.load_layer(path, layer=c.layer)
    block = jaxmoe.from_pretrained(path, layer=c.layer)
    assert cfg2 == cfg and block.cfg == cfg
    assert_same_params(params, params2, block.params())
    assert jio.load_config(path) == cfg and jaxmoe.load_config(path) == cfg
    # anything that is not a checkpoint is a preset name or a model YAML
    assert jio.load_config("qwen3-30b-a3b") == load_preset_config("qwen3-30b-a3b")
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        jio.load_config(tmp_path / "missing.gguf")
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        jio.load_layer(tmp_path / "missing.gguf")


def _written(rng, tmp_path, name):
    path = tmp_path / f"{name}.gguf"
    write_case(rng, path, CASES[name])
    return path


# ----------------------------------------------------------------------------- export


def small_block(preset: str, seed: int = 0, **router_kw) -> jaxmoe.MoEBlock:
    """A shrunk preset layer with fresh random numpy weights (no jax random init to compile)."""
    cfg = jaxmoe.load_config(preset)
    fs = 32 * cfg.num_shared_experts if cfg.shared_expert_dim else 0
    d, e, f = 64, 16, 32
    cfg = dataclasses.replace(
        cfg,
        d_model=d,
        expert_dim=f,
        shared_expert_dim=fs,
        router=dataclasses.replace(cfg.router, num_experts=e, top_k=min(cfg.top_k, 4), **router_kw),
    )
    rng = np.random.default_rng(seed)

    def n(*shape, fan=1.0):
        return jnp.asarray((rng.standard_normal(shape) / np.sqrt(fan)).astype(np.float32))

    ew = jaxmoe.ExpertWeights(n(e, d, f, fan=d), n(e, d, f, fan=d), n(e, f, d, fan=f))
    if cfg.expert_bias:
        ew = dataclasses.replace(ew, b_gate=n(e, f, fan=4), b_up=n(e, f, fan=4), b_down=n(e, d, fan=4))
    shared = None
    if fs:
        shared = jaxmoe.SharedWeights(
            n(d, fs, fan=d), n(d, fs, fan=d), n(fs, d, fan=fs), n(d, fan=d) if cfg.shared_expert_gate else None
        )
    params = jaxmoe.MoEParams(
        n(d, e, fan=d),
        ew,
        n(e) if cfg.router.router_bias else None,
        n(e, fan=100) if cfg.router.use_selection_bias else None,
        shared,
    )
    return jaxmoe.MoEBlock(cfg, params=params)


def dense_np(w) -> np.ndarray:
    """A weight [.., in, out] as float32 numpy; a QuantizedTensor dequantized here in numpy from
    its documented layout (codes * scale + bias per group along ``in``)."""
    if not isinstance(w, QuantizedTensor):
        return np.asarray(w, np.float32)
    if w.kind in GGUF_BLOCKS:  # raw GGUF block bytes: gguf-py decodes them
        return np.swapaxes(gguf.quants.dequantize(np.asarray(w.qdata), QT[w.kind.upper()]), -1, -2)
    q = np.asarray(w.qdata)
    if w.kind == "int4":
        q = np.stack([q & 0xF, q >> 4], axis=-1).reshape(*q.shape[:-1], -1)
    scale = np.repeat(np.asarray(w.scales, np.float32), w.group_size, axis=-1)
    bias = 0.0 if w.biases is None else np.repeat(np.asarray(w.biases, np.float32), w.group_size, axis=-1)
    return np.swapaxes(q.astype(np.float32) * scale + bias, -1, -2)


def expected_after(w, qtype) -> np.ndarray:
    """What a float weight [.., in, out] becomes after a trip through ``qtype`` (gguf-py)."""
    t = np.ascontiguousarray(np.swapaxes(dense_np(w), -1, -2))
    data, raw = (
        (t, None)
        if qtype == QT.F32
        else (t.astype(np.float16), None)
        if qtype == QT.F16
        else (gguf.quants.quantize(t, qtype), qtype)
    )
    return np.swapaxes(deq(data, raw).astype(np.float32).reshape(t.shape), -1, -2)


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "q8_0", "q4_0"])
def test_export_round_trip(dtype, rng, tmp_path):
    block = small_block("qwen3.6-35b-a3b")
    path = jaxmoe.save_gguf(block, tmp_path / f"rt_{dtype}.gguf", layer=5, dtype=dtype)
    # gguf-py reads it back with llama.cpp names, keys and the requested type.
    rd = gguf.GGUFReader(path)
    names = {t.name: t for t in rd.tensors}
    qt = gq.EXPORT_TYPES[dtype]
    assert names["blk.5.ffn_gate_exps.weight"].tensor_type == qt
    assert tuple(reversed(names["blk.5.ffn_down_exps.weight"].shape.tolist())) == (16, 64, 32)
    assert names["blk.5.ffn_gate_inp.weight"].tensor_type == QT.F32
    assert rd.fields["general.architecture"].contents() == "qwen35moe"
    assert rd.fields["qwen35moe.expert_count"].contents() == 16
    assert rd.fields["qwen35moe.expert_shared_feed_forward_length"].contents() == 32
    loaded = jaxmoe.from_pretrained(path, layer=5)
    p0, p1 = block.params(), loaded.params()
    for part in ("w_gate", "w_up", "w_down"):
        np.testing.assert_array_equal(
            dense_np(getattr(p1.experts, part)), expected_after(getattr(p0.experts, part), qt)
        )
    for part in ("w_gate", "w_up", "w_down"):
        np.testing.assert_array_equal(dense_np(getattr(p1.shared, part)), expected_after(getattr(p0.shared, part), qt))
    np.testing.assert_array_equal(np.asarray(p1.w_router), np.asarray(p0.w_router))
    np.testing.assert_array_equal(np.asarray(p1.shared.gate), np.asarray(p0.shared.gate))
    assert isinstance(p1.experts.w_gate, QuantizedTensor) == (dtype in ("q8_0", "q4_0"))
    c0, c1 = block.cfg, loaded.cfg
    assert dataclasses.replace(c1, router=dataclasses.replace(c1.router, renorm="sum", renorm_eps=0.0)) == c0
    x = rng.standard_normal((6, 64)).astype(np.float32)
    if dtype == "f32":
        np.testing.assert_allclose(
            np.asarray(loaded(x, impl="dense")), np.asarray(block(x, impl="dense")), rtol=1e-6, atol=1e-6
        )
    if dtype in ("q8_0", "q4_0"):  # re-exporting quantized experts writes the very same bytes
        path2 = jaxmoe.save_gguf(loaded, tmp_path / f"rt2_{dtype}.gguf", layer=5, dtype=dtype)
        rd2 = {t.name: t for t in gguf.GGUFReader(path2).tensors}
        for n, t in names.items():
            np.testing.assert_array_equal(np.asarray(rd2[n].data), np.asarray(t.data), err_msg=n)


@pytest.mark.parametrize(
    "preset,arch",
    [
        ("deepseek-v3", "deepseek2"),
        ("gpt-oss-20b", "gpt-oss"),
        ("mixtral-8x7b", "llama"),
        ("qwen2-57b-a14b", "qwen2moe"),
        ("edge0-8b", "bailingmoe2"),
    ],
)
def test_export_other_archs(preset, arch, rng, tmp_path):
    kw = {"n_group": 4, "topk_group": 2} if preset in ("deepseek-v3", "edge0-8b") else {}
    block = small_block(preset, seed=3, **kw)
    layer = block.cfg.num_layers - 1
    path = jaxmoe.save_gguf(block, tmp_path / "x.gguf", layer=layer, dtype="f32")
    assert gguf.GGUFReader(path).fields["general.architecture"].contents() == arch
    loaded = jaxmoe.from_pretrained(path, layer=layer)
    p0, p1 = block.params(), loaded.params()
    flat0, flat1 = jax.tree_util.tree_leaves_with_path(p0), jax.tree_util.tree_leaves_with_path(p1)
    assert [k for k, _ in flat0] == [k for k, _ in flat1]
    for (k, a), (_, b) in zip(flat0, flat1):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=jax.tree_util.keystr(k))
    if arch in ("deepseek2", "gpt-oss"):  # the whole layer, including its routing rule
        x = rng.standard_normal((9, 64)).astype(np.float32)
        np.testing.assert_allclose(
            np.asarray(loaded(x, impl="dense")), np.asarray(block(x, impl="dense")), rtol=1e-5, atol=1e-6
        )
    c0, c1 = block.cfg, loaded.cfg
    r0, r1 = c0.router, c1.router
    assert (
        r1.score_fn,
        r1.top_k,
        r1.n_group,
        r1.topk_group,
        r1.routed_scaling_factor,
        r1.use_selection_bias,
        r1.router_bias,
    ) == (
        r0.score_fn,
        r0.top_k,
        r0.n_group,
        r0.topk_group,
        r0.routed_scaling_factor,
        r0.use_selection_bias,
        r0.router_bias,
    )
    assert (c1.shared_expert_dim, c1.num_shared_experts, c1.dense_layers, c1.activation) == (
        c0.shared_expert_dim,
        c0.num_shared_experts,
        c0.dense_layers,
        c0.activation,
    )


@pytest.mark.parametrize("dtype", ["q8_0", "q4_0", "f16"])
def test_export_of_other_quantized_experts(dtype, tmp_path):
    """MLX-style int4 group-64 experts cannot be written as they are: they are dequantized
    (exactly) and quantized once by gguf-py."""
    block = small_block("qwen3-30b-a3b", seed=5)
    p = block.params()
    ew = jaxmoe.ExpertWeights(
        *(quantize_int4_affine(np.asarray(w), group_size=64) for w in (p.experts.w_gate, p.experts.w_up)),
        p.experts.w_down,
    )
    qblock = jaxmoe.MoEBlock(block.cfg, params=dataclasses.replace(p, experts=ew))
    path = jaxmoe.save_gguf(qblock, tmp_path / "mlx.gguf", layer=2, dtype=dtype)
    loaded = jaxmoe.from_pretrained(path, layer=2).params()
    qt = gq.EXPORT_TYPES[dtype]
    for part in ("w_gate", "w_up", "w_down"):
        src = getattr(ew, part)
        np.testing.assert_array_equal(dense_np(src), np.asarray(materialize_f32(src)))  # numpy == jax dequant
        np.testing.assert_array_equal(dense_np(getattr(loaded.experts, part)), expected_after(src, qt))


def materialize_f32(w):
    return w.dequantize(jnp.float32) if isinstance(w, QuantizedTensor) else w


def test_compute_dtype_bfloat16(rng, tmp_path):
    c = CASES["qwen3moe-f16-ff-over-k"]
    path = tmp_path / "bf.gguf"
    ref = write_case(rng, path, c)[c.layer]
    block = jaxmoe.from_pretrained(path, layer=c.layer, dtype=jnp.bfloat16)
    assert block.params().experts.w_gate.dtype == jnp.bfloat16
    assert block.params().w_router.dtype == jnp.float32  # routing stays float32
    x = (rng.standard_normal((7, c.d)) * 0.5).astype(np.float32)
    y = np.asarray(block(x, impl="dense"), np.float32)
    assert rel_err(y, np_moe(x, ref, **c.ref)) < 3e-2


def test_export_rejects_what_the_arch_cannot_express(tmp_path):
    block = small_block("qwen2-57b-a14b", renorm="sum")  # llama.cpp never renormalizes qwen2moe
    with pytest.raises(ValueError, match="router.renorm"):
        jaxmoe.save_gguf(block, tmp_path / "a.gguf", dtype="f32")
    with pytest.raises(ValueError, match="dtype"):
        jaxmoe.save_gguf(small_block("qwen3-30b-a3b"), tmp_path / "b.gguf", dtype="q3_x")
    with pytest.raises(ValueError, match="ffn_gate_exps.weight has input dim 64, not a multiple of the Q5_K block"):
        jaxmoe.save_gguf(small_block("qwen3-30b-a3b"), tmp_path / "b.gguf", dtype="q5_k")
    with pytest.raises(ValueError, match="dense layer"):
        jaxmoe.save_gguf(small_block("deepseek-v3"), tmp_path / "c.gguf", layer=0, dtype="f32")
    assert not (tmp_path / "a.gguf").exists()


def test_save_gguf_takes_cfg_and_params(tmp_path):
    """io.save_gguf needs no MoEBlock: (cfg, params) writes the same bytes as the block."""
    block = small_block("qwen3-30b-a3b")
    a = jaxmoe.save_gguf(block, tmp_path / "a.gguf", layer=1, dtype="q8_0")
    b = jio.save_gguf((block.cfg, block.params()), tmp_path / "b.gguf", layer=1, dtype="q8_0")
    c = jgguf.save_gguf((block.cfg, block.params()), tmp_path / "c.gguf", layer=1, dtype="q8_0")
    assert a.read_bytes() == b.read_bytes() == c.read_bytes()
    with pytest.raises(ValueError, match="MoEParams, got ExpertWeights"):
        jio.save_gguf((block.cfg, block.params().experts), tmp_path / "d.gguf")
    with pytest.raises(ValueError, match="got object"):
        jio.save_gguf(object(), tmp_path / "e.gguf")
    with pytest.raises(ValueError, match="w_router has shape"):
        jio.save_gguf((dataclasses.replace(block.cfg, d_model=32), block.params()), tmp_path / "f.gguf")
    assert not any((tmp_path / f"{n}.gguf").exists() for n in "def")


# ----------------------------------------------------------------------------- bad input


@pytest.fixture
def good_file(rng, tmp_path):
    path = tmp_path / "good.gguf"
    write_case(rng, path, CASES["qwen3moe-q8_0"])
    return path


def test_truncated_file(good_file, tmp_path):
    raw = good_file.read_bytes()
    for cut in (len(raw) - 100, len(raw) // 2, 40):
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(raw[:cut])
        with pytest.raises(CheckpointError, match="truncated"):
            jaxmoe.from_pretrained(p, layer=1)


def test_wrong_magic(good_file, tmp_path):
    p = tmp_path / "bad.gguf"
    p.write_bytes(b"GGML" + good_file.read_bytes()[4:])
    with pytest.raises(ValueError, match="magic"):
        jaxmoe.from_pretrained(p, layer=1)


def test_missing_tensor(rng, tmp_path):
    c = CASES["qwen3moe-q8_0"]
    tensors, _ = make_layer(rng, c, 1)
    del tensors["blk.1.ffn_up_exps.weight"]
    p = tmp_path / "m.gguf"
    write_gguf(p, "qwen3moe", {"block_count": 3, "embedding_length": 64, "expert_count": 16, **c.kv}, tensors)
    with pytest.raises(CheckpointError, match=r"blk\.1\.ffn_up_exps\.weight is missing"):
        jaxmoe.from_pretrained(p, layer=1)


def test_expert_count_disagrees_with_stored_experts(rng, tmp_path):
    c = CASES["qwen3moe-q8_0"]
    tensors, _ = make_layer(rng, c, 1)  # 16 experts stored
    p = tmp_path / "n.gguf"
    write_gguf(p, "qwen3moe", {"block_count": 3, "embedding_length": 64, **c.kv, "expert_count": 32}, tensors)
    with pytest.raises(CheckpointError, match=r"ffn_gate_inp\.weight has shape \(16, 64\).*\(32, 64\)"):
        jaxmoe.from_pretrained(p, layer=1)


def test_expert_count_not_divisible_by_groups(rng, tmp_path):
    c = CASES["deepseek2-v3-q4_0"]
    p = tmp_path / "g.gguf"
    write_case(rng, p, dataclasses.replace(c, kv={**c.kv, "expert_group_count": 3}))
    with pytest.raises(CheckpointError, match=r"expert_count=16 is not divisible by .*expert_group_count=3"):
        jaxmoe.from_pretrained(p, layer=1)


def test_unknown_arch(rng, tmp_path):
    tensors, _ = make_layer(rng, CASES["qwen3moe-q8_0"], 0)
    p = tmp_path / "u.gguf"
    write_gguf(p, "mamba", {"block_count": 1, "embedding_length": 64, "expert_count": 16}, tensors)
    with pytest.raises(CheckpointError, match="unsupported GGUF architecture 'mamba'"):
        jaxmoe.load_config(str(p))


def test_layer_out_of_range(good_file):
    for bad in (3, -1, 99):
        with pytest.raises(CheckpointError, match=rf"layer {bad} is outside \[0, block_count=3\)"):
            jaxmoe.from_pretrained(good_file, layer=bad)


def test_dense_layer_asked_as_moe(rng, tmp_path):
    p = _written(rng, tmp_path, "deepseek2-v3-q4_0")  # leading_dense_block_count = 1
    with pytest.raises(CheckpointError, match="layer 0 is a dense layer"):
        jaxmoe.from_pretrained(p, layer=0)


def test_unsupported_tensor_type(rng, tmp_path):
    c = CASES["qwen3moe-q8_0"]
    tensors, _ = make_layer(rng, c, 1)
    block, size = GGML_QUANT_SIZES[QT.Q8_1]
    tensors["blk.1.ffn_down_exps.weight"] = (
        rng.integers(0, 255, (16, 64, 32 // block * size), dtype=np.uint8),
        QT.Q8_1,
    )
    p = tmp_path / "t.gguf"
    write_gguf(p, "qwen3moe", {"block_count": 3, "embedding_length": 64, "expert_count": 16, **c.kv}, tensors)
    with pytest.raises(CheckpointError, match=r"blk\.1\.ffn_down_exps\.weight has type Q8_1"):
        jaxmoe.from_pretrained(p, layer=1)


def test_required_gating_key_and_non_moe_file(rng, tmp_path):
    c = CASES["bailingmoe2"]
    kv = {k: v for k, v in c.kv.items() if k != "expert_gating_func"}
    p = tmp_path / "b.gguf"
    write_case(rng, p, dataclasses.replace(c, kv=kv))
    with pytest.raises(CheckpointError, match="bailingmoe2.expert_gating_func is missing"):
        jaxmoe.load_config(str(p))
    q = tmp_path / "dense.gguf"
    write_gguf(
        q,
        "llama",
        {"block_count": 2, "embedding_length": 64, "feed_forward_length": 128},
        {"blk.0.ffn_up.weight": (rng.standard_normal((128, 64)).astype(np.float32), None)},
    )
    with pytest.raises(CheckpointError, match="not an MoE model"):
        jaxmoe.load_config(str(q))


@pytest.mark.parametrize(
    "preset,arch,kv,names",
    [
        # the metadata of the packaged Qwen3.6-35B-A3B GGUF (as read by the Treebeard seed)
        (
            "qwen3.6-35b-a3b",
            "qwen35moe",
            {
                "block_count": 40,
                "embedding_length": 2048,
                "expert_count": 256,
                "expert_used_count": 8,
                "expert_feed_forward_length": 512,
                "expert_shared_feed_forward_length": 512,
            },
            ["blk.0.ffn_up_shexp.weight"],
        ),
        # DeepSeek-V3 as convert_hf_to_gguf writes it
        (
            "deepseek-v3",
            "deepseek2",
            {
                "block_count": 61,
                "embedding_length": 7168,
                "expert_count": 256,
                "expert_used_count": 8,
                "expert_feed_forward_length": 2048,
                "expert_shared_count": 1,
                "expert_group_count": 8,
                "expert_group_used_count": 4,
                "expert_weights_scale": 2.5,
                "expert_weights_norm": True,
                "expert_gating_func": 2,
                "leading_dense_block_count": 3,
                "feed_forward_length": 18432,
            },
            ["blk.3.exp_probs_b.bias"],
        ),
        (
            "gpt-oss-20b",
            "gpt-oss",
            {
                "block_count": 24,
                "embedding_length": 2880,
                "expert_count": 32,
                "expert_used_count": 4,
                "expert_feed_forward_length": 2880,
            },
            [],
        ),
    ],
)
def test_full_size_metadata_gives_the_preset(preset, arch, kv, names, tmp_path):
    """Only metadata and tensor names are read: a full-size header with tiny tensors suffices."""
    p = tmp_path / "meta.gguf"
    write_gguf(p, arch, {"general.name": preset, **kv}, {n: (np.arange(4, dtype=np.float32) + 1, None) for n in names})
    got, want = jaxmoe.load_config(str(p)), jaxmoe.load_config(preset)
    assert (got.router.renorm, got.router.renorm_eps) == (
        ("clamp", 2.0**-14) if want.router.renorm != "none" else ("none", 0.0)
    )
    got = dataclasses.replace(
        got, router=dataclasses.replace(got.router, renorm=want.router.renorm, renorm_eps=want.router.renorm_eps)
    )
    assert got == want


@pytest.mark.parametrize(
    "name", ["qwen35moe-q8_0-shared-q8_0", pytest.param("qwen3moe-kquants", marks=pytest.mark.slow)]
)
def test_quantized_gguf_runs_in_ggml_arithmetic_by_default(name, rng, tmp_path):
    """from_pretrained of a GGUF with quantized experts on the CPU runs llama.cpp's
    arithmetic unless told otherwise; float activations are one option away; float GGUF
    experts and an explicit impl keep float activations."""
    from jaxmoe.evaluation.reference import reference_forward

    c = CASES[name]
    path = tmp_path / "q.gguf"
    write_case(rng, path, c)
    block = jaxmoe.from_pretrained(path, layer=c.layer)
    assert block.ex.activations == "ggml"
    x = (rng.standard_normal((5, c.d)) * 0.5).astype(np.float32)
    p = block.params()
    y = np.asarray(block(x))
    want_ggml = reference_forward(p, x, block.cfg, activations="ggml")[0]
    want_float = reference_forward(p, x, block.cfg)[0]
    assert rel_err(y, want_ggml) < 1e-4
    assert rel_err(y, want_float) > 10 * rel_err(y, want_ggml)
    assert jaxmoe.from_pretrained(path, layer=c.layer, ex=jaxmoe.ExecConfig()).ex.activations == "float"
    assert jaxmoe.from_pretrained(path, layer=c.layer, impl="xla").ex.activations == "float"
    f32 = tmp_path / "f.gguf"
    write_case(rng, f32, CASES["qwen35moe-f32-merged"])
    assert jaxmoe.from_pretrained(f32, layer=CASES["qwen35moe-f32-merged"].layer).ex.activations == "float"

"""Quantized Hugging Face safetensors checkpoints kept in their bytes (issue 47): gpt-oss
MXFP4 ``*_blocks`` / ``*_scales`` as GGUF ``mxfp4`` blocks, block-scaled FP8 E4M3
(``weight`` + ``weight_scale_inv``, DeepSeek-V3 / Qwen3 FP8) as ``fp8_e4m3``.

Checkpoints are written here with ``safetensors`` (a config from transformers' own config
class, random tensors under the Hub names). References are independent of jaxmoe's decoders:
gpt-oss's layout decoded in numpy float64 (``ldexp`` of the E2M1 table), ``gguf.quants`` for
the re-packed GGUF blocks, ``ml_dtypes`` float8 for FP8, and a float64 loop over the pairs.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import transformers as T
from test_impls import unfused_instructions

import jaxmoe
from jaxmoe import io as jio
from jaxmoe.execution import ExecConfig
from jaxmoe.experts import ExpertWeights
from jaxmoe.io.hf import mxfp4_to_gguf_blocks
from jaxmoe.io.inspect import inspect_path
from jaxmoe.quant import QuantizedTensor, dequantize_fp8_blocks, fp8_block_tensor, gguf_block_tensor, materialize

F8 = ml_dtypes.float8_e4m3fn
#: E2M1 values of the 16 MXFP4 codes (the OCP MX table), float64.
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)


def hf_mxfp4_f64(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """gpt-oss MXFP4 ``(..., G, 16)`` / ``(..., G)`` -> float64 ``(..., G * 32)``: byte ``j`` of a
    block holds element ``2j`` (low nibble) and ``2j + 1`` (high), times ``2^(s - 127)``
    (transformers' ``convert_moe_packed_tensors``)."""
    v = np.stack([E2M1[blocks & 0xF], E2M1[blocks >> 4]], axis=-1).reshape(*blocks.shape[:-1], 32)
    v = np.ldexp(v, scales.astype(np.int64)[..., None] - 127)
    return v.reshape(*scales.shape[:-1], scales.shape[-1] * 32)


def fp8_f64(codes: np.ndarray, scales: np.ndarray, b: int) -> np.ndarray:
    """Block-scaled FP8 ``(..., out, in)`` as float64: each code (``ml_dtypes``) times the scale of its block."""
    out, n = codes.shape[-2:]
    s = np.asarray(scales).astype(np.float64)
    s = np.repeat(np.repeat(s, b, -2), b, -1)[..., :out, :n]
    return codes.astype(np.float64) * s


def _write(path: Path, config: dict, tensors: dict) -> Path:
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    for f in path.glob("*.safetensors"):
        f.unlink()
    safetensors.numpy.save_file(tensors, str(path / "model.safetensors"))
    return path


def _fp8_codes(rng, shape) -> np.ndarray:
    """Random finite E4M3 codes over the whole range (no NaN byte 0x7f / 0xff)."""
    raw = rng.integers(0, 256, shape, dtype=np.uint8)
    raw = np.where((raw & 0x7F) == 0x7F, raw ^ 0x01, raw).astype(np.uint8)
    return raw.view(F8)


# ----------------------------------------------------------------------------- gpt-oss MXFP4

GD, GF, GE, GK = 96, 64, 8, 2


def _gptoss_checkpoint(path: Path, rng) -> tuple[Path, dict]:
    cfg = T.GptOssConfig(
        vocab_size=32,
        hidden_size=GD,
        intermediate_size=GF,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_local_experts=GE,
        num_experts_per_tok=GK,
        layer_types=["full_attention"],
    ).to_dict()
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router"]}
    p = "model.layers.0.mlp"
    t = {
        f"{p}.router.weight": rng.standard_normal((GE, GD)).astype(np.float32),
        f"{p}.router.bias": rng.standard_normal(GE).astype(np.float32) * 0.1,
        f"{p}.experts.gate_up_proj_bias": rng.standard_normal((GE, 2 * GF)).astype(np.float32) * 0.3,
        f"{p}.experts.down_proj_bias": rng.standard_normal((GE, GD)).astype(np.float32) * 0.3,
    }
    for name, (out, n_in) in (("gate_up_proj", (2 * GF, GD)), ("down_proj", (GD, GF))):
        t[f"{p}.experts.{name}_blocks"] = rng.integers(0, 256, (GE, out, n_in // 32, 16), dtype=np.uint8)
        t[f"{p}.experts.{name}_scales"] = rng.integers(118, 123, (GE, out, n_in // 32), dtype=np.uint8)
    return _write(path, cfg, t), t


def _gptoss_f64(x: np.ndarray, t: dict, cfg, ids: np.ndarray, wts: np.ndarray) -> np.ndarray:
    """float64 loop over the pairs of gpt-oss's experts decoded from the HF layout."""
    p = "model.layers.0.mlp.experts"
    gu = hf_mxfp4_f64(t[f"{p}.gate_up_proj_blocks"], t[f"{p}.gate_up_proj_scales"])  # (E, 2F, d)
    dn = hf_mxfp4_f64(t[f"{p}.down_proj_blocks"], t[f"{p}.down_proj_scales"])  # (E, d, F)
    gub, dnb = t[f"{p}.gate_up_proj_bias"].astype(np.float64), t[f"{p}.down_proj_bias"].astype(np.float64)
    lim, alpha = cfg.swiglu_limit, cfg.swiglu_alpha
    y = np.zeros(x.shape, np.float64)
    for i in range(x.shape[0]):
        xi = x[i].astype(np.float64)
        for e, w in zip(ids[i], wts[i]):
            h = gu[e] @ xi + gub[e]
            g, u = np.minimum(h[0::2], lim), np.clip(h[1::2], -lim, lim)
            a = (u + 1) * g / (1 + np.exp(-alpha * g))
            y[i] += w * (dn[e] @ a + dnb[e])
    return y


def test_mxfp4_repack_decodes_as_hf_layout(rng):
    """The re-packed GGUF blocks hold the HF codes and exponents: ``gguf.quants.dequantize`` of
    them equals the HF layout's float64 decode (every exponent byte, subnormal and overflow
    ones included; E2M1 -0 becomes +0), and jaxmoe's jnp decode equals gguf.quants bit for bit."""
    blocks = rng.integers(0, 256, (2, 256, 16), dtype=np.uint8)
    scales = np.arange(512, dtype=np.int64).reshape(2, 256).astype(np.uint8)  # every E8M0 byte
    raw = mxfp4_to_gguf_blocks(blocks, scales)
    assert raw.shape == (2, 256 * 17) and raw.nbytes == blocks.nbytes + scales.nbytes
    with np.errstate(over="ignore"):
        want = hf_mxfp4_f64(blocks, scales)
        got = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.MXFP4)
    np.testing.assert_array_equal(
        got.astype(np.float64), np.where(np.abs(want) > np.finfo(np.float32).max, np.copysign(np.inf, want), want)
    )
    mine = np.asarray(gguf_block_tensor(raw, "mxfp4", 256 * 32).dequantize())  # [in, out]
    np.testing.assert_array_equal(np.swapaxes(mine, -1, -2).view(np.uint32), got.view(np.uint32))
    with pytest.raises(ValueError, match=r"blocks \(2, 256, 15\) must be scales \(2, 256\) \+ \(16,\)"):
        mxfp4_to_gguf_blocks(blocks[..., :15], scales)


@pytest.mark.slow
def test_gptoss_mxfp4_checkpoint_kept_in_its_bytes(tmp_path, rng, monkeypatch):
    """gpt-oss's MXFP4 experts load as ``mxfp4`` `QuantizedTensor` s holding the file's bytes of
    ``*_blocks`` + ``*_scales``, decode to the old dequantizing loader's values, and the layer
    matches a float64 loop over the HF layout's decode on every XLA strategy and ``auto``.
    Read a few file rows at a time (an odd count, so that a chunk splits gate / up pairs),
    the bytes are the same."""
    q, t = _gptoss_checkpoint(tmp_path / "ck", rng)
    cfg, params = jio.load_layer(q, layer=0)
    ew = params.experts
    monkeypatch.setattr(jaxmoe.io.hf, "_MXFP4_ROWS", 7)
    chunked = jio.load_layer(q, layer=0)[1].experts
    for a, b in zip((ew.w_gate, ew.w_up, ew.w_down), (chunked.w_gate, chunked.w_up, chunked.w_down)):
        np.testing.assert_array_equal(np.asarray(b.qdata), np.asarray(a.qdata))
    assert all(isinstance(w, QuantizedTensor) and w.kind == "mxfp4" for w in (ew.w_gate, ew.w_up, ew.w_down))
    file_bytes = sum(v.nbytes for k, v in t.items() if k.endswith(("_blocks", "_scales")))
    assert ew.w_gate.nbytes + ew.w_up.nbytes + ew.w_down.nbytes == file_bytes
    assert ew.w_gate.shape == (GE, GD, GF) and ew.w_down.shape == (GE, GF, GD)
    _, old = jio.load_layer(q, layer=0, quantized=False)  # the dequantizing path
    for a, b in zip((ew.w_gate, ew.w_up, ew.w_down), (old.experts.w_gate, old.experts.w_up, old.experts.w_down)):
        assert not isinstance(b, QuantizedTensor)
        np.testing.assert_array_equal(np.asarray(a.dequantize()), np.asarray(b))  # equal values (-0 == +0)
    x = rng.standard_normal((9, GD)).astype(np.float32)
    for impl in ("dense", "gather", "xla", "xla_tiled", "ragged_dot", "auto"):
        y, r = jaxmoe.moe_apply(params, jnp.asarray(x), cfg, impl=impl, return_routing=True)
        want = _gptoss_f64(x, t, cfg, np.asarray(r.expert_ids), np.asarray(r.weights, np.float64))
        err = np.abs(np.asarray(y, np.float64) - want).max() / np.abs(want).max()
        assert err < 2e-6, (impl, err)
    out = jaxmoe.save_gguf((cfg, params), tmp_path / "layer.gguf", layer=0, dtype="keep")  # MXFP4 byte for byte
    cfg2, back = jio.load_layer(out, layer=0)
    assert cfg2 == cfg
    for a, b in zip((ew.w_gate, ew.w_up, ew.w_down), (back.experts.w_gate, back.experts.w_up, back.experts.w_down)):
        assert isinstance(b, QuantizedTensor) and b.kind == "mxfp4"
        np.testing.assert_array_equal(np.asarray(b.qdata), np.asarray(a.qdata))


@pytest.mark.slow
def test_gptoss_mxfp4_flipped_bytes_and_bad_buffers(tmp_path, rng):
    """A flipped code nibble or a changed exponent of a selected expert changes the layer's
    output (as the float64 reference of the changed file says); truncated or mis-sized blocks
    and scales are ValueErrors naming the tensor and shapes."""
    q, t = _gptoss_checkpoint(tmp_path / "ck", rng)
    x = jnp.asarray(rng.standard_normal((4, GD)).astype(np.float32))
    cfg, params = jio.load_layer(q, layer=0)
    y0, r = jaxmoe.moe_apply(params, x, cfg, impl="xla", return_routing=True)
    e = int(r.expert_ids[0, 0])
    p = "model.layers.0.mlp.experts"
    config = json.loads((q / "config.json").read_text())
    for key, change in (
        (f"{p}.down_proj_blocks", lambda a: a.__setitem__((e, 5, 1, 3), a[e, 5, 1, 3] ^ 0x01)),
        (f"{p}.down_proj_scales", lambda a: a.__setitem__((e, 7, 1), a[e, 7, 1] + 1)),
    ):
        t2 = {k: v.copy() for k, v in t.items()}
        change(t2[key])
        q2 = _write(tmp_path / "flip", config, t2)
        cfg2, p2 = jio.load_layer(q2, layer=0)
        y, r2 = jaxmoe.moe_apply(p2, x, cfg2, impl="xla", return_routing=True)
        assert not np.array_equal(np.asarray(y), np.asarray(y0)), key
        want = _gptoss_f64(np.asarray(x), t2, cfg2, np.asarray(r2.expert_ids), np.asarray(r2.weights, np.float64))
        np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    for key, bad in (
        (f"{p}.down_proj_blocks", t[f"{p}.down_proj_blocks"][..., :15]),  # truncated blocks
        (f"{p}.gate_up_proj_scales", t[f"{p}.gate_up_proj_scales"][..., :2]),  # one block's scales short
        (f"{p}.gate_up_proj_blocks", t[f"{p}.gate_up_proj_blocks"][:, :-1]),  # a row short
    ):
        q3 = _write(tmp_path / "bad", config, {**t, key: np.ascontiguousarray(bad)})
        with pytest.raises(ValueError, match=re.escape(f"'{key}' has shape {bad.shape}")):
            jio.load_layer(q3, layer=0)
    with pytest.raises(ValueError, match=r"rows of 33 bytes .* not a whole number of 17-byte blocks"):
        gguf_block_tensor(np.zeros((2, 4, 33), np.uint8), "mxfp4")


# ----------------------------------------------------------------------------- block-scaled FP8


def test_fp8_decode_bit_exact_with_ml_dtypes(rng):
    """`dequantize_fp8_blocks` (jnp) equals numpy's ``codes.astype(float32) * scale`` with
    ``ml_dtypes`` bit for bit: every one of the 256 code bytes (NaN included), partial last
    blocks along both axes, float32 / bfloat16 / float16 scales."""
    b = 32
    codes = np.concatenate([np.arange(256, dtype=np.uint8), rng.integers(0, 256, 70 * 45 - 256, dtype=np.uint8)])
    codes = codes.reshape(70, 45).view(F8)
    for sdt in (np.float32, ml_dtypes.bfloat16, np.float16):
        scales = rng.uniform(1e-3, 2.0, (3, 2)).astype(sdt)
        want = codes.astype(np.float32) * np.repeat(np.repeat(scales.astype(np.float32), b, 0), b, 1)[:70, :45]
        got = np.asarray(dequantize_fp8_blocks(jnp.asarray(codes), jnp.asarray(scales), b))
        np.testing.assert_array_equal(got.view(np.uint32)[~np.isnan(want)], want.view(np.uint32)[~np.isnan(want)])
        assert np.array_equal(np.isnan(got), np.isnan(want))
        w = fp8_block_tensor(codes[None], scales[None], b)
        assert w.shape == (1, 45, 70) and w.nbytes == codes.nbytes + scales.nbytes
        np.testing.assert_array_equal(np.asarray(materialize(w, jnp.float32))[0], got.T)


def test_fp8_tensor_errors_name_the_shapes():
    codes = np.zeros((2, 130, 200), F8)
    scales = np.ones((2, 2, 2), np.float32)
    fp8_block_tensor(codes, scales, 128)
    with pytest.raises(
        ValueError,
        match=r"w_up \(fp8_e4m3, 128 x 128 blocks\): scales of shape \(2, 1, 2\) do not match codes of shape \(2, 130, 200\).*\(2, 2, 2\)",
    ):
        fp8_block_tensor(codes, scales[:, :1], 128, name="w_up")
    with pytest.raises(ValueError, match=r"codes must be float8_e4m3fn, got float32 of shape \(2, 130, 200\)"):
        fp8_block_tensor(codes.astype(np.float32), scales, 128)
    with pytest.raises(ValueError, match=r"scales must be float32, bfloat16 or float16, got int32"):
        fp8_block_tensor(codes, scales.astype(np.int32), 128)
    with pytest.raises(ValueError, match=r"group_size must be the positive block edge, got 0"):
        QuantizedTensor(codes, scales, None, "fp8_e4m3", 0)
    with pytest.raises(ValueError, match=r"need their block scales, got None"):
        QuantizedTensor(codes, None, None, "fp8_e4m3", 128)
    with pytest.raises(ValueError, match=r"keeps float8 codes"):
        fp8_block_tensor(codes, scales, 128).codes()


#: DeepSeek-V3-like layer with 128 x 128 blocks: d = 192 and F = 80 leave partial blocks.
DD, DF, DE, DK = 192, 80, 8, 2


def _dsv3_checkpoint(path: Path, rng, block=(128, 128)) -> tuple[Path, dict]:
    cfg = T.DeepseekV3Config(
        vocab_size=32,
        hidden_size=DD,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        intermediate_size=96,
        moe_intermediate_size=DF,
        n_routed_experts=DE,
        num_experts_per_tok=DK,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
    ).to_dict()
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    p = "model.layers.1.mlp"
    t = {
        f"{p}.gate.weight": rng.standard_normal((DE, DD)).astype(np.float32),
        f"{p}.gate.e_score_correction_bias": rng.standard_normal(DE).astype(np.float32) * 0.05,
    }
    mods = [f"{p}.experts.{j}" for j in range(DE)] + [f"{p}.shared_experts"]
    for m in mods:
        for n, (out, n_in) in (("gate_proj", (DF, DD)), ("up_proj", (DF, DD)), ("down_proj", (DD, DF))):
            t[f"{m}.{n}.weight"] = _fp8_codes(rng, (out, n_in))
            sshape = (-(-out // block[0]), -(-n_in // block[1]))
            t[f"{m}.{n}.weight_scale_inv"] = rng.uniform(2e-4, 2e-3, sshape).astype(np.float32)
    return _write(path, cfg, t), t


def _dsv3_f64(x: np.ndarray, t: dict, ids, wts, b: int) -> np.ndarray:
    """float64 loop: routed pairs plus the shared expert, weights decoded with ``ml_dtypes``."""
    p = "model.layers.1.mlp"

    def mlp(m, xi):
        w = {
            n: fp8_f64(t[f"{m}.{n}.weight"], t[f"{m}.{n}.weight_scale_inv"], b)
            for n in ("gate_proj", "up_proj", "down_proj")
        }
        g, u = w["gate_proj"] @ xi, w["up_proj"] @ xi
        return w["down_proj"] @ (g / (1 + np.exp(-g)) * u)

    y = np.zeros(x.shape, np.float64)
    for i in range(x.shape[0]):
        xi = x[i].astype(np.float64)
        y[i] = mlp(f"{p}.shared_experts", xi)
        for e, w in zip(ids[i], wts[i]):
            y[i] += w * mlp(f"{p}.experts.{e}", xi)
    return y


def _fp8_file_bytes(t: dict, part: str) -> int:
    return sum(v.nbytes for k, v in t.items() if part in k and k.endswith((".weight", ".weight_scale_inv")))


@pytest.mark.slow
def test_dsv3_fp8_checkpoint_kept_in_its_bytes(tmp_path, rng):
    """DeepSeek-V3 FP8 (128 x 128 blocks, partial along d and F): routed and shared experts
    load as ``fp8_e4m3`` holding the file's codes + scales bytes; the layer matches the
    float64 loop on every XLA strategy, ``auto`` and ``pallas`` (interpret mode; its kernels
    decode the FP8 tiles); the XLA strategies form no float copy of all experts."""
    q, t = _dsv3_checkpoint(tmp_path / "ck", rng)
    cfg, params = jio.load_layer(q, layer=1)
    ew, sw = params.experts, params.shared
    assert sw is not None
    for w in (ew.w_gate, ew.w_up, ew.w_down, sw.w_gate, sw.w_up, sw.w_down):
        assert isinstance(w, QuantizedTensor) and w.kind == "fp8_e4m3" and w.group_size == 128
    assert ew.w_gate.shape == (DE, DD, DF) and sw.w_down.shape == (DF, DD)
    assert ew.w_gate.nbytes + ew.w_up.nbytes + ew.w_down.nbytes == _fp8_file_bytes(t, ".experts.")
    assert sw.w_gate.nbytes + sw.w_up.nbytes + sw.w_down.nbytes == _fp8_file_bytes(t, ".shared_experts.")
    x = rng.standard_normal((7, DD)).astype(np.float32)
    for impl in ("dense", "gather", "xla", "xla_tiled", "ragged_dot", "auto", "pallas"):
        y, r = jaxmoe.moe_apply(params, jnp.asarray(x), cfg, impl=impl, return_routing=True)
        want = _dsv3_f64(x, t, np.asarray(r.expert_ids), np.asarray(r.weights, np.float64), 128)
        err = np.abs(np.asarray(y, np.float64) - want).max() / np.abs(want).max()
        assert err < 2e-6, (impl, err)
    for impl in ("xla", "gather"):
        run = jax.jit(lambda p, x, impl=impl: jaxmoe.moe_apply(p, x, cfg, impl=impl))
        hlo = run.lower(jax.tree.map(jnp.asarray, params), jnp.asarray(x[:2])).compile().as_text()
        whole = [i for i in unfused_instructions(hlo) if re.search(rf"= f32\[{DE},({DD},{DF}|{DF},{DD})\]", i)]
        assert not whole, (impl, whole)
    _, back = jio.load_layer(jaxmoe.save_gguf((cfg, params), tmp_path / "l.gguf", layer=1, dtype="keep"), layer=1)
    np.testing.assert_array_equal(np.asarray(back.experts.w_down), np.asarray(ew.w_down.dequantize()))  # as F32


@pytest.mark.slow
def test_dsv3_fp8_flipped_bytes_errors_and_gradient(tmp_path, rng):
    """A flipped code or a changed scale of a selected expert changes the output (to the
    float64 reference of the changed file); truncated / mis-sized scales and codes are
    ValueErrors naming the tensor; ``impl='cpu'`` refuses an input width (F = 80) that is not
    a multiple of 32 by name and ``activations='ggml'`` the kind; ``quantized=False`` and non-square blocks dequantize; the input gradient flows
    through frozen FP8 experts (xla's custom VJP) and equals ``dense``'s; the experts' cotangents
    are zeros of each leaf's dtype (float8 codes included) whatever the strategy."""
    b = 32
    q, t = _dsv3_checkpoint(tmp_path / "ck", rng, block=(b, b))
    config = json.loads((q / "config.json").read_text())
    x = jnp.asarray(rng.standard_normal((3, DD)).astype(np.float32))
    cfg, params = jio.load_layer(q, layer=1)
    assert params.experts.w_up.group_size == b
    y0, r = jaxmoe.moe_apply(params, x, cfg, impl="gather", return_routing=True)
    e = int(r.expert_ids[0, 0])
    m = f"model.layers.1.mlp.experts.{e}"
    codes = t[f"{m}.gate_proj.weight"].view(np.uint8)
    i, j = np.argwhere((codes & 0x7F) < 0x7E)[0]
    for key, value in (
        (f"{m}.gate_proj.weight", codes.copy()),
        (f"{m}.down_proj.weight_scale_inv", t[f"{m}.down_proj.weight_scale_inv"] * 2),
    ):
        if key.endswith(".weight"):
            value[i, j] ^= 0x01
            value = value.view(F8)
        t2 = {**t, key: value}
        cfg2, p2 = jio.load_layer(_write(tmp_path / "flip", config, t2), layer=1)
        y, r2 = jaxmoe.moe_apply(p2, x, cfg2, impl="gather", return_routing=True)
        assert not np.array_equal(np.asarray(y), np.asarray(y0)), key
        want = _dsv3_f64(np.asarray(x), t2, np.asarray(r2.expert_ids), np.asarray(r2.weights, np.float64), b)
        np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    for key, bad in (
        (f"{m}.up_proj.weight_scale_inv", t[f"{m}.up_proj.weight_scale_inv"][:, :-1]),  # a block's scale missing
        (f"{m}.down_proj.weight", t[f"{m}.down_proj.weight"][:-1]),  # a row short
    ):
        q3 = _write(tmp_path / "bad", config, {**t, key: np.ascontiguousarray(bad)})
        with pytest.raises(ValueError, match=re.escape(f"'{key}' has shape {bad.shape}")):
            jio.load_layer(q3, layer=1)
    with pytest.raises(ValueError, match=r"impl='cpu': w_down \(fp8_e4m3, 32 x 32 blocks\).*multiples of 32"):
        jaxmoe.moe_apply(params, x, cfg, impl="cpu")
    with pytest.raises(ValueError, match=r"no ggml vec_dot_type for weight kind 'fp8_e4m3'"):
        jaxmoe.moe_apply(params, x, cfg, ExecConfig(impl="xla", activations="ggml"))
    _, plain = jio.load_layer(q, layer=1, quantized=False)
    assert not isinstance(plain.experts.w_gate, QuantizedTensor)
    np.testing.assert_array_equal(np.asarray(plain.experts.w_gate), np.asarray(params.experts.w_gate.dequantize()))
    cfg_ns = dict(config, quantization_config=dict(config["quantization_config"], weight_block_size=[b, 2 * b]))
    (q / "config.json").write_text(json.dumps(cfg_ns))
    with pytest.raises(
        ValueError, match=r"experts\.0\.gate_proj\.weight_scale_inv' has shape \(3, 6\), expected \(3, 3\)"
    ):
        jio.load_layer(q, layer=1)  # the file's scales are per 32 x 32 block, not 32 x 64

    def loss(x, impl):
        return jaxmoe.moe_apply(params, x, cfg, impl=impl).sum()

    gx = {impl: np.asarray(jax.grad(loss)(x, impl)) for impl in ("dense", "xla")}
    np.testing.assert_allclose(gx["xla"], gx["dense"], rtol=1e-5, atol=1e-5 * np.abs(gx["dense"]).max())
    assert np.abs(gx["dense"]).max() > 0
    dev = jax.tree.map(jnp.asarray, params)
    gp = {i: jax.grad(lambda p, i=i: jaxmoe.moe_apply(p, x, cfg, impl=i).sum())(dev) for i in ("gather", "xla")}
    for g in gp.values():  # frozen experts: zeros in the leaves' own dtypes (float8 codes too), a router gradient
        assert g.experts.w_gate.qdata.dtype == F8 and not np.asarray(g.experts.w_gate.qdata, np.float32).any()
        assert g.experts.w_up.scales.dtype == np.float32 and not np.asarray(g.experts.w_up.scales).any()
    np.testing.assert_allclose(np.asarray(gp["xla"].w_router), np.asarray(gp["gather"].w_router), rtol=1e-4, atol=1e-6)


Q3 = dict(d=160, f=48, e=4, k=2)


def _qwen3_fp8_checkpoint(path: Path, rng) -> tuple[Path, dict]:
    """Qwen3-MoE FP8: per-expert ``weight`` + ``weight_scale_inv`` in bfloat16, 128 x 128 blocks."""
    d, f, e, k = Q3["d"], Q3["f"], Q3["e"], Q3["k"]
    cfg = T.Qwen3MoeConfig(
        vocab_size=32,
        hidden_size=d,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=64,
        moe_intermediate_size=f,
        num_experts=e,
        num_experts_per_tok=k,
        norm_topk_prob=True,
    ).to_dict()
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    p = "model.layers.0.mlp"
    t = {f"{p}.gate.weight": rng.standard_normal((e, d)).astype(np.float32)}
    for j in range(e):
        for n, (out, n_in) in (("gate_proj", (f, d)), ("up_proj", (f, d)), ("down_proj", (d, f))):
            t[f"{p}.experts.{j}.{n}.weight"] = _fp8_codes(rng, (out, n_in))
            sshape = (-(-out // 128), -(-n_in // 128))
            t[f"{p}.experts.{j}.{n}.weight_scale_inv"] = rng.uniform(2e-4, 2e-3, sshape).astype(ml_dtypes.bfloat16)
    return _write(path, cfg, t), t


def test_qwen3_fp8_checkpoint_held_bytes(tmp_path, rng):
    """Qwen3-MoE FP8 loads as ``fp8_e4m3`` with the scales' own dtype (bfloat16): held bytes
    = file bytes, as ``jaxmoe inspect`` counts them from the headers; indexing keeps the kind."""
    q, t = _qwen3_fp8_checkpoint(tmp_path / "ck", rng)
    e = Q3["e"]
    _, params = jio.load_layer(q, layer=0)
    ew = params.experts
    assert isinstance(ew.w_down, QuantizedTensor) and ew.w_down.scales.dtype == ml_dtypes.bfloat16
    assert ew.w_gate.nbytes + ew.w_up.nbytes + ew.w_down.nbytes == _fp8_file_bytes(t, ".experts.")
    rows = [r for r in inspect_path(q).tensors if r.layer == 0 and "experts" in r.name]  # jaxmoe inspect
    assert {r.dtype for r in rows} == {"F8_E4M3", "BF16"} and all(r.count == e for r in rows)
    assert sum(r.nbytes for r in rows) == ew.w_gate.nbytes + ew.w_up.nbytes + ew.w_down.nbytes
    one = ExpertWeights(ew.w_gate[1], ew.w_up[1], ew.w_down[1])  # indexing keeps the kind
    assert one.w_gate.kind == "fp8_e4m3" and one.w_gate.scales.shape == (1, 2)


@pytest.mark.slow
def test_qwen3_fp8_layer_matches_float64(tmp_path, rng):
    """The Qwen3 FP8 layer (``auto``: F = 48 is not a multiple of 32, which the C++ kernel
    needs, so an XLA strategy) against
    the float64 loop over ``ml_dtypes`` decodes of the file's codes and bfloat16 scales."""
    q, t = _qwen3_fp8_checkpoint(tmp_path / "ck", rng)
    p = "model.layers.0.mlp"
    mcfg, params = jio.load_layer(q, layer=0)
    x = rng.standard_normal((5, Q3["d"])).astype(np.float32)
    y, r = jaxmoe.moe_apply(params, jnp.asarray(x), mcfg, impl="auto", return_routing=True)
    ids, wts = np.asarray(r.expert_ids), np.asarray(r.weights, np.float64)
    want = np.zeros(x.shape)
    for i in range(x.shape[0]):
        for ex, w in zip(ids[i], wts[i]):
            W = {
                n: fp8_f64(t[f"{p}.experts.{ex}.{n}.weight"], t[f"{p}.experts.{ex}.{n}.weight_scale_inv"], 128)
                for n in ("gate_proj", "up_proj", "down_proj")
            }
            g, u = W["gate_proj"] @ x[i], W["up_proj"] @ x[i]
            want[i] += w * (W["down_proj"] @ (g / (1 + np.exp(-g)) * u))
    err = np.abs(np.asarray(y, np.float64) - want).max() / np.abs(want).max()
    assert err < 2e-6, err


@pytest.mark.slow
def test_gptoss_checkpoint_streams_from_a_keep_store(tmp_path, rng):
    """`write_checkpoint_store`: gpt-oss's MXFP4 experts go to an offload store in the bytes the
    loader holds (held = the file's blocks + scales), and the streamed stack equals the
    loaded layer applied to the RMS-normed input (the store's norm weights are ones)."""
    from jaxmoe.offload import OffloadConfig, OffloadedModel, make_predictor, write_checkpoint_store
    from jaxmoe.offload.driver import rms_norm

    q, t = _gptoss_checkpoint(tmp_path / "ck", rng)
    store = write_checkpoint_store(q, tmp_path / "store", layers=[0, 0])  # the same layer twice
    assert store.num_layers == 2 and store.kind == "keep"
    _, params = jio.load_layer(q, layer=0)
    e = int(rng.integers(GE))
    got = store.load_expert(1, e)
    for name in ("w_gate", "w_up", "w_down"):
        w, want = getattr(got, name), getattr(params.experts, name)
        assert isinstance(w, QuantizedTensor) and w.kind == "mxfp4"
        np.testing.assert_array_equal(np.asarray(w.qdata), np.asarray(want.qdata[e]))
    file_bytes = sum(v.nbytes for k, v in t.items() if k.endswith(("_blocks", "_scales")))
    assert store.expert_nbytes() * GE == file_bytes + sum(v.nbytes for k, v in t.items() if k.endswith("_proj_bias"))
    x = rng.standard_normal((3, GD)).astype(np.float32)
    model = OffloadedModel(store, num_layers=1)
    ref = model.run_resident(x)
    loaded = jaxmoe.from_pretrained(q, layer=0, ex=jaxmoe.ExecConfig())
    xn = np.asarray(rms_norm(x, np.ones(GD, np.float32)))
    np.testing.assert_allclose(ref.outputs, x + np.asarray(loaded(xn)), rtol=1e-5, atol=1e-5)
    out, _ = model.run_offloaded(x, OffloadConfig(GE // 2 * store.expert_nbytes()), make_predictor("prev_token"))
    np.testing.assert_array_equal(out.outputs, ref.outputs)
    with pytest.raises(ValueError, match="layer 3 is outside"):
        write_checkpoint_store(q, tmp_path / "bad", layers=[3])

"""MLX 4-bit affine quantization and mlx-lm checkpoints, against `mlx.core` itself.

- `jaxmoe.io.mlx_codec.quantize` / `jaxmoe.quant.mlx_affine_quantize_groups`: codes, scales and
  biases bit-equal to `mlx.core.quantize` on random weights (float32, bfloat16, float16).
- dequantization (numpy, and `QuantizedTensor.dequantize`) equal to `mlx.core.dequantize`.
- mlx-lm checkpoint directories written with `mlx.core.save_safetensors` load through
  `jaxmoe.from_pretrained` (and `jaxmoe.io.mlx.load_layer`) with the routed experts still
  4-bit, and the block equals a float64 numpy reference on `mlx.core.dequantize`d weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import mlx.core as mx
import numpy as np
import pytest
from helpers import assert_same_params
from hypothesis import given
from hypothesis import strategies as st

import jaxmoe
from jaxmoe import io as jio
from jaxmoe import quant
from jaxmoe.io import hf, mlx, mlx_codec

MX_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def _np(a: mx.array) -> np.ndarray:
    """An mx array as numpy (bf16 through float32, which is exact)."""
    if a.dtype == mx.bfloat16:
        return np.array(a.astype(mx.float32))
    return np.array(a)


def _random_weight(rng, shape, kind: int) -> np.ndarray:
    w = rng.standard_normal(shape) * rng.uniform(0.01, 4.0)
    if kind == 1:
        w = np.abs(w) + rng.uniform(0, 1)  # all-positive groups: edge is the max
    elif kind == 2:
        w = -np.abs(w) * 1e-9  # tiny groups: q0 rounds to 0, bias 0
    elif kind == 3:
        w[..., :64] = rng.standard_normal()  # a constant group
    return w.astype(np.float32)


@given(
    out=st.integers(1, 6),
    groups=st.integers(1, 4),
    lead=st.integers(1, 3),
    kind=st.integers(0, 3),
    dtype=st.sampled_from(sorted(MX_DTYPES)),
    seed=st.integers(0, 2**31 - 1),
)
def test_quantize_bit_exact_with_mlx(out, groups, lead, kind, dtype, seed):
    rng = np.random.default_rng(seed)
    w32 = _random_weight(rng, (lead, out, 64 * groups), kind)
    wm = mx.array(w32).astype(MX_DTYPES[dtype])
    q_ref, s_ref, b_ref = mx.quantize(wm, group_size=64, bits=4)
    w_in = np.array(wm) if dtype != "bfloat16" else np.array(wm.astype(mx.float32)).astype(jnp.bfloat16)
    q, s, b = mlx_codec.quantize(w_in, group_size=64, bits=4)
    np.testing.assert_array_equal(q, np.array(q_ref))
    np.testing.assert_array_equal(np.asarray(s, np.float32), _np(s_ref))
    np.testing.assert_array_equal(np.asarray(b, np.float32), _np(b_ref))
    # the QuantizedTensor quantizer (logical [in, out]) stores the same bytes
    qt = quant.quantize_int4_affine(np.swapaxes(np.asarray(w_in, np.float32), -1, -2), 64)
    np.testing.assert_array_equal(np.asarray(qt.qdata), np.array(q_ref).view(np.uint8))


@pytest.mark.parametrize("dtype", sorted(MX_DTYPES))
def test_dequantize_equals_mlx(dtype, rng):
    w = mx.array(rng.standard_normal((3, 8, 256)).astype(np.float32)).astype(MX_DTYPES[dtype])
    q, s, b = mx.quantize(w, group_size=64, bits=4)
    s32, b32 = s.astype(mx.float32), b.astype(mx.float32)
    ref = np.array(mx.dequantize(q, s32, b32, group_size=64, bits=4))  # (3, 8, 256) float32
    qt = mlx_codec.to_quantized_tensor(
        np.array(q),
        np.array(s) if dtype != "bfloat16" else np.array(s32).astype(jnp.bfloat16),
        np.array(b) if dtype != "bfloat16" else np.array(b32).astype(jnp.bfloat16),
    )
    assert qt.kind == "int4" and qt.group_size == 64 and qt.shape == (3, 256, 8)
    assert qt.scales.dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(np.swapaxes(np.asarray(qt.dequantize(jnp.float32)), -1, -2), ref)
    spec = mlx_codec.QuantSpec(4, 64)
    np.testing.assert_array_equal(mlx_codec.dequantize(np.array(q), np.array(s32), np.array(b32), spec), ref)
    # in the scales' own dtype MLX rounds twice (scale * q, then + bias); we round once from float32
    own = np.array(mx.dequantize(q, s, b, group_size=64, bits=4).astype(mx.float32))
    tol = {"float32": 0, "bfloat16": 2**-7, "float16": 2**-10}[dtype]
    np.testing.assert_allclose(
        np.swapaxes(np.asarray(qt.dequantize(jnp.float32)), -1, -2), own, rtol=tol, atol=tol * np.abs(own).max()
    )


def test_words_to_quantized_tensor_is_a_byte_view(rng):
    w = mx.array(rng.standard_normal((2, 4, 128)).astype(np.float32))
    q, s, b = mx.quantize(w, group_size=64, bits=4)
    # the codes themselves, by MLX: dequantize with scale 1 and bias 0
    codes_ref = np.array(mx.dequantize(q, mx.ones_like(s), mx.zeros_like(b), group_size=64, bits=4))
    qt = mlx_codec.to_quantized_tensor(np.array(q), np.array(s), np.array(b))
    np.testing.assert_array_equal(np.asarray(qt.codes()), codes_ref.astype(np.int8))
    words, s2, b2 = mlx_codec.from_quantized_tensor(qt)
    np.testing.assert_array_equal(words, np.array(q))
    np.testing.assert_array_equal(s2, np.array(s))


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_other_bit_widths_dequantize_like_mlx(bits, rng):
    w = mx.array(rng.standard_normal((5, 256)).astype(np.float32))
    q, s, b = mx.quantize(w, group_size=64, bits=bits)
    ref = np.array(mx.dequantize(q, s, b, group_size=64, bits=bits))
    got = mlx_codec.dequantize(np.array(q), np.array(s), np.array(b), mlx_codec.QuantSpec(bits, 64))
    np.testing.assert_array_equal(got, ref)
    codes = mlx_codec.unpack_codes(np.array(q), bits)
    np.testing.assert_array_equal(mlx_codec.pack_codes(codes, bits), np.array(q))


def test_bad_quantized_shapes_and_specs(rng):
    q, s, b = (np.array(a) for a in mx.quantize(mx.array(rng.standard_normal((4, 128)).astype(np.float32))))
    with pytest.raises(ValueError, match=r"mlp\.gate\.scales has shape \(4, 3\), expected \(4, 2\)"):
        mlx_codec.dequantize(q, np.ones((4, 3), np.float32), b, mlx_codec.QuantSpec(4, 64), name="mlp.gate")
    with pytest.raises(ValueError, match="mode: only MLX 'affine'"):
        mlx_codec.QuantSpec(4, 32, "mxfp4")
    with pytest.raises(ValueError, match="bits: 7"):
        mlx_codec.QuantSpec(7, 64)
    with pytest.raises(ValueError, match="must be uint32"):
        mlx_codec.to_quantized_tensor(q.view(np.int32), s, b)


# ----------------------------------------------------------------------------- checkpoints

D, F, FS, E, K, T_TOK = 128, 64, 64, 16, 4, 10


def _q(rng, shape, bits=4, dtype=mx.bfloat16, scale=0.1):
    """Random float weight (..., out, in) quantized by MLX: (weight, scales, biases) mx arrays."""
    w = mx.array((rng.standard_normal(shape) * scale).astype(np.float32)).astype(dtype)
    return mx.quantize(w, group_size=64, bits=bits)


def _deq(tensors, module, bits=4):
    """float64 weight (..., out, in): MLX's own dequantization (float32 scales, as jaxmoe computes)."""
    w = tensors[f"{module}.weight"]
    if f"{module}.scales" not in tensors:
        return np.array(w.astype(mx.float32), np.float64)
    s, b = tensors[f"{module}.scales"].astype(mx.float32), tensors[f"{module}.biases"].astype(mx.float32)
    return np.array(mx.dequantize(w, s, b, group_size=64, bits=bits), np.float64)


def _put_q(tensors, module, qwb):
    tensors[f"{module}.weight"], tensors[f"{module}.scales"], tensors[f"{module}.biases"] = qwb


def _write(path: Path, tensors: dict, config: dict) -> None:
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), tensors, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config))


def _qwen35_checkpoint(path: Path, rng) -> dict:
    """mlx-lm Qwen3.5-MoE layout: ``language_model.model.layers.{i}.mlp.switch_mlp``, router at 8 bits,
    shared expert 4-bit, shared-expert gate left in float (override ``false``)."""
    t = {}
    pre = "language_model.model.layers"
    for i in range(2):
        p = f"{pre}.{i}.mlp"
        _put_q(t, f"{p}.switch_mlp.gate_proj", _q(rng, (E, F, D)))
        _put_q(t, f"{p}.switch_mlp.up_proj", _q(rng, (E, F, D)))
        _put_q(t, f"{p}.switch_mlp.down_proj", _q(rng, (E, D, F)))
        _put_q(t, f"{p}.gate", _q(rng, (E, D), bits=8, scale=1.0))
        _put_q(t, f"{p}.shared_expert.gate_proj", _q(rng, (FS, D)))
        _put_q(t, f"{p}.shared_expert.up_proj", _q(rng, (FS, D)))
        _put_q(t, f"{p}.shared_expert.down_proj", _q(rng, (D, FS)))
        t[f"{p}.shared_expert_gate.weight"] = mx.array(rng.standard_normal((1, D)).astype(np.float32) * 0.1).astype(
            mx.bfloat16
        )
    quantization = {"group_size": 64, "bits": 4}
    for i in range(2):
        quantization[f"{pre}.{i}.mlp.gate"] = {"group_size": 64, "bits": 8}
        quantization[f"{pre}.{i}.mlp.shared_expert_gate"] = False
    config = {
        "model_type": "qwen3_5_moe",
        "quantization": quantization,
        "quantization_config": quantization,
        "text_config": {
            "model_type": "qwen3_5_moe_text",
            "hidden_size": D,
            "num_hidden_layers": 2,
            "num_experts": E,
            "num_experts_per_tok": K,
            "moe_intermediate_size": F,
            "shared_expert_intermediate_size": FS,
        },
    }
    _write(path, t, config)
    return t


def _dsv3_checkpoint(path: Path, rng) -> dict:
    """mlx-lm DeepSeek-V3 layout in float32: layer 0 dense, layer 1 ``mlp.switch_mlp`` + selection bias +
    ``shared_experts``, everything 4-bit including the router."""
    t = {}
    for n, shp in (("gate_proj", (96, D)), ("up_proj", (96, D)), ("down_proj", (D, 64))):
        _put_q(t, f"model.layers.0.mlp.{n}", _q(rng, shp, dtype=mx.float32))
    p = "model.layers.1.mlp"
    _put_q(t, f"{p}.switch_mlp.gate_proj", _q(rng, (E, F, D), dtype=mx.float32))
    _put_q(t, f"{p}.switch_mlp.up_proj", _q(rng, (E, F, D), dtype=mx.float32))
    _put_q(t, f"{p}.switch_mlp.down_proj", _q(rng, (E, D, F), dtype=mx.float32))
    _put_q(t, f"{p}.gate", _q(rng, (E, D), dtype=mx.float32, scale=1.0))
    t[f"{p}.gate.e_score_correction_bias"] = mx.array(rng.standard_normal(E).astype(np.float32) * 0.05)
    _put_q(t, f"{p}.shared_experts.gate_proj", _q(rng, (2 * F, D), dtype=mx.float32))
    _put_q(t, f"{p}.shared_experts.up_proj", _q(rng, (2 * F, D), dtype=mx.float32))
    _put_q(t, f"{p}.shared_experts.down_proj", _q(rng, (D, 2 * F), dtype=mx.float32))
    config = {
        "model_type": "deepseek_v3",
        "hidden_size": D,
        "num_hidden_layers": 2,
        "intermediate_size": 96,
        "moe_intermediate_size": F,
        "n_routed_experts": E,
        "num_experts_per_tok": K,
        "n_shared_experts": 2,
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "first_k_dense_replace": 1,
        "quantization": {"group_size": 64, "bits": 4},
    }
    _write(path, t, config)
    return t


def _gptoss_checkpoint(path: Path, rng) -> dict:
    """mlx-lm gpt-oss layout: ``mlp.experts.<proj>.{weight,scales,biases,bias}`` (SwitchGLU with bias),
    router ``mlp.router`` at 8 bits with its float bias."""
    t = {}
    for i in range(2):
        p = f"model.layers.{i}.mlp"
        for n, shp in (("gate_proj", (E, F, D)), ("up_proj", (E, F, D)), ("down_proj", (E, D, F))):
            _put_q(t, f"{p}.experts.{n}", _q(rng, shp, scale=0.4))
            t[f"{p}.experts.{n}.bias"] = mx.array(rng.standard_normal(shp[:2]).astype(np.float32)).astype(mx.bfloat16)
        _put_q(t, f"{p}.router", _q(rng, (E, D), bits=8, scale=1.0))
        t[f"{p}.router.bias"] = mx.array(rng.standard_normal(E).astype(np.float32)).astype(mx.bfloat16)
    quantization = {"group_size": 64, "bits": 4}
    for i in range(2):
        quantization[f"model.layers.{i}.mlp.router"] = {"group_size": 64, "bits": 8}
    config = {
        "model_type": "gpt_oss",
        "hidden_size": D,
        "num_hidden_layers": 2,
        "intermediate_size": F,
        "num_local_experts": E,
        "num_experts_per_tok": K,
        "swiglu_limit": 7.0,
        "quantization": quantization,
    }
    _write(path, t, config)
    return t


def test_gpt_oss_mlx_checkpoint(tmp_path, rng):
    t = _gptoss_checkpoint(tmp_path, rng)
    block = jaxmoe.from_pretrained(tmp_path, layer=1, impl="dense")
    ew = block.params().experts
    assert isinstance(ew.w_up, quant.QuantizedTensor) and ew.b_down.shape == (E, D)
    p = "model.layers.1.mlp"
    x = rng.standard_normal((T_TOK, D))
    wr = _deq(t, f"{p}.router", 8)
    br = np.array(t[f"{p}.router.bias"].astype(mx.float32), np.float64)
    wg, wu, wd = (_deq(t, f"{p}.experts.{n}") for n in ("gate_proj", "up_proj", "down_proj"))
    bg, bu, bd = (
        np.array(t[f"{p}.experts.{n}.bias"].astype(mx.float32), np.float64)
        for n in ("gate_proj", "up_proj", "down_proj")
    )
    y_ref = np.zeros_like(x)
    ids_ref = []
    clamped = 0
    for i, xi in enumerate(x):
        z = wr @ xi + br
        ids = np.argsort(-z, kind="stable")[:K]
        w = np.exp(z[ids] - z[ids].max())
        w /= w.sum()
        ids_ref.append(np.sort(ids))
        for j, wj in zip(ids, w):
            g, u = wg[j] @ xi + bg[j], wu[j] @ xi + bu[j]
            clamped += int((g > 7).sum() + (np.abs(u) > 7).sum())
            g, u = np.minimum(g, 7.0), np.clip(u, -7.0, 7.0)
            y_ref[i] += wj * (wd[j] @ ((u + 1) * g / (1 + np.exp(-1.702 * g))) + bd[j])
    assert clamped > 0  # the clamp is exercised
    y, r = block(jnp.asarray(x, jnp.float32), return_routing=True)
    np.testing.assert_array_equal(np.sort(np.asarray(r.expert_ids), 1), np.stack(ids_ref))
    y = np.asarray(y, np.float64)
    assert np.linalg.norm(y - y_ref) / np.linalg.norm(y_ref) < 1e-5


def _ref_route(z: np.ndarray, rc, bias):
    """float64 routing of one token's logits ``z [E]``: (ids, weights) by the pipeline of docs/routing.md."""
    if rc.score_fn == "softmax":
        s = np.exp(z - z.max())
        s /= s.sum()
    else:
        s = 1.0 / (1.0 + np.exp(-z))
    c = s + (0.0 if bias is None else bias)
    if rc.n_group > 1:
        g = c.reshape(rc.n_group, -1)
        gs = np.sort(g, axis=1)[:, -2:].sum(1) if rc.group_score == "top2_sum" else g.max(1)
        keep = np.argsort(-gs, kind="stable")[: rc.topk_group]
        mask = np.zeros(rc.n_group, bool)
        mask[keep] = True
        c = np.where(np.repeat(mask, rc.num_experts // rc.n_group), c, -np.inf)
    ids = np.argsort(-c, kind="stable")[: rc.top_k]
    w = s[ids]
    if rc.renorm == "sum":
        w = w / w.sum()
    elif rc.renorm == "add":
        w = w / (w.sum() + rc.renorm_eps)
    return ids, w * rc.routed_scaling_factor


def _silu(a):
    return a / (1.0 + np.exp(-a))


def _ref_block(x: np.ndarray, t: dict, p: str, cfg, router_bits: int, shared: str | None, gated: bool):
    wr = _deq(t, f"{p}.gate", router_bits)  # (E, d)
    bias = (
        np.array(t[f"{p}.gate.e_score_correction_bias"], np.float64)
        if f"{p}.gate.e_score_correction_bias" in t
        else None
    )
    wg, wu, wd = (_deq(t, f"{p}.switch_mlp.{n}") for n in ("gate_proj", "up_proj", "down_proj"))
    y = np.zeros_like(x)
    all_ids = []
    for i, xi in enumerate(x):
        ids, w = _ref_route(wr @ xi, cfg.router, bias)
        all_ids.append(np.sort(ids))
        for j, wj in zip(ids, w):
            y[i] += wj * (wd[j] @ (_silu(wg[j] @ xi) * (wu[j] @ xi)))
    if shared:
        sg, su, sd = (_deq(t, f"{p}.{shared}.{n}") for n in ("gate_proj", "up_proj", "down_proj"))
        ys = (_silu(x @ sg.T) * (x @ su.T)) @ sd.T
        if gated:
            ys *= 1.0 / (1.0 + np.exp(-(x @ _deq(t, f"{p}.shared_expert_gate")[0])))[:, None]
        y += ys
    return y, np.stack(all_ids)


def _check(block, t, p, router_bits, shared, gated, rng):
    ew = block.params().experts
    for w in (ew.w_gate, ew.w_up, ew.w_down):
        assert isinstance(w, quant.QuantizedTensor) and w.kind == "int4" and w.group_size == 64
    x = rng.standard_normal((T_TOK, D))
    y_ref, ids_ref = _ref_block(x, t, p, block.cfg, router_bits, shared, gated)
    y, r = block(jnp.asarray(x, jnp.float32), return_routing=True)
    np.testing.assert_array_equal(np.sort(np.asarray(r.expert_ids), 1), ids_ref)
    y = np.asarray(y, np.float64)
    assert np.linalg.norm(y - y_ref) / np.linalg.norm(y_ref) < 1e-5


def test_qwen35_mlx_checkpoint(tmp_path, rng):
    t = _qwen35_checkpoint(tmp_path, rng)
    block = jaxmoe.from_pretrained(tmp_path, layer=1, impl="dense")
    cfg = block.cfg
    assert cfg.family == "qwen3_5_moe" and cfg.shared_expert_gate and cfg.num_experts == E
    assert block.params().experts.w_gate.scales.dtype == jnp.bfloat16  # kept in the stored dtype
    _check(block, t, "language_model.model.layers.1.mlp", 8, "shared_expert", True, rng)


def test_mlx_load_layer_returns_config_and_params(tmp_path, rng):
    """`jaxmoe.io.mlx.load_layer`, the path dispatch and from_pretrained give the same layer;
    the HF reader without MLX quantization refuses the packed weights."""
    _qwen35_checkpoint(tmp_path, rng)
    assert jio.checkpoint_format(tmp_path) == "mlx"
    cfg, params = mlx.load_layer(tmp_path, layer=1)
    assert cfg == mlx.load_config(tmp_path) == jio.load_config(tmp_path)
    assert isinstance(params.experts.w_gate, quant.QuantizedTensor) and params.experts.w_gate.kind == "int4"
    cfg2, params2 = jio.load_layer(tmp_path, layer=1)
    block = jaxmoe.from_pretrained(tmp_path, layer=1)
    assert cfg2 == cfg and block.cfg == cfg
    assert_same_params(params, params2, block.params())
    with pytest.raises(ValueError, match="packed uint32"):
        hf.load_layer(tmp_path, layer=1, quantized=False)
    assert mlx.quantize is mlx_codec.quantize and mlx.QuantSpec is mlx_codec.QuantSpec  # re-exported


def test_deepseek_v3_mlx_checkpoint(tmp_path, rng):
    t = _dsv3_checkpoint(tmp_path, rng)
    block = jaxmoe.from_pretrained(tmp_path, layer=1, impl="dense")
    assert block.cfg.router.use_selection_bias and block.cfg.router.n_group == 4
    _check(block, t, "model.layers.1.mlp", 4, "shared_experts", False, rng)
    with pytest.raises(ValueError, match="layer 0 is a dense layer"):
        jaxmoe.from_pretrained(tmp_path, layer=0)


def test_mixtral_mlx_checkpoint_group32_float16(tmp_path, rng):
    """mlx-lm Mixtral layout (``block_sparse_moe.switch_mlp``), group size 32, float16 scales."""
    t = {}
    for i in range(2):
        p = f"model.layers.{i}.block_sparse_moe"
        for n, shp in (("gate_proj", (8, F, D)), ("up_proj", (8, F, D)), ("down_proj", (8, D, F))):
            w = mx.array((rng.standard_normal(shp) * 0.1).astype(np.float32)).astype(mx.float16)
            _put_q(t, f"{p}.switch_mlp.{n}", mx.quantize(w, group_size=32, bits=4))
        t[f"{p}.gate.weight"] = mx.array(rng.standard_normal((8, D)).astype(np.float32)).astype(mx.float16)
    config = {
        "model_type": "mixtral",
        "hidden_size": D,
        "num_hidden_layers": 2,
        "intermediate_size": F,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "quantization": {"group_size": 32, "bits": 4},
    }
    _write(tmp_path, t, config)
    block = jaxmoe.from_pretrained(tmp_path, layer=0, impl="dense")
    ew = block.params().experts
    assert ew.w_down.group_size == 32 and ew.w_down.scales.dtype == jnp.float16
    p = "model.layers.0.block_sparse_moe"
    x = rng.standard_normal((T_TOK, D))
    wr = np.array(t[f"{p}.gate.weight"].astype(mx.float32), np.float64)

    def deq(n):
        s, b = (t[f"{p}.switch_mlp.{n}.{k}"].astype(mx.float32) for k in ("scales", "biases"))
        return np.array(mx.dequantize(t[f"{p}.switch_mlp.{n}.weight"], s, b, group_size=32, bits=4), np.float64)

    wg, wu, wd = deq("gate_proj"), deq("up_proj"), deq("down_proj")
    y_ref = np.zeros_like(x)
    for i, xi in enumerate(x):
        z = wr @ xi
        ids = np.argsort(-z, kind="stable")[:2]
        w = np.exp(z[ids] - z.max()) / np.exp(z - z.max()).sum()
        w /= w.sum()
        for j, wj in zip(ids, w):
            y_ref[i] += wj * (wd[j] @ (_silu(wg[j] @ xi) * (wu[j] @ xi)))
    y = np.asarray(block(jnp.asarray(x, jnp.float32)), np.float64)
    assert np.linalg.norm(y - y_ref) / np.linalg.norm(y_ref) < 1e-5


def test_mlx_checkpoint_bad_input(tmp_path, rng):
    t = _qwen35_checkpoint(tmp_path / "a", rng)
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    p = "language_model.model.layers.1.mlp"
    # scales missing where the override says quantized
    t2 = {k: v for k, v in t.items() if k != f"{p}.gate.scales"}
    _write(tmp_path / "b", t2, cfg)
    with pytest.raises(ValueError, match=rf"{p}\.gate\.scales"):
        jaxmoe.from_pretrained(tmp_path / "b", layer=1)
    # packed expert weights without scales and without an override
    t3 = {k: v for k, v in t.items() if k != f"{p}.switch_mlp.up_proj.scales"}
    _write(tmp_path / "c", t3, cfg)
    with pytest.raises(ValueError, match=rf"{p}\.switch_mlp\.up_proj\.weight.*packed uint32"):
        jaxmoe.from_pretrained(tmp_path / "c", layer=1)
    # an override 'false' on a module that is stored quantized
    cfg4 = json.loads(json.dumps(cfg))
    cfg4["quantization"][f"{p}.shared_expert.up_proj"] = False
    _write(tmp_path / "d", t, cfg4)
    with pytest.raises(ValueError, match=rf"{p}\.shared_expert\.up_proj.*false"):
        jaxmoe.from_pretrained(tmp_path / "d", layer=1)
    # scales of the wrong shape name the tensor and both shapes
    t5 = dict(t)
    t5[f"{p}.switch_mlp.down_proj.scales"] = t[f"{p}.switch_mlp.down_proj.scales"][:, :, :0]
    _write(tmp_path / "e", t5, cfg)
    with pytest.raises(ValueError, match=rf"down_proj\.scales.*\({E}, {D}, 0\).*\({E}, {D}, 1\)"):
        jaxmoe.from_pretrained(tmp_path / "e", layer=1)
    # a quantization mode other than affine
    cfg6 = json.loads(json.dumps(cfg))
    cfg6["quantization"]["mode"] = "mxfp4"
    _write(tmp_path / "f", t, cfg6)
    with pytest.raises(ValueError, match="mxfp4"):
        jaxmoe.from_pretrained(tmp_path / "f", layer=1)
    # the intact checkpoint still loads (the errors above were about the edits)
    assert jaxmoe.load_config(tmp_path / "a").num_experts == E
    assert isinstance(jaxmoe.from_pretrained(tmp_path / "a", layer=0, impl="dense"), jaxmoe.MoEBlock)

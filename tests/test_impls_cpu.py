"""The C++ XLA:CPU kernel (``impl="cpu"``, jaxmoe/impls/cpu/grouped_swiglu.cc) against the
float64 numpy loop: register-tile and scalar column tails, the packed path (>= 8 rows of
one expert), row chunks (> 128 rows of one expert), empty experts, bf16, biases and the
gpt-oss activation; gradients (the gather path's VJP), vmap, errors and the build fallback.
Preset-level parity, NaN isolation and weight_on_input run in tests/test_impls.py."""

import dataclasses
import functools
import hashlib
import re

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from helpers import gguf_block_bytes, np_experts, params_to_numpy, random_params, shrink, skewed_routing
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxmoe
from jaxmoe import MoEConfig, RouterConfig, Routing
from jaxmoe.dispatch import plan_dispatch
from jaxmoe.experts import ExpertWeights
from jaxmoe.impls import policy
from jaxmoe.impls.common import combine, sorted_inputs
from jaxmoe.impls.cpu import build, cpu_kernel_status, experts_cpu, grouped_swiglu, supports
from jaxmoe.impls.cpu import kernel as cpu_kernel
from jaxmoe.impls.xla import experts_xla
from jaxmoe.io import mlx_codec
from jaxmoe.io.gguf_codec import q4_0_to_quantized, q8_0_to_quantized
from jaxmoe.quant import GGUF_BLOCKS, QuantizedTensor, gguf_block_tensor, quantize_int8

F32 = dict(rtol=2e-5, atol=2e-5)


def cfg_of(d, f, e, k, **kw):
    return MoEConfig(d_model=d, expert_dim=f, router=RouterConfig(num_experts=e, top_k=k), **kw)


def uniform_routing(rng, t, k, e):
    ids = np.stack([rng.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32)
    return ids, rng.uniform(0.05, 1.0, size=(t, k)).astype(np.float32)


def check(cfg, ids, ws, rng, dtype=jnp.float32, tol=F32):
    p = random_params(cfg, rng)
    x = rng.normal(size=(ids.shape[0], cfg.d_model)).astype(np.float32)
    y = experts_cpu(jnp.asarray(x, dtype), Routing(jnp.asarray(ids), jnp.asarray(ws)), p.experts, cfg)
    assert y.shape == x.shape and y.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y), np_experts(x, ids, ws, params_to_numpy(p), cfg), **tol)


def test_kernel_is_built():
    ok, msg = cpu_kernel_status()
    assert ok, msg  # CI machines have a C++ compiler; the fallback is tested below


@pytest.mark.parametrize("d, f", [(64, 32), (40, 24), (16, 8), (33, 7), (160, 144)])
@pytest.mark.parametrize("t", [1, 6, 37])
@pytest.mark.slow
def test_column_tails_and_tiles(d, f, t, rng):
    """Widths that fill 1-8 vectors of 16 lanes, leave scalar tails, or are under one vector."""
    cfg = cfg_of(d, f, 12, 3)
    check(cfg, *uniform_routing(rng, t, 3, 12), rng)


@pytest.mark.parametrize("t", [1, 7, 8, 9, 130, 300])
@pytest.mark.slow
def test_one_expert_takes_every_token(t, rng):
    """k = 1 onto one expert: the unpacked (< 8 rows), packed (>= 8) and row-chunked (> 128) paths."""
    cfg = cfg_of(48, 40, 8, 1)
    ids = np.full((t, 1), 5, np.int32)
    ws = rng.uniform(0.1, 1.0, size=(t, 1)).astype(np.float32)
    check(cfg, ids, ws, rng)


@pytest.mark.parametrize("t", [1, 13, 90])
def test_skewed_routing_with_empty_experts(t, rng):
    cfg = shrink(jaxmoe.load_config("qwen3-30b-a3b"), e=12)
    check(cfg, *skewed_routing(rng, t, cfg.top_k, cfg.num_experts), rng)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.slow
def test_few_row_orders_give_the_same_bits(dtype, rng):
    """Experts with 1, 2, 3, 5 and 9 rows at d = 1536: the kernel streams 1-2 rows of the
    down projection row by row, 3 (their 18 KiB of outputs past its L1 bound) and 5 in
    column strips, and packs 9. Each token's row matches the float64 loop and is the same
    bits as that token alone (one row: row by row)."""
    cfg = cfg_of(1536, 64, 5, 1)
    sizes = [1, 2, 3, 5, 9]
    ids = np.repeat(np.arange(5), sizes)[rng.permutation(sum(sizes))][:, None].astype(np.int32)
    ws = rng.uniform(0.1, 1.0, size=ids.shape).astype(np.float32)
    p = random_params(cfg, rng)
    ew = jax.tree.map(lambda w: w.astype(dtype), p.experts) if dtype == jnp.bfloat16 else p.experts
    x = rng.normal(size=(ids.shape[0], cfg.d_model)).astype(np.float32)
    run = jax.jit(lambda x, i, w: experts_cpu(x, Routing(i, w), ew, cfg))
    y = np.asarray(run(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(ws)))
    ref_p = params_to_numpy(dataclasses.replace(p, experts=ew))
    np.testing.assert_allclose(y, np_experts(x, ids, ws, ref_p, cfg), **F32)
    for r in range(ids.shape[0]):
        alone = np.asarray(run(jnp.asarray(x[r : r + 1]), jnp.asarray(ids[r : r + 1]), jnp.asarray(ws[r : r + 1])))
        np.testing.assert_array_equal(y[r], alone[0], err_msg=f"row {r} (expert {ids[r, 0]})")


@pytest.mark.slow
def test_biases_and_clamped_activation(rng):
    cfg = shrink(jaxmoe.load_config("gpt-oss-20b"), d=48, f=40)
    p = random_params(cfg, rng)
    assert p.experts.b_gate is not None and cfg.activation == "swiglu_oai"
    # large gate/up values, so the clamps at +-limit are exercised
    p = dataclasses.replace(
        p, experts=dataclasses.replace(p.experts, w_gate=p.experts.w_gate * 40, w_up=p.experts.w_up * 40)
    )
    t = 21
    ids, ws = uniform_routing(rng, t, cfg.top_k, cfg.num_experts)
    x = rng.normal(size=(t, cfg.d_model)).astype(np.float32)
    r = Routing(jnp.asarray(ids), jnp.asarray(ws))
    g = np.einsum("td,tkdf->tkf", x, np.asarray(p.experts.w_gate)[ids])
    assert (g > cfg.swiglu_limit).mean() > 0.05  # the clamp is hit
    y = experts_cpu(jnp.asarray(x), r, p.experts, cfg)
    ref = np_experts(x, ids, ws, params_to_numpy(p), cfg)
    np.testing.assert_allclose(np.asarray(y), ref, rtol=2e-5, atol=2e-5 * np.abs(ref).max())


@settings(max_examples=20, deadline=None)
@given(st.sampled_from([(16, 8), (24, 40), (64, 17)]), st.integers(1, 40), st.integers(1, 4), st.integers(0, 2**31 - 1))
@pytest.mark.slow
def test_hypothesis_shapes_and_routings(df, t, k, seed):
    d, f = df
    rng = np.random.default_rng(seed)
    e = 9
    cfg = cfg_of(d, f, e, k)
    if rng.random() < 0.5:
        ids, ws = skewed_routing(rng, t, k, e, share=0.9) if k > 1 else uniform_routing(rng, t, k, e)
    else:
        ids, ws = uniform_routing(rng, t, k, e)
    check(cfg, ids, ws, rng)


@pytest.mark.slow
def test_bf16_experts_match_xla(rng):
    """bf16 weights and activations: both paths upcast exactly and round h to bf16."""
    cfg = shrink(jaxmoe.load_config("qwen3.6-35b-a3b"), d=96, f=48)
    p = random_params(cfg, rng, jnp.bfloat16)
    t = 33
    ids, ws = uniform_routing(rng, t, cfg.top_k, cfg.num_experts)
    x = jnp.asarray(rng.normal(size=(t, cfg.d_model)), jnp.bfloat16)
    r = Routing(jnp.asarray(ids), jnp.asarray(ws))
    yc = np.asarray(experts_cpu(x, r, p.experts, cfg))
    yx = np.asarray(experts_xla(x, r, p.experts, cfg))
    ref = np_experts(np.asarray(x, np.float32), ids, ws, params_to_numpy(p), cfg)
    scale = np.abs(ref).max()
    np.testing.assert_allclose(yc, yx, rtol=0, atol=1e-2 * scale)
    np.testing.assert_allclose(yc, ref, rtol=0, atol=2e-2 * scale)


@pytest.mark.slow
def test_gradients_equal_the_dense_path(rng):
    cfg = shrink(jaxmoe.load_config("gpt-oss-20b"), d=32, f=24)
    p = random_params(cfg, rng)
    x = jnp.asarray(rng.normal(size=(7, cfg.d_model)), jnp.float32)
    cot = jnp.asarray(rng.normal(size=(7, cfg.d_model)), jnp.float32)

    def loss(impl):
        return lambda p, x: jnp.sum(jaxmoe.moe_apply(p, x, cfg, impl=impl) * cot)

    gc = jax.grad(loss("cpu"), argnums=(0, 1))(p, x)
    gx = jax.grad(loss("dense"), argnums=(0, 1))(p, x)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5), gc, gx)
    assert float(jnp.abs(gc[0].experts.w_down).max()) > 0  # the experts' gradient flows


def test_vmap_over_a_batch(rng):
    cfg = cfg_of(32, 16, 8, 2)
    p = random_params(cfg, rng)
    b, t = 3, 5
    ids = np.stack([uniform_routing(rng, t, 2, 8)[0] for _ in range(b)])
    ws = rng.uniform(0.1, 1, size=(b, t, 2)).astype(np.float32)
    x = rng.normal(size=(b, t, 32)).astype(np.float32)
    f = jax.vmap(lambda x, i, w: experts_cpu(x, Routing(i, w), p.experts, cfg))
    y = np.asarray(f(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(ws)))
    for i in range(b):
        np.testing.assert_allclose(y[i], np_experts(x[i], ids[i], ws[i], params_to_numpy(p), cfg), **F32)


def test_unsupported_experts_are_refused(rng):
    cfg = cfg_of(32, 16, 8, 2)
    p = random_params(cfg, rng)
    r = Routing(jnp.zeros((3, 2), jnp.int32), jnp.ones((3, 2)))
    with pytest.raises(ValueError, match="bfloat16"):
        experts_cpu(jnp.ones((3, 32), jnp.bfloat16), r, p.experts, cfg)
    with pytest.raises(ValueError, match="float16"):
        experts_cpu(jnp.ones((3, 32), jnp.float16), r, p.experts, cfg)


def test_without_a_compiler_auto_falls_back_and_cpu_says_why(monkeypatch, rng):
    cfg = cfg_of(32, 16, 8, 2)
    p = random_params(cfg, rng)
    r = Routing(jnp.zeros((3, 2), jnp.int32), jnp.ones((3, 2)))
    monkeypatch.setattr(build, "_status", None)
    monkeypatch.setattr(build, "_compiler", lambda: None)
    ok, msg = cpu_kernel_status()
    assert not ok and "no C++ compiler" in msg
    assert policy.resolve_impl("auto", 64, platform="cpu", experts=p.experts) == "xla"
    with pytest.raises(RuntimeError, match="impl='cpu' is unavailable: no C\\+\\+ compiler"):
        experts_cpu(jnp.ones((3, 32)), r, p.experts, cfg)


def test_a_failing_compiler_is_reported(monkeypatch, tmp_path):
    monkeypatch.setattr(build, "_status", None)
    monkeypatch.setenv("JAXMOE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    ok, msg = cpu_kernel_status()
    assert not ok and "compiling grouped_swiglu.cc failed" in msg and "false" in msg
    assert not list(tmp_path.glob("*.so"))  # nothing half-written is cached


# ----------------------------------------------------------------------------- quantized experts
# Formats: GGUF Q8_0 / Q4_0 bytes from gguf.quants (reference: gguf.quants.dequantize),
# MLX affine 4-bit uint32 words with float16 / bfloat16 / float32 scales (reference: a
# float64 unpack of the words here), jaxmoe's int8 with float32 scales, and plain floats.
FORMATS = ("q8_0", "q4_0_int4", "mlx4_g32", "mlx4_g64", "mlx4_g128", "int8_f32", "bf16", "f32")


def np_unpack_words(words: np.ndarray) -> np.ndarray:
    """MLX uint32 words ``[..., n/8]`` -> codes ``[..., n]`` (nibble j of a word = element 8w + j)."""
    shifts = np.arange(8, dtype=np.uint32) * 4
    return ((words[..., None] >> shifts) & 15).reshape(*words.shape[:-1], -1)


def make_weight(fmt: str, w: np.ndarray, rng):
    """Logical ``w [E, in, out]`` float32 -> (weight in ``fmt``, its float64 value [E, in, out]).
    ``q4_0_int4``: GGUF Q4_0 bytes as an int4 tensor (scale d, bias -8 d); ``q4_0`` the block kind."""
    t = np.ascontiguousarray(np.swapaxes(w, -1, -2))  # [E, out, in]: the stored orientation
    if fmt in ("q8_0", "q4_0_int4"):
        qt = gguf.GGMLQuantizationType.Q8_0 if fmt == "q8_0" else gguf.GGMLQuantizationType.Q4_0
        raw = gguf.quants.quantize(t, qt)
        qw = (q8_0_to_quantized if fmt == "q8_0" else q4_0_to_quantized)(raw)
        qw = QuantizedTensor(
            *(None if a is None else jnp.asarray(a) for a in (qw.qdata, qw.scales, qw.biases)), qw.kind, qw.group_size
        )
        ref = gguf.quants.dequantize(raw, qt).astype(np.float64)
    elif fmt.startswith("mlx4"):
        g = int(fmt.split("_g")[1])
        sdt = [np.float16, jnp.bfloat16, np.float32][int(rng.integers(3))]
        words, scales, biases = mlx_codec.quantize(t.astype(sdt), g)
        qw = mlx_codec.to_quantized_tensor(words, scales, biases, g)
        q = np_unpack_words(words).astype(np.float64)
        e, o, n = q.shape
        s64, b64 = (np.asarray(a, np.float64)[..., None] for a in (scales, biases))
        ref = (q.reshape(e, o, n // g, g) * s64 + b64).reshape(e, o, n)
    elif fmt == "int8_f32":
        qw = quantize_int8(w, 32, scale_dtype=np.float32)
        q = np.asarray(qw.qdata, np.float64)
        e, o, n = q.shape
        ref = (q.reshape(e, o, n // 32, 32) * np.asarray(qw.scales, np.float64)[..., None]).reshape(e, o, n)
    elif fmt in GGUF_BLOCKS:
        # Q4_1 / Q5_0 / Q5_1 / MXFP4 through gguf.quants.quantize of the floats; the K-quants
        # and IQ4 kinds (which gguf-py cannot quantize) as random valid blocks with scales
        # sized to the layer
        qt = QT[fmt.upper()]
        scale = float(np.abs(w).mean()) / 4
        raw = gguf_block_bytes(rng, qt, t.shape, d_range=(0.5 * scale / 8, 1.5 * scale / 8))
        if qt in (QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.MXFP4):
            raw = gguf.quants.quantize(t, qt)
        qw = gguf_block_tensor(jnp.asarray(raw), fmt, n_in=t.shape[-1], name=fmt)
        ref = gguf.quants.dequantize(raw, qt).astype(np.float64)
    elif fmt == "bf16":
        qw = jnp.asarray(w, jnp.bfloat16)
        return qw, np.asarray(qw, np.float64)
    else:
        return jnp.asarray(w), w.astype(np.float64)
    return qw, np.swapaxes(ref, -1, -2)


def quantized_case(cfg, fmts, rng, bias=False, gain=1.0):
    """Experts with gate/up/down in ``fmts`` and the float64 weights they stand for
    (gate and up drawn ``gain`` times larger)."""
    e, d, f = cfg.num_experts, cfg.d_model, cfg.expert_dim
    shapes = {"w_gate": (e, d, f), "w_up": (e, d, f), "w_down": (e, f, d)}
    ws, ref = {}, {}
    for (name, shape), fmt in zip(shapes.items(), fmts):
        g = gain if name != "w_down" else 1.0
        w = (g * rng.normal(size=shape) / np.sqrt(shape[1])).astype(np.float32)
        ws[name], ref[name] = make_weight(fmt, w, rng)
    if bias:
        for name, shape in (("b_gate", (e, f)), ("b_up", (e, f)), ("b_down", (e, d))):
            ws[name] = jnp.asarray(rng.normal(size=shape).astype(np.float32) * 0.1)
            ref[name] = np.asarray(ws[name], np.float64)
    return ExpertWeights(**ws), ref


def check_quantized(cfg, ew, ref, ids, ws, rng, dtype=jnp.float32, tol=1e-5):
    x = rng.normal(size=(ids.shape[0], cfg.d_model)).astype(np.float32)
    xin = jnp.asarray(x, dtype)
    y = experts_cpu(xin, Routing(jnp.asarray(ids), jnp.asarray(ws)), ew, cfg)
    assert y.shape == x.shape and y.dtype == jnp.float32
    want = np_experts(np.asarray(xin, np.float32), ids, ws, ref, cfg)
    scale = np.abs(want).max()
    np.testing.assert_allclose(np.asarray(y), want, rtol=0, atol=tol * scale)
    return np.asarray(y), want


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("d, f", [(128, 96), (256, 384)])
@pytest.mark.slow
def test_quantized_formats_match_float64(fmt, d, f, rng):
    """Every format read in place: the result is within float rounding of the float64
    forward of the dequantized weights (widths leaving partial column blocks)."""
    g = int(fmt.split("_g")[1]) if "_g" in fmt else 32
    f = -(-f // g) * g  # the group size must divide every input width
    cfg = cfg_of(d, f, 10, 3)
    ew, ref = quantized_case(cfg, (fmt,) * 3, rng)
    assert supports(ew, jnp.float32) is None
    check_quantized(cfg, ew, ref, *uniform_routing(rng, 9, 3, 10), rng, tol=2e-6 if fmt != "bf16" else 1e-5)


@pytest.mark.parametrize("t", [1, 7, 8, 9, 130])
@pytest.mark.parametrize(
    "fmts", [("q4_0_int4", "q4_0_int4", "q8_0"), ("mlx4_g64", "mlx4_g64", "mlx4_g64"), ("q8_0",) * 3]
)
@pytest.mark.slow
def test_quantized_one_expert_takes_every_token(t, fmts, rng):
    """k = 1 onto one expert: register dequantization (< 8 rows), the dequantized tile
    buffer (>= 8 rows) and row chunks (> 128 rows); gate/up Q4_0 with down Q8_0 mixes kinds."""
    cfg = cfg_of(128, 64, 6, 1)
    ew, ref = quantized_case(cfg, fmts, rng)
    ids = np.full((t, 1), 4, np.int32)
    check_quantized(cfg, ew, ref, ids, rng.uniform(0.1, 1.0, size=(t, 1)).astype(np.float32), rng, tol=2e-6)


@pytest.mark.parametrize(
    "fmts", [("bf16", "q4_0_int4", "q8_0"), ("q8_0", "f32", "mlx4_g32"), ("mlx4_g128", "q8_0", "bf16")]
)
def test_mixed_formats_and_empty_experts(fmts, rng):
    cfg = cfg_of(128, 128, 12, 4)
    ew, ref = quantized_case(cfg, fmts, rng)
    check_quantized(cfg, ew, ref, *skewed_routing(rng, 40, 4, 12), rng, tol=1e-5)


def test_quantized_biases_and_clamped_activation(rng):
    base = shrink(jaxmoe.load_config("gpt-oss-20b"), d=64, f=96)
    assert base.activation == "swiglu_oai" and base.expert_bias
    # large gate/up pre-activations (gain 30) so the clamps at +-limit are hit
    ew, ref = quantized_case(base, ("q4_0_int4", "mlx4_g32", "q8_0"), rng, bias=True, gain=30.0)
    ids, ws = uniform_routing(rng, 17, base.top_k, base.num_experts)
    x_probe = rng.normal(size=(4, base.d_model))
    assert (np.abs(x_probe @ ref["w_gate"][0]) > base.swiglu_limit).mean() > 0.05  # the clamp is hit
    y, _ = check_quantized(base, ew, ref, ids, ws, rng, tol=2e-5)
    assert np.isfinite(y).all()


def test_quantized_with_bf16_activations(rng):
    """bf16 activations: the kernel keeps the dequantized weights in float32 and rounds
    h to bfloat16 (as the bf16 compute dtype does), so it is within bf16 rounding."""
    cfg = cfg_of(128, 64, 8, 2)
    ew, ref = quantized_case(cfg, ("q4_0_int4", "q4_0_int4", "q8_0"), rng)
    assert supports(ew, jnp.bfloat16) is None
    check_quantized(cfg, ew, ref, *uniform_routing(rng, 21, 2, 8), rng, dtype=jnp.bfloat16, tol=2e-2)


def test_column_tails_of_quantized_blocks(rng):
    """Task blocks of 7 and 5 columns: dot tiles of 4 / 2 columns plus single-column tails."""
    assert cpu_kernel_status()[0]  # grouped_swiglu itself does not build the kernel
    cfg = cfg_of(64, 96, 5, 2)
    ew, ref = quantized_case(cfg, ("mlx4_g32", "q8_0", "q4_0_int4"), rng)
    for t in (3, 11):
        ids, ws = uniform_routing(rng, t, 2, 5)
        x = rng.normal(size=(t, 64)).astype(np.float32)
        plan = plan_dispatch(jnp.asarray(ids), 5, 1)
        r = Routing(jnp.asarray(ids), jnp.asarray(ws))
        xs = sorted_inputs(jnp.asarray(x), r, plan, cfg)
        ys = grouped_swiglu(xs, plan.group_offsets[:5], plan.group_sizes, ew, cfg, blocks=(7, 5))
        y = combine(ys, r, plan, cfg)
        want = np_experts(x, ids, ws, ref, cfg)
        np.testing.assert_allclose(np.asarray(y), want, rtol=0, atol=2e-6 * np.abs(want).max())


@settings(max_examples=15, deadline=None)
@given(
    st.sampled_from([(32, 64), (64, 32), (96, 128)]),
    st.integers(1, 40),
    st.integers(1, 3),
    st.sampled_from(FORMATS[:5]),
    st.sampled_from(FORMATS[:5]),
    st.integers(0, 2**31 - 1),
)
@pytest.mark.slow
def test_hypothesis_quantized_shapes_and_routings(df, t, k, fmt_up, fmt_down, seed):
    d, f = df
    rng = np.random.default_rng(seed)
    if "g64" in fmt_up + fmt_down or "g128" in fmt_up + fmt_down:
        d, f = 128, 128
    cfg = cfg_of(d, f, 7, k)
    ew, ref = quantized_case(cfg, (fmt_up, fmt_up, fmt_down), rng)
    ids, ws = skewed_routing(rng, t, k, 7, share=0.9) if k > 1 and rng.random() < 0.5 else uniform_routing(rng, t, k, 7)
    check_quantized(cfg, ew, ref, ids, ws, rng, tol=5e-6)


@pytest.mark.parametrize("what", ["nibble", "scale"])
def test_a_mutated_code_or_scale_is_caught(what, rng):
    """The comparison is sharp enough to see one changed nibble or scale of a used expert."""
    cfg = cfg_of(64, 64, 4, 1)
    ew, ref = quantized_case(cfg, ("q4_0_int4", "q4_0_int4", "q4_0_int4"), rng)
    ids = np.full((5, 1), 2, np.int32)
    ws = np.ones((5, 1), np.float32)
    check_quantized(cfg, ew, ref, ids, ws, np.random.default_rng(1), tol=2e-6)  # unmutated: passes
    w = ew.w_down
    if what == "nibble":
        q = np.asarray(w.qdata).copy()
        q[2, 7, 3] ^= 0x40  # one high nibble of expert 2's down projection
        w = dataclasses.replace(w, qdata=jnp.asarray(q))
    else:
        s = np.asarray(w.scales).copy()
        s[2, 5, 1] *= 1.5
        w = dataclasses.replace(w, scales=jnp.asarray(s))
    with pytest.raises(AssertionError):
        check_quantized(cfg, dataclasses.replace(ew, w_down=w), ref, ids, ws, np.random.default_rng(1), tol=2e-6)


def test_auto_takes_cpu_for_quantized_experts(rng):
    cfg = cfg_of(64, 64, 4, 2)
    ew, _ = quantized_case(cfg, ("q4_0_int4", "mlx4_g64", "q8_0"), rng)
    assert policy.resolve_impl("auto", 64, platform="cpu", experts=ew) == "cpu"
    assert policy.resolve_impl("auto", 2, platform="cpu", experts=ew) == "cpu"


def test_unsupported_quantized_weights_say_why(rng):
    cfg = cfg_of(64, 64, 4, 2)
    ew, _ = quantized_case(cfg, ("q8_0",) * 3, rng)
    g16 = quantize_int8(np.asarray(rng.normal(size=(4, 64, 64)), np.float32), 16)
    why = supports(dataclasses.replace(ew, w_up=g16), jnp.float32)
    assert why and "w_up" in why and "group size 16" in why
    r = Routing(jnp.zeros((3, 2), jnp.int32), jnp.ones((3, 2)))
    with pytest.raises(ValueError, match="w_up.*group size 16"):
        experts_cpu(jnp.ones((3, 64)), r, dataclasses.replace(ew, w_up=g16), cfg)
    f16 = dataclasses.replace(ew, w_gate=jnp.zeros((4, 64, 64), jnp.float16))
    assert "w_gate is float16" in supports(f16, jnp.float32)


def test_unsorted_or_overlapping_group_ranges_are_rejected(rng):
    assert cpu_kernel_status()[0]  # grouped_swiglu itself does not build the kernel
    cfg = cfg_of(32, 32, 3, 1)
    ew, _ = quantized_case(cfg, ("f32",) * 3, rng)
    xs = jnp.asarray(rng.normal(size=(6, 32)).astype(np.float32))
    ok = grouped_swiglu(xs, jnp.array([0, 2, 4]), jnp.array([2, 2, 2]), ew, cfg)
    assert np.isfinite(np.asarray(ok)).all()
    for offsets, sizes, msg in (
        ([0, 1, 4], [2, 2, 2], "sorted by expert and disjoint"),  # overlap
        ([4, 0, 2], [2, 2, 2], "sorted by expert and disjoint"),  # unsorted
        ([0, 2, 5], [2, 2, 2], "outside xs"),
    ):
        with pytest.raises(Exception, match=msg):
            jax.block_until_ready(grouped_swiglu(xs, jnp.array(offsets), jnp.array(sizes), ew, cfg))


def test_the_combines_operands_are_checked(rng):
    """The call's combine refuses a sorted row outside xs, a wrong count of rows or weights,
    and a token count that does not divide the rows, naming the operand."""
    assert cpu_kernel_status()[0]
    cfg = cfg_of(32, 32, 3, 2)
    ew, _ = quantized_case(cfg, ("f32",) * 3, rng)
    xs = jnp.asarray(rng.normal(size=(6, 32)).astype(np.float32))
    offsets, sizes = jnp.array([0, 2, 4]), jnp.array([2, 2, 2])
    w = jnp.asarray(rng.uniform(size=(3, 2)).astype(np.float32))

    def run(inv, w, tokens):
        args = (xs, offsets, sizes, ew, cfg, False, 8, 8, False)
        return jax.block_until_ready(cpu_kernel._call(*args, to_tokens=(jnp.asarray(inv), w, tokens))[0])

    ys = np.asarray(grouped_swiglu(xs, offsets, sizes, ew, cfg))
    inv = np.array([3, 0, 5, 1, 2, 4], np.int32)
    got = np.asarray(run(inv, w, 3))
    want = (ys[inv].reshape(3, 2, 32) * np.asarray(w)[..., None]).sum(axis=1)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for bad, ww, tokens, msg in (
        ([3, 0, 6, 1, 2, 4], w, 3, r"inv\[2\] = 6 is outside the sorted rows \[0, 6\)"),
        ([3, 0, -1, 1, 2, 4], w, 3, r"inv\[2\] = -1 is outside"),
        ([3, 0, 5, 1, 2], w, 3, "inv must hold one sorted row per pair: 6 entries, got 5"),
        (inv, w[:2], 3, r"w must be \[T k\] = \[6\] or empty, got 4 entries"),
        (inv, w, 4, "y must be \\[T, d\\] with T dividing the 6 rows"),
    ):
        with pytest.raises(Exception, match=msg):
            run(bad, ww, tokens)


# ----------------------------------------------------------------------------- build hygiene
FAKE_CXX = """#!/bin/sh
[ "$1" = "--version" ] && {{ echo fake 1; exit 0; }}
echo call >> {log}
sleep {sleep}
while [ $# -gt 0 ]; do [ "$1" = "-o" ] && {{ echo not-a-real-library > "$2"; }}; shift; done
"""


def fake_compiler(tmp_path, sleep=0):
    cxx = tmp_path / "fakecxx"
    cxx.write_text(FAKE_CXX.format(log=tmp_path / "calls", sleep=sleep))
    cxx.chmod(0o755)
    return str(cxx)


def test_cached_library_is_verified_by_its_hash(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXMOE_CACHE_DIR", str(tmp_path / "cache"))
    cxx = fake_compiler(tmp_path)
    lib = build.build_library(cxx)
    assert lib.with_suffix(".sha256").read_text().strip() == hashlib.sha256(lib.read_bytes()).hexdigest()
    assert build.build_library(cxx) == lib and (tmp_path / "calls").read_text().count("call") == 1  # cached
    lib.write_bytes(b"tampered")
    assert build.build_library(cxx) == lib  # the mismatch is rebuilt, not loaded
    assert (tmp_path / "calls").read_text().count("call") == 2 and lib.read_bytes() != b"tampered"


def test_compiler_calls_time_out(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXMOE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("JAXMOE_CXX_TIMEOUT", "0.5")
    with pytest.raises(RuntimeError, match="did not finish within"):
        build.build_library(fake_compiler(tmp_path, sleep=5))


def test_the_compile_holds_no_lock(monkeypatch):
    seen = []

    def slow_build(cxx, source=build.SOURCE):
        seen.append(build._lock.locked())
        raise RuntimeError("fake failure")

    monkeypatch.setattr(build, "_status", None)
    monkeypatch.setattr(build, "build_library", slow_build)
    assert cpu_kernel_status() == (False, "fake failure")
    assert seen == [False]


# ----------------------------------------------------------------------------- GGUF block kinds
# Raw GGUF blocks (jaxmoe.quant.GGUF_BLOCKS) read by the kernel; reference: a float64 loop
# over gguf.quants.dequantize of the same bytes.
BLOCK_KINDS = tuple(GGUF_BLOCKS)
Q4_K_M = ("q4_k", "q4_k", "q6_k")


def block_width(fmts) -> int:
    """The smallest input width every format in ``fmts`` divides."""
    return max(GGUF_BLOCKS[f][0] if f in GGUF_BLOCKS else int(f.split("_g")[1]) if "_g" in f else 32 for f in fmts)


#: The IQ1-3 / TQ kinds (iq_kinds.h): slow here, tests/test_quant_iq.py runs them in the quick subset.
_IQ = ("iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m", "tq1_0", "tq2_0")


@pytest.mark.parametrize("fmt", [pytest.param(k, marks=pytest.mark.slow) if k in _IQ else k for k in BLOCK_KINDS])
@pytest.mark.parametrize("t", [1, 9])
def test_block_kinds_match_float64(fmt, t, rng):
    """Every GGUF block kind, in place: within float rounding of the float64 forward of
    gguf's dequantized weights (F = 96 columns for 32-blocks: 4-column tiles + tails)."""
    b = GGUF_BLOCKS[fmt][0]
    d, f = (256, 256) if b == 256 else (64, 96)
    cfg = cfg_of(d, f, 10, 3)
    ew, ref = quantized_case(cfg, (fmt,) * 3, rng)
    assert supports(ew, jnp.float32) is None
    check_quantized(cfg, ew, ref, *uniform_routing(rng, t, 3, 10), rng, tol=2e-6)


@pytest.mark.parametrize("t", [1, 7, 8, 9, 130])
@pytest.mark.parametrize("fmts", [Q4_K_M, ("q5_0", "q5_1", "q4_1"), ("q5_k", "q8_0", "q5_k")])
def test_block_kinds_one_expert_takes_every_token(t, fmts, rng):
    """k = 1 onto one expert: block decode inside the tiles (< 8 rows), the decoded tile
    buffer (>= 8 rows) and row chunks (> 128 rows); Q4_K_M's q4_k gate/up with q6_k down."""
    w = block_width(fmts)
    cfg = cfg_of(w, w, 5, 1)
    ew, ref = quantized_case(cfg, fmts, rng)
    ids = np.full((t, 1), 3, np.int32)
    check_quantized(cfg, ew, ref, ids, rng.uniform(0.1, 1.0, size=(t, 1)).astype(np.float32), rng, tol=2e-6)


@pytest.mark.parametrize("fmts", [("q4_k", "q5_0", "q8_0"), ("bf16", "q6_k", "q5_k"), ("q5_1", "mlx4_g64", "q4_1")])
def test_mixed_block_kinds_and_empty_experts(fmts, rng):
    w = block_width(fmts)
    cfg = cfg_of(w, w, 12, 4)
    ew, ref = quantized_case(cfg, fmts, rng)
    check_quantized(cfg, ew, ref, *skewed_routing(rng, 40, 4, 12), rng, tol=1e-5)


def test_block_kinds_with_biases_and_clamped_activation(rng):
    base = shrink(jaxmoe.load_config("gpt-oss-20b"), d=256, f=256)
    assert base.activation == "swiglu_oai" and base.expert_bias
    ew, ref = quantized_case(base, ("q4_k", "q5_1", "q6_k"), rng, bias=True, gain=30.0)
    x_probe = rng.normal(size=(4, base.d_model))
    assert (np.abs(x_probe @ ref["w_gate"][0]) > base.swiglu_limit).mean() > 0.05  # the clamp is hit
    y, _ = check_quantized(base, ew, ref, *uniform_routing(rng, 11, base.top_k, base.num_experts), rng, tol=2e-5)
    assert np.isfinite(y).all()


def test_block_kinds_with_bf16_activations(rng):
    cfg = cfg_of(256, 256, 6, 2)
    ew, ref = quantized_case(cfg, Q4_K_M, rng)
    assert supports(ew, jnp.bfloat16) is None
    check_quantized(cfg, ew, ref, *uniform_routing(rng, 13, 2, 6), rng, dtype=jnp.bfloat16, tol=2e-2)


def test_column_tails_of_block_kinds(rng):
    """Task blocks of 7 and 5 columns: 4 / 2-column block tiles plus single-column tails."""
    assert cpu_kernel_status()[0]  # grouped_swiglu itself does not build the kernel
    cfg = cfg_of(256, 96, 5, 2)
    ew, ref = quantized_case(cfg, ("q4_k", "q5_0", "q4_1"), rng)
    for t in (3, 11):
        ids, ws = uniform_routing(rng, t, 2, 5)
        x = rng.normal(size=(t, 256)).astype(np.float32)
        plan = plan_dispatch(jnp.asarray(ids), 5, 1)
        r = Routing(jnp.asarray(ids), jnp.asarray(ws))
        xs = sorted_inputs(jnp.asarray(x), r, plan, cfg)
        ys = grouped_swiglu(xs, plan.group_offsets[:5], plan.group_sizes, ew, cfg, blocks=(7, 5))
        y = combine(ys, r, plan, cfg)
        want = np_experts(x, ids, ws, ref, cfg)
        np.testing.assert_allclose(np.asarray(y), want, rtol=0, atol=2e-6 * np.abs(want).max())


@settings(max_examples=6, deadline=None)
@given(
    st.integers(1, 3),
    st.integers(1, 40),
    st.integers(1, 3),
    st.sampled_from(BLOCK_KINDS),
    st.sampled_from(BLOCK_KINDS + ("q8_0",)),
    st.integers(0, 2**31 - 1),
)
def test_hypothesis_block_kinds_shapes_and_routings(nf, t, k, fmt_up, fmt_down, seed):
    rng = np.random.default_rng(seed)
    d = block_width((fmt_up,))
    f = nf * block_width((fmt_down,))
    cfg = cfg_of(d, f, 7, k)
    ew, ref = quantized_case(cfg, (fmt_up, fmt_up, fmt_down), rng)
    ids, ws = skewed_routing(rng, t, k, 7, share=0.9) if k > 1 and rng.random() < 0.5 else uniform_routing(rng, t, k, 7)
    check_quantized(cfg, ew, ref, ids, ws, rng, tol=5e-6)


@pytest.mark.parametrize(
    "fmt, byte",
    [("q4_k", 16 + 37), ("q4_k", 5), ("q6_k", 11), ("q6_k", 196), ("q5_0", 9), ("q5_1", 0)]
    + [("q2_k", 16 + 21), ("q2_k", 81), ("q3_k", 40), ("q3_k", 5), ("q3_k", 100), ("iq4_nl", 7), ("iq4_nl", 1)]
    + [("iq4_xs", 8 + 50), ("iq4_xs", 5), ("iq4_xs", 2), ("mxfp4", 9), ("mxfp4", 0)],
)
@pytest.mark.parametrize("t", [2, 9])
def test_a_mutated_block_byte_is_caught(fmt, byte, t, rng):
    """One nibble / packed scale / fp16 scale byte of one block of a used expert changed:
    the comparison sees it, on both the in-tile (2 rows) and tile-buffer (9 rows) paths."""
    w = block_width((fmt,))
    cfg = cfg_of(w, w, 4, 1)
    ew, ref = quantized_case(cfg, (fmt,) * 3, rng)
    ids = np.full((t, 1), 2, np.int32)
    ws = np.ones((t, 1), np.float32)
    check_quantized(cfg, ew, ref, ids, ws, np.random.default_rng(1), tol=2e-6)  # unmutated: passes
    q = np.asarray(ew.w_down.qdata).copy()
    q[2, 7, byte] ^= 0x11  # row 7 of expert 2's down projection (one block per row)
    bad = dataclasses.replace(ew, w_down=gguf_block_tensor(jnp.asarray(q), fmt))
    with pytest.raises(AssertionError):
        check_quantized(cfg, bad, ref, ids, ws, np.random.default_rng(1), tol=2e-6)


def test_bad_block_buffers_are_refused_before_running(rng):
    """A wrong-sized block buffer, a truncated one, an unknown kind: ValueError naming the
    tensor, the kind and the shapes, before the custom call."""
    cfg = cfg_of(256, 256, 4, 2)
    ew, _ = quantized_case(cfg, Q4_K_M, rng)
    r = Routing(jnp.zeros((3, 2), jnp.int32), jnp.ones((3, 2)))
    x = jnp.ones((3, 256))
    wide_up = gguf_block_tensor(jnp.concatenate([ew.w_up.qdata, ew.w_up.qdata], axis=-1), "q4_k")  # in 512
    wide_down = gguf_block_tensor(jnp.concatenate([ew.w_down.qdata, ew.w_down.qdata], axis=-1), "q6_k")
    for name, w, pattern in (
        ("w_up", wide_up, r"w_up \(Q4_K, block 256 in 144 bytes\) of bytes \(4, 256, 288\).*input width 256"),
        ("w_down", wide_down, r"w_down \(Q6_K, block 256 in 210 bytes\) of bytes \(4, 256, 420\).*width 256"),
    ):
        bad = dataclasses.replace(ew, **{name: w})
        why = supports(bad, jnp.float32)
        assert why and re.search(pattern, why), why
        with pytest.raises(ValueError, match=pattern):
            experts_cpu(x, r, bad, cfg)
    with pytest.raises(ValueError, match=r"blk\.3\.ffn_down_exps.*Q6_K.*\(4, 256, 209\).*truncated"):
        gguf_block_tensor(jnp.asarray(ew.w_down.qdata)[..., :-1], "q6_k", name="blk.3.ffn_down_exps")
    with pytest.raises(ValueError, match=r"Q6_K.*\(4, 256, 209\).*truncated"):
        dataclasses.replace(ew.w_down, qdata=jnp.asarray(ew.w_down.qdata)[..., :-1])
    with pytest.raises(ValueError, match=r"Q3_K.*\(4, 256, 210\)"):
        gguf_block_tensor(ew.w_down.qdata, "Q3_K", name="w_down")
    with pytest.raises(ValueError, match="unknown 'nvfp4'"):
        QuantizedTensor(ew.w_down.qdata, None, None, "nvfp4", 256)
    # the C++ side checks the same when the custom call is used directly
    xs = jnp.ones((4, 256), jnp.float32)
    with pytest.raises(Exception, match=r"w_up: GGUF kind 6 \(block 256 in 144 bytes\), logical \[4, 256, 256\]"):
        bad = dataclasses.replace(ew, w_up=wide_up)
        jax.block_until_ready(grouped_swiglu(xs, jnp.array([0, 1, 2, 3]), jnp.ones(4, jnp.int32), bad, cfg))


def test_auto_takes_cpu_for_block_kinds(rng):
    cfg = cfg_of(256, 256, 4, 2)
    ew, _ = quantized_case(cfg, Q4_K_M, rng)
    assert policy.resolve_impl("auto", 1, platform="cpu", experts=ew) == "cpu"
    assert policy.resolve_impl("auto", 64, platform="cpu", experts=ew) == "cpu"


# ----------------------------------------------------------------------------- quantized shared expert


def quantized_shared(d, fs, fmts, rng):
    """A gated shared expert with gate/up/down in ``fmts`` (2-D weights, as a GGUF file's
    ``ffn_*_shexp``) and the float64 matrices it stands for."""
    cfg1 = cfg_of(d, fs, 1, 1)
    ew, ref = quantized_case(cfg1, fmts, rng)
    first = lambda w: jax.tree.map(lambda a: a[0], w)  # noqa: E731
    gate = rng.normal(size=(d,)).astype(np.float32) / np.sqrt(d)
    sw = jaxmoe.SharedWeights(first(ew.w_gate), first(ew.w_up), first(ew.w_down), jnp.asarray(gate))
    return sw, {k: ref[k][0] for k in ("w_gate", "w_up", "w_down")}, gate.astype(np.float64)


def np_shared(x, ref, gate):
    x = np.asarray(x, np.float64)
    g, u = x @ ref["w_gate"], x @ ref["w_up"]
    return ((g / (1 + np.exp(-g)) * u) @ ref["w_down"]) / (1 + np.exp(-(x @ gate)))[:, None]


@pytest.mark.parametrize("fmts", [("q8_0", "q4_0_int4", "mlx4_g64"), Q4_K_M, ("q5_0", "q5_k", "q4_1"), ("bf16",) * 3])
@pytest.mark.parametrize("t", [1, 11])
@pytest.mark.slow
def test_quantized_shared_expert_in_the_kernel(fmts, t, rng):
    """A quantized (a GGUF file's ``ffn_*_shexp``) or bfloat16-stored shared expert runs in
    the C++ kernel, read in its stored format, within float rounding of the float64 forward
    of its dequantized matrices; ``moe_apply(auto)`` takes it there (one kernel call for the
    routed and the shared expert, no float copy of the shared matrices) and adds exactly
    that to the routed output."""
    from jaxmoe.impls.cpu import shared_expert_cpu, shared_supported

    w = block_width(fmts)
    cfg = dataclasses.replace(cfg_of(w, w, 6, 2), shared_expert_dim=w, num_shared_experts=1, shared_expert_gate=True)
    sw, ref, gate = quantized_shared(w, w, fmts, rng)
    assert shared_supported(sw, jnp.float32)
    x = rng.normal(size=(t, w)).astype(np.float32)
    want = np_shared(x, ref, gate)
    got = np.asarray(jax.jit(shared_expert_cpu, static_argnums=2)(jnp.asarray(x), sw, cfg))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())

    p = dataclasses.replace(random_params(cfg, rng), shared=sw)
    run = jax.jit(lambda p, x: jaxmoe.moe_apply(p, x, cfg, impl="auto"))
    hlo = run.lower(p, jnp.asarray(x)).compile().as_text()
    assert hlo.count(f'custom_call_target="{build.TARGET_SHARED}"') == 1, "routed + shared in one kernel call"
    assert hlo.count(f'custom_call_target="{build.TARGET}"') == 0
    routed = jaxmoe.moe_apply(dataclasses.replace(p, shared=None), jnp.asarray(x), cfg, impl="cpu")
    np.testing.assert_allclose(
        np.asarray(run(p, jnp.asarray(x))) - np.asarray(routed), want, rtol=0, atol=1e-5 * np.abs(want).max()
    )


@pytest.mark.parametrize("fmts", [("q8_0", "q4_0_int4", "mlx4_g64"), ("bf16",) * 3])
@pytest.mark.slow
def test_shared_expert_in_the_routed_call_gradients(fmts, rng):
    """``jax.grad`` through ``moe_apply(impl="cpu")`` with the shared expert in the routed
    experts' kernel call (`experts_shared_cpu`): the gradients of x, the router, the shared
    gate and (bfloat16-stored) the shared matrices equal those through ``gather``, whose
    shared expert is XLA's; quantized shared matrices stay frozen."""
    w = block_width(fmts)
    cfg = dataclasses.replace(cfg_of(w, w, 6, 2), shared_expert_dim=w, num_shared_experts=1, shared_expert_gate=True)
    sw, _, _ = quantized_shared(w, w, fmts, rng)
    p0 = dataclasses.replace(random_params(cfg, rng), shared=sw)
    x = jnp.asarray(rng.normal(size=(9, w)).astype(np.float32))
    ct = jnp.asarray(rng.normal(size=(9, w)).astype(np.float32))
    trainable = fmts[0] == "bf16"

    def loss(impl, x, w_router, gate, mats):
        shared = dataclasses.replace(sw, gate=gate, **mats)
        p = dataclasses.replace(p0, w_router=w_router, shared=shared)
        return jnp.sum(jaxmoe.moe_apply(p, x, cfg, impl=impl) * ct)

    mats = {k: getattr(sw, k) for k in ("w_gate", "w_up", "w_down")} if trainable else {}
    args = (x, p0.w_router, sw.gate, mats)
    grad = {i: jax.jit(jax.grad(functools.partial(loss, i), argnums=(0, 1, 2, 3))) for i in ("cpu", "gather")}
    hlo = grad["cpu"].lower(*args).compile().as_text()
    assert hlo.count(f'custom_call_target="{build.TARGET_SHARED}"') == 1, "the fused forward"
    got, want = grad["cpu"](*args), grad["gather"](*args)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        tol = 1e-2 if g.dtype == jnp.bfloat16 else 2e-5  # bfloat16 gradients of bfloat16 matrices
        g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
        np.testing.assert_allclose(g, r, rtol=0, atol=tol * np.abs(r).max())
    assert len(jax.tree.leaves(got[3])) == (3 if trainable else 0)


def test_routed_and_shared_call_names_bad_shared_operands(rng):
    """The routed + shared custom call checks the shared expert's own operands before it
    runs and names the one at fault: a gate of the wrong length, rows of the wrong width,
    gate rows ``gx`` of the wrong shape, a combine over another token count than the shared
    expert's rows (and the routed experts' operands keep their checks)."""
    from jaxmoe.impls.cpu import kernel

    assert cpu_kernel_status()[0]  # registers the handlers
    cfg = dataclasses.replace(cfg_of(64, 64, 3, 1), shared_expert_dim=64, num_shared_experts=1, shared_expert_gate=True)
    ew, _ = quantized_case(cfg, ("f32",) * 3, rng)
    sw, _, _ = quantized_shared(64, 64, ("q8_0", "q4_0_int4", "q8_0"), rng)
    xs = jnp.asarray(rng.normal(size=(6, 64)).astype(np.float32))
    x = xs[:3]
    offsets, sizes = jnp.array([0, 2, 4]), jnp.array([2, 2, 2])
    inv = jnp.asarray(rng.permutation(6).astype(np.int32))

    def run(x, sw, offsets=offsets, gx=None, tokens=3, pairs=None):
        out = kernel._call(
            xs,
            offsets,
            sizes,
            ew,
            cfg,
            False,
            kernel.UP_BLOCK,
            kernel.DOWN_BLOCK,
            False,
            shared=(x, sw, gx),
            to_tokens=(inv[: 2 * tokens] % 6 if pairs is None else pairs, None, tokens),
        )
        return jax.block_until_ready(out[2])

    assert np.isfinite(run(x, sw)).all()
    long_gate = jnp.asarray(rng.normal(size=(65,)).astype(np.float32))
    for x_bad, sw_bad, offs, gx, tokens, msg in (
        (x, dataclasses.replace(sw, gate=long_gate), offsets, None, 3, r"shared gate must be \[d\] or empty, d = 64"),
        (jnp.concatenate([x, x], axis=1), sw, offsets, None, 3, r"shared expert's x must be \[T, d\] with d = 64"),
        (x, sw, jnp.array([0, 1, 4]), None, 3, "sorted by expert and disjoint"),
        (x, sw, offsets, xs[:4], 3, r"gate's rows gx must be \[T, d\] = \[3, 64\]"),
        (x, sw, offsets, None, 2, "the combine's inv must hold one sorted row per pair"),
    ):
        with pytest.raises(Exception, match=msg):
            run(x_bad, sw_bad, offs, gx, tokens)
    # a combine of 6 tokens (k = 1) with the shared expert's 3 rows
    with pytest.raises(Exception, match="the combine's y has 6 tokens but the shared expert's x has 3"):
        run(x, sw, tokens=6, pairs=inv)


@pytest.mark.slow
def test_quantized_shared_expert_outside_the_kernel_stays_xla(rng):
    """Reference impls keep the XLA shared expert (no kernel call), with the same result;
    a kind the kernel does not read is refused by ``shared_supported`` (XLA takes it)."""
    from jaxmoe.impls.cpu import shared_supported

    cfg = dataclasses.replace(cfg_of(64, 64, 6, 2), shared_expert_dim=64, num_shared_experts=1, shared_expert_gate=True)
    sw, ref, gate = quantized_shared(64, 64, ("q8_0", "q4_0_int4", "q8_0"), rng)
    p = dataclasses.replace(random_params(cfg, rng), shared=sw)
    x = jnp.asarray(rng.normal(size=(5, 64)).astype(np.float32))
    hlo = jax.jit(lambda p, x: jaxmoe.moe_apply(p, x, cfg, impl="gather")).lower(p, x).as_text()
    assert build.TARGET not in hlo
    y_gather = jaxmoe.moe_apply(p, x, cfg, impl="gather")
    y_auto = jaxmoe.moe_apply(p, x, cfg, impl="auto")
    np.testing.assert_allclose(np.asarray(y_auto), np.asarray(y_gather), rtol=2e-5, atol=2e-5)
    odd = dataclasses.replace(sw, w_down=quantize_int8(ref["w_down"].astype(np.float32), group_size=16))
    assert not shared_supported(odd, jnp.float32)  # group 16: the kernel takes multiples of 32
    y_odd = jaxmoe.moe_apply(dataclasses.replace(p, shared=odd), x, cfg, impl="auto")
    np.testing.assert_allclose(np.asarray(y_odd), np.asarray(y_auto), rtol=0, atol=0.05 * np.abs(y_auto).max())


@pytest.mark.parametrize("weight_on_input", [False, True])
@given(t=st.integers(1, 40), seed=st.integers(0, 2**31 - 1))
@settings(max_examples=8, deadline=None)
def test_the_call_combines_as_the_invariant_combine(weight_on_input, t, seed):
    """The rows combined back to tokens inside the call are the bits of `combine`'s
    batch-invariant form over the call's sorted rows: slots added in order, a dropped pair
    (id outside ``[0, E)``) adding exactly +0 whatever its row holds, the routing weights
    applied unless they were applied on the input."""
    rng = np.random.default_rng(seed)
    cfg = cfg_of(64, 32, 6, 3, weight_on_input=weight_on_input)
    p = random_params(cfg, rng)
    ids, ws = uniform_routing(rng, t, 3, 6)
    ids[rng.random(ids.shape) < 0.2] = 6  # dropped pairs
    ws[rng.random(ws.shape) < 0.2] *= -1.0  # signed products: zero sums keep their sign rule
    x = jnp.asarray(rng.normal(size=(t, 64)).astype(np.float32))
    r = Routing(jnp.asarray(ids), jnp.asarray(ws))
    got = np.asarray(jax.jit(lambda x, r: experts_cpu(x, r, p.experts, cfg))(x, r))  # jit: ids unchecked
    plan = plan_dispatch(r.expert_ids, 6, 1)
    xs = sorted_inputs(x, r, plan, cfg)
    ys = grouped_swiglu(xs, plan.group_offsets[:6], plan.group_sizes, p.experts, cfg)
    want = np.asarray(jax.jit(lambda ys: combine(ys, r, plan, cfg, invariant=True))(ys))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))

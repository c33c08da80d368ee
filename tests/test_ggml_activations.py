"""``ExecConfig(activations="ggml")``: llama.cpp's activation arithmetic in the XLA strategies.

References, both independent of `jaxmoe.ggml_activations`:
- `jaxmoe.evaluation.reference.ggml_blocks_np`, a numpy float32 port of ggml-cpu's x86
  ``quantize_row_q8_0`` / ``quantize_row_q8_1`` / ``quantize_row_q8_K_ref`` (hypothesis
  draws the rows: codes and scales must be equal);
- a float64 loop here over the weights gguf-py decodes, with the activations converted by
  that port and the Q4_1 / Q5_1 minimum meeting the stored block sum ``s``.

A hidden activation that sits within a hair of a rounding boundary may take either code
(its float32 value depends on the summation order): `ggml_layer` returns, per output, the
slack such codes can make, and the tests allow exactly that on top of float32 rounding.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import gguf_block_weight, random_params, shrink
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxmoe import ExecConfig, moe_apply
from jaxmoe.config import load_config
from jaxmoe.evaluation.reference import (
    act_f64,
    dot_f64,
    ggml_blocks_np,
    ggml_format,
    ggml_quantize_np,
    route_f64,
    router_logits_f64,
    to_f64,
)
from jaxmoe.experts import ExpertWeights, SharedWeights
from jaxmoe.ggml_activations import ggml_round, quantize_q8_0, quantize_q8_1, quantize_q8_K, vec_dot_format
from jaxmoe.impls.policy import lowering_table, resolve_impl
from jaxmoe.quant import GGUF_BLOCKS, quantize_int4_affine, quantize_int8

KINDS = ("int8", "int4", "bf16", *sorted(GGUF_BLOCKS))
XLA_IMPLS = ("xla", "gather", "xla_tiled", "dense", "ragged_dot")


# ----------------------------------------------------------------------------- quantizers
def _rows(draw_scale, data):
    n_blocks = data.draw(st.integers(1, 3))
    rows = data.draw(st.integers(1, 3))
    seed = data.draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, n_blocks * 256)) * draw_scale).astype(np.float32)
    kind = data.draw(st.sampled_from(["plain", "ties", "zero_block", "one_hot", "tiny"]))
    if kind == "ties":  # values on exact half steps of the block scale
        x = (rng.integers(-254, 255, x.shape) * 0.5).astype(np.float32)
        x[:, ::32] = 127.0
    elif kind == "zero_block":
        x[:, :32] = 0
    elif kind == "one_hot":
        x[:, 1:256] = 0
    elif kind == "tiny":
        x *= np.float32(1e-30)
    return x


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(scale=st.sampled_from([1e-3, 1.0, 37.0]), data=st.data())
def test_q8_0_and_q8_1_match_ggml(scale, data):
    x = _rows(scale, data)
    q, d = quantize_q8_0(jnp.asarray(x))
    wq, wd, _ = ggml_blocks_np(x, "q8_0")
    np.testing.assert_array_equal(np.asarray(q), wq)
    np.testing.assert_array_equal(np.asarray(d).view(np.uint16), wd.view(np.uint16))
    q1, d1, s1 = quantize_q8_1(jnp.asarray(x))
    wq1, wd1, ws1 = ggml_blocks_np(x, "q8_1")
    np.testing.assert_array_equal(np.asarray(q1), wq1)
    np.testing.assert_array_equal(np.asarray(s1).view(np.uint16), ws1.view(np.uint16))
    np.testing.assert_array_equal(np.asarray(ggml_round(jnp.asarray(x), "q8_0")), ggml_quantize_np(x, "q8_0")[0])


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(scale=st.sampled_from([1e-3, 1.0, 37.0]), data=st.data())
def test_q8_K_matches_ggml(scale, data):
    x = _rows(scale, data)
    q, d, bsums = quantize_q8_K(jnp.asarray(x))
    wq, wd, _ = ggml_blocks_np(x, "q8_K")
    np.testing.assert_array_equal(np.asarray(q), wq)
    np.testing.assert_array_equal(np.asarray(d).view(np.uint32), wd.view(np.uint32))
    np.testing.assert_array_equal(np.asarray(bsums), wq.reshape(*wq.shape[:-1], -1, 16).sum(-1))
    # the values differ from d * q only by the float32 rounding of the product
    np.testing.assert_allclose(
        np.asarray(ggml_round(jnp.asarray(x), "q8_K")), ggml_quantize_np(x, "q8_K")[0], rtol=2**-24, atol=0
    )


@pytest.mark.parametrize("fmt", ["f16", "bf16", "f32"])
def test_float_formats_round_like_ggml(fmt):
    x = (np.random.default_rng(3).standard_normal((4, 96)) * 5).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(ggml_round(jnp.asarray(x), fmt)), ggml_quantize_np(x, fmt)[0])


def test_non_finite_block_is_nan_and_alone():
    x = np.random.default_rng(4).standard_normal((2, 512)).astype(np.float32)
    x[0, 40] = np.inf
    x[1, 300] = np.nan
    for fmt in ("q8_0", "q8_K"):
        v = np.asarray(ggml_round(jnp.asarray(x), fmt))
        qk = 256 if fmt == "q8_K" else 32
        bad = np.zeros(x.shape, bool)
        bad[0, 40 // qk * qk : 40 // qk * qk + qk] = True
        bad[1, 300 // qk * qk : 300 // qk * qk + qk] = True
        assert np.isnan(v[bad]).all() and np.isfinite(v[~bad]).all(), fmt


def test_rows_must_hold_whole_blocks():
    with pytest.raises(ValueError, match="q8_K quantizes blocks of 256.*100"):
        quantize_q8_K(jnp.ones((2, 100)))
    with pytest.raises(ValueError, match="unknown activation format 'q9'"):
        ggml_round(jnp.ones((1, 32)), "q9")


def test_vec_dot_format_by_weight_type():
    rng = np.random.default_rng(5)
    for kind, fmt in (("q4_1", "q8_1"), ("q5_0", "q8_0"), ("q4_k", "q8_K"), ("q6_k", "q8_K")):
        qw, _ = gguf_block_weight(rng, kind, (1, 8, 256))
        assert vec_dot_format(qw) == fmt == ggml_format(qw)
    assert vec_dot_format(jnp.zeros((2, 2), jnp.bfloat16)) == "bf16"
    with pytest.raises(ValueError, match="dtype int32"):
        vec_dot_format(jnp.zeros((2, 2), jnp.int32))


# ----------------------------------------------------------------------------- the layer
def _weight(kind, rng, stored_shape):
    """A weight of ``kind`` stored ``[E?, out, in]`` -> (weight ``[E?, in, out]``, float64 copy)."""
    out_in = stored_shape
    w = (rng.standard_normal(out_in) / np.sqrt(out_in[-1])).astype(np.float32)
    logical = np.swapaxes(w, -1, -2)
    if kind == "bf16":
        a = jnp.asarray(logical, jnp.bfloat16)
        return a, np.asarray(a, np.float64)
    if kind == "int8":
        q = quantize_int8(logical)
        return q, to_f64(q)
    if kind == "int4":
        q = quantize_int4_affine(logical, 32)
        return q, to_f64(q)
    lead = out_in[:-2]
    qw, ref = gguf_block_weight(rng, kind, (*(lead or (1,)), *out_in[-2:]))
    if not lead:
        qw = jax.tree.map(lambda a: a[0], qw)
        ref = ref[0]
    return qw, ref


def layer_case(kind, seed=0, tokens=6):
    rng = np.random.default_rng(seed)
    cfg = shrink(load_config("qwen3.6-35b-a3b"), d=256, f=256, e=8)
    p = random_params(cfg, rng)
    e, d, f = cfg.num_experts, cfg.d_model, cfg.expert_dim
    ew = {n: _weight(kind, rng, s) for n, s in (("w_gate", (e, f, d)), ("w_up", (e, f, d)), ("w_down", (e, d, f)))}
    fs = cfg.shared_expert_dim
    sw = {n: _weight(kind, rng, s) for n, s in (("w_gate", (fs, d)), ("w_up", (fs, d)), ("w_down", (d, fs)))}
    p = dataclasses.replace(
        p,
        experts=ExpertWeights(**{n: w for n, (w, _) in ew.items()}),
        shared=SharedWeights(**{n: w for n, (w, _) in sw.items()}, gate=p.shared.gate),
    )
    x = rng.standard_normal((tokens, d)).astype(np.float32)
    return cfg, p, x


def _boundary_slack(h, wd_f64, fmt, rel=4e-6):
    """Per output, what the hidden activations ``h [rows, F]`` that sit near a rounding
    boundary of ``fmt`` can move it: ``sum step |W_down[k, :]|`` over the elements whose
    distance to a boundary is under twice the float32 error of ``h`` (taken as ``rel`` times
    the row's largest ``|h|``; a block scale moves by as much, so codes shift by at most
    that too)."""
    h = h.astype(np.float32).astype(np.float64)
    err = rel * np.abs(h).max(-1, keepdims=True)
    if fmt == "f32":
        return np.zeros((h.shape[0], wd_f64.shape[1]))
    if fmt in ("bf16", "f16"):  # a float type's step at h: its ulp
        step = np.exp2(np.floor(np.log2(np.maximum(np.abs(h), 1e-30))) - (7 if fmt == "bf16" else 10))
        r = np.abs(h) / step
        near = np.abs(r - np.floor(r) - 0.5) * step < 2 * err
        return (near * step) @ np.abs(wd_f64)
    qk = 256 if fmt == "q8_K" else 32
    hb = h.reshape(h.shape[0], -1, qk)
    step = np.abs(hb).max(-1, keepdims=True) / 127
    r = np.divide(np.abs(hb), step, out=np.zeros_like(hb), where=step > 0)
    near = np.abs(r - np.floor(r) - 0.5) * step < 2 * err[..., None]
    return (near * step).reshape(h.shape) @ np.abs(wd_f64)


def ggml_layer(p, x, cfg, mode="ggml", requantize_hidden=True):
    """The layer in float64 with ggml's activations -> (y [T, d], slack [T, d])."""
    r = route_f64(router_logits_f64(p, x), cfg.router)
    y = np.zeros(x.shape)
    slack = np.zeros(x.shape)

    def ffn(xin, wg, wu, wd, index, scale):
        h = act_f64(dot_f64(xin, wg, index, mode), dot_f64(xin, wu, index, mode))
        fmt = ggml_format(wd) if mode == "ggml" else "f32"
        out = dot_f64(h.astype(np.float32), wd, index, mode if requantize_hidden else "float")
        return out * scale, _boundary_slack(h, to_f64(wd, index), fmt) * np.abs(scale)

    ew = p.experts
    for e in np.unique(r.expert_ids):
        tok, slot = np.nonzero(r.expert_ids == e)
        out, sl = ffn(x[tok], ew.w_gate, ew.w_up, ew.w_down, e, r.weights[tok, slot][:, None])
        np.add.at(y, tok, out)
        np.add.at(slack, tok, sl)
    sh = p.shared
    gate = 1 / (1 + np.exp(-(x.astype(np.float64) @ to_f64(sh.gate))))[:, None]
    out, sl = ffn(x, sh.w_gate, sh.w_up, sh.w_down, None, gate)
    return y + out, slack + sl


def _check(got, want, slack, tol=3e-6):
    scale = np.abs(want).max()
    excess = np.abs(np.asarray(got, np.float64) - want) - slack
    assert excess.max() <= tol * scale, f"max excess {excess.max() / scale:.3g} of the output scale"


#: kinds the quick subset (``-m "not slow"``) keeps: one per ggml block format
_QUICK = ("q8_0", "q4_k")  # q8_1 (Q4_1 / Q5_1): test_q8_1_block_sum_rounding_is_ggmls


@pytest.mark.parametrize("kind", [k if k in _QUICK else pytest.param(k, marks=pytest.mark.slow) for k in KINDS])
def test_layer_matches_the_ggml_oracle(kind):
    cfg, p, x = layer_case(kind)
    want, slack = ggml_layer(p, x, cfg)
    got = moe_apply(p, jnp.asarray(x), cfg, ExecConfig(impl="xla", activations="ggml"))
    _check(got, want, slack)
    # float activations are much further from the oracle: the mode does something
    flt = np.asarray(moe_apply(p, jnp.asarray(x), cfg, ExecConfig(impl="xla")), np.float64)
    err_ggml = np.linalg.norm(np.asarray(got) - want)
    assert np.linalg.norm(flt - want) > 20 * err_ggml + 1e-30


@pytest.mark.parametrize("impl", [*XLA_IMPLS, "auto"])
@pytest.mark.parametrize("kind", ["q4_1", "q4_k"])
def test_every_xla_strategy_has_the_mode(impl, kind):
    cfg, p, x = layer_case(kind, seed=1)
    want, slack = ggml_layer(p, x, cfg)
    got = moe_apply(p, jnp.asarray(x), cfg, ExecConfig(impl=impl, activations="ggml"))
    _check(got, want, slack)


def test_hidden_activation_is_requantized():
    cfg, p, x = layer_case("q8_0" if "q8_0" in GGUF_BLOCKS else "int8", seed=2)
    got = np.asarray(moe_apply(p, jnp.asarray(x), cfg, ExecConfig(impl="xla", activations="ggml")))
    want, slack = ggml_layer(p, x, cfg)
    no_requant, _ = ggml_layer(p, x, cfg, requantize_hidden=False)
    _check(got, want, slack)
    off = np.abs(no_requant - want) > slack + 3e-6 * np.abs(want).max()
    assert off.mean() > 0.5, off.mean()


def test_q8_1_block_sum_rounding_is_ggmls(monkeypatch):
    """Q4_1 / Q5_1 products use the stored float16 block sum: without that term the output
    moves further than the check allows."""
    from jaxmoe import ggml_activations as ga

    cfg, p, x = layer_case("q5_1", seed=3)
    want, slack = ggml_layer(p, x, cfg)
    ex = ExecConfig(impl="dense", activations="ggml")
    _check(moe_apply(p, jnp.asarray(x), cfg, ex), want, slack)
    jax.clear_caches()
    monkeypatch.setattr(ga, "q8_1_sum_residual", lambda a: jnp.zeros((*a.shape[:-1], a.shape[-1] // 32)))
    wrong = moe_apply(p, jnp.asarray(x), cfg, ex)
    jax.clear_caches()
    with pytest.raises(AssertionError):
        _check(wrong, want, slack)


@pytest.mark.parametrize("impl", ["xla", "gather"])
@pytest.mark.slow
def test_batch_invariant_in_the_mode(impl):
    cfg, p, x = layer_case("q4_k", seed=4, tokens=9)
    ex = ExecConfig(impl=impl, activations="ggml", batch_invariant=True)
    alone = np.asarray(moe_apply(p, jnp.asarray(x[3:4]), cfg, ex))
    among = np.asarray(moe_apply(p, jnp.asarray(x), cfg, ex))[3:4]
    np.testing.assert_array_equal(alone, among)


@pytest.mark.slow
def test_auto_takes_an_xla_strategy_and_explicit_ones_are_checked():
    cfg, p, x = layer_case("q4_k", seed=5, tokens=2)
    assert resolve_impl("auto", 16, "cpu", experts=p.experts) in ("cpu", "gather")
    got = moe_apply(p, jnp.asarray(x), cfg, ExecConfig(activations="ggml"))
    want, slack = ggml_layer(p, x, cfg)
    _check(got, want, slack)
    assert "cpu" in lowering_table("cpu", 16, experts=p.experts).values()
    # (impl="cpu" has the mode for Q4_K: tests/test_impls_cpu_ggml.py)
    with pytest.raises(ValueError, match="impl 'pallas' has no ggml arithmetic"):
        moe_apply(p, jnp.asarray(x), cfg, ExecConfig(impl="pallas", activations="ggml"))


@pytest.mark.slow
def test_gradient_passes_straight_through_the_conversion():
    """d/dx in ggml mode is the float mode's within the conversion's error (straight
    through), not the zero gradient of a rounding."""
    cfg, p, x = layer_case("q4_1", seed=11, tokens=4)
    cot = jnp.asarray(np.random.default_rng(12).standard_normal(x.shape).astype(np.float32))

    def grad(mode):
        f = lambda x: jnp.vdot(moe_apply(p, x, cfg, ExecConfig(impl="xla", activations=mode)), cot)  # noqa: E731
        return np.asarray(jax.grad(f)(jnp.asarray(x)), np.float64)

    g_float, g_ggml = grad("float"), grad("ggml")
    rel = np.linalg.norm(g_ggml - g_float) / np.linalg.norm(g_float)
    assert 0 < rel < 0.1, rel

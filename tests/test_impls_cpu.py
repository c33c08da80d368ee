"""The C++ XLA:CPU kernel (``impl="cpu"``, jaxmoe/impls/cpu/grouped_swiglu.cc) against the
float64 numpy loop: register-tile and scalar column tails, the packed path (>= 8 rows of
one expert), row chunks (> 128 rows of one expert), empty experts, bf16, biases and the
gpt-oss activation; gradients (the gather path's VJP), vmap, errors and the build fallback.
Preset-level parity, NaN isolation and weight_on_input run in tests/test_impls.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import np_experts, params_to_numpy, random_params, shrink, skewed_routing
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxmoe
from jaxmoe import MoEConfig, RouterConfig, Routing
from jaxmoe.impls import policy
from jaxmoe.impls.cpu import build, cpu_kernel_status, experts_cpu
from jaxmoe.impls.xla import experts_xla
from jaxmoe.quant import quantize_int8

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
def test_column_tails_and_tiles(d, f, t, rng):
    """Widths that fill 1-8 vectors of 16 lanes, leave scalar tails, or are under one vector."""
    cfg = cfg_of(d, f, 12, 3)
    check(cfg, *uniform_routing(rng, t, 3, 12), rng)


@pytest.mark.parametrize("t", [1, 7, 8, 9, 130, 300])
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
    q = dataclasses.replace(p.experts, w_gate=quantize_int8(p.experts.w_gate))
    with pytest.raises(ValueError, match="quantized"):
        experts_cpu(jnp.ones((3, 32)), r, q, cfg)
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

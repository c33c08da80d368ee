"""Reverse mode through every strategy that runs on the CPU (issue 13): `check_grads` in
float64 (rev, and fwd where the strategy has no custom VJP), gradients equal to ``dense``'s
through `moe_apply` for every preset family, frozen quantized experts, empty experts,
NaN rows, and ``auto``'s per-platform backward."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    cpu_impls,
    each_impl,
    gguf_block_bytes,
    needs_cpu_kernel,
    quantize_experts,
    random_params,
    shrink,
    skewed_routing,
)
from jax.ad_checkpoint import print_saved_residuals
from jax.test_util import check_grads

import jaxmoe
from jaxmoe.experts import ExpertWeights, frozen_cotangent
from jaxmoe.impls.registry import get_impl
from jaxmoe.quant import QuantizedTensor, gguf_block_tensor, materialize
from jaxmoe.routing import Routing

#: Strategies that run on the CPU and have a reverse mode.
CPU_IMPLS = ["dense", "gather", "xla", "xla_tiled", "ragged_dot", "cpu"]
#: Those differentiated by JAX's own autodiff (forward mode too).
NATIVE = {"dense", "gather", "xla_tiled", "ragged_dot"}
#: float64 inputs, but the expert dots accumulate in float32 (`jaxmoe.experts.mm`), so the
#: function is float32-accurate: a step of 1e-3 keeps rounding / step near 1e-5 relative.
F64_CHECK = dict(eps=1e-3, atol=1e-3, rtol=1e-3)


def _cfg(preset="qwen3-30b-a3b", d=32, f=32, e=8, **kw):
    return dataclasses.replace(shrink(jaxmoe.load_config(preset), d=d, f=f, e=e), **kw)


def _routing(rng, t, k, e, empty=()):
    """Distinct ids per token avoiding ``empty``, random positive weights."""
    pool = np.array([i for i in range(e) if i not in empty])
    ids = np.stack([rng.choice(pool, k, replace=False) for _ in range(t)]).astype(np.int32)
    return Routing(jnp.asarray(ids), jnp.asarray(rng.uniform(0.1, 1.0, (t, k)), jnp.float32))


def _loss(impl, cfg, ids, c):
    f = get_impl(impl)
    return lambda x, w, ew: jnp.sum(f(x, Routing(ids, w), ew, cfg) * c)


def _close(got, want, rtol, what):
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        scale = np.abs(b).max() + 1e-30
        assert np.abs(a - b).max() <= rtol * scale, f"{what}{jax.tree_util.keystr(path)}"


@pytest.mark.parametrize("impl", [i for i in CPU_IMPLS if i != "cpu"])
@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "gpt-oss-20b"])
@pytest.mark.slow
def test_check_grads_float64(impl, preset, rng):
    """x, routing weights, expert weights (and gpt-oss's biases, clamped activation)."""
    with jax.enable_x64(True):
        cfg = _cfg(preset, d=8, f=6, e=4)
        p = random_params(cfg, rng, jnp.float64)
        t, k = 5, cfg.top_k
        r = _routing(rng, t, k, cfg.num_experts)
        x = jnp.asarray(rng.standard_normal((t, cfg.d_model)))
        c = jnp.asarray(rng.standard_normal((t, cfg.d_model)))
        w = r.weights.astype(jnp.float64)
        modes = ("rev", "fwd") if impl in NATIVE else ("rev",)
        check_grads(_loss(impl, cfg, r.expert_ids, c), (x, w, p.experts), 1, modes, **F64_CHECK)


@pytest.mark.slow
def test_check_grads_weight_on_input(rng):
    """``weight_on_input`` (the routing weight scales the expert's input): xla's backward."""
    with jax.enable_x64(True):
        cfg = _cfg(d=8, f=6, e=4, weight_on_input=True)
        p = random_params(cfg, rng, jnp.float64)
        r = _routing(rng, 5, cfg.top_k, cfg.num_experts)
        x = jnp.asarray(rng.standard_normal((5, cfg.d_model)))
        c = jnp.asarray(rng.standard_normal((5, cfg.d_model)))
        for impl in ("xla", "dense"):
            check_grads(
                _loss(impl, cfg, r.expert_ids, c),
                (x, r.weights.astype(jnp.float64), p.experts),
                1,
                ("rev",),
                **F64_CHECK,
            )


@needs_cpu_kernel()
def test_check_grads_cpu_float32(rng):
    """The C++ kernel takes float32 / bfloat16 only: its VJP against float32 finite differences."""
    cfg = _cfg(d=16, f=16, e=4)
    p = random_params(cfg, rng)
    r = _routing(rng, 5, cfg.top_k, cfg.num_experts)
    x = jnp.asarray(rng.standard_normal((5, cfg.d_model)), jnp.float32)
    c = jnp.asarray(rng.standard_normal((5, cfg.d_model)), jnp.float32)
    check_grads(
        _loss("cpu", cfg, r.expert_ids, c), (x, r.weights, p.experts), 1, ("rev",), eps=1e-2, atol=2e-2, rtol=2e-2
    )


def _layer_grads(impl, p, x, cfg, c):
    def loss(p, x):
        return jnp.sum(jaxmoe.moe_apply(p, x, cfg, impl=impl) * c)

    return jax.grad(loss, argnums=(0, 1))(p, x)


@pytest.mark.parametrize("preset", jaxmoe.list_presets())
@pytest.mark.slow
def test_layer_grads_equal_dense(preset, rng):
    """Through `moe_apply` (router weights and bias, experts, shared expert, x), float32,
    every strategy against ``dense``; the selection bias gets exactly zero."""
    cfg = _cfg(preset, d=32, f=16, e=8)
    p = random_params(cfg, rng)
    if p.selection_bias is not None:
        p = dataclasses.replace(p, selection_bias=jnp.asarray(rng.normal(size=cfg.num_experts) * 0.1, jnp.float32))
    x = jnp.asarray(rng.standard_normal((6, cfg.d_model)), jnp.float32)
    c = jnp.asarray(rng.standard_normal((6, cfg.d_model)), jnp.float32)
    want = _layer_grads("dense", p, x, cfg, c)
    assert float(jnp.abs(want[0].w_router).max()) > 0  # the router is trained
    if p.shared is not None:
        assert float(jnp.abs(want[0].shared.w_up).max()) > 0
    if p.selection_bias is not None:
        assert not np.asarray(want[0].selection_bias).any()  # selection only: no gradient
    for impl in each_impl(["auto", "gather", "xla", "xla_tiled", "ragged_dot", "cpu"]):
        _close(_layer_grads(impl, p, x, cfg, c), want, 2e-5, f"{preset} {impl}: ")


def _dequantized(ew):
    return dataclasses.replace(
        ew, **{n: materialize(getattr(ew, n), jnp.float32) for n in ("w_gate", "w_up", "w_down")}
    )


def _q5_0(rng, w):
    """A GGUF Q5_0 block tensor of a logical ``[E, in, out]`` weight (random codes)."""
    from gguf import GGMLQuantizationType as QT

    e, n_in, out = w.shape
    return gguf_block_tensor(gguf_block_bytes(rng, QT.Q5_0, (e, out, n_in)), "q5_0", n_in)


@pytest.mark.parametrize("quant", ["int8", "int4", "q5_0"])
@pytest.mark.slow
def test_frozen_quantized_experts(quant, rng):
    """Input and routing-weight gradients equal those of the dequantized float weights; the
    experts get zero cotangents (float0 for the integer codes)."""
    cfg = _cfg(d=32, f=32, e=4)
    p = random_params(cfg, rng)
    if quant == "q5_0":
        ew = p.experts
        qew = dataclasses.replace(ew, **{n: _q5_0(rng, getattr(ew, n)) for n in ("w_gate", "w_up", "w_down")})
    else:
        qew = quantize_experts(p, quant).experts
    fl = _dequantized(qew)
    r = _routing(rng, 6, cfg.top_k, cfg.num_experts)
    x = jnp.asarray(rng.standard_normal((6, cfg.d_model)), jnp.float32)
    c = jnp.asarray(rng.standard_normal((6, cfg.d_model)), jnp.float32)
    want = jax.grad(_loss("dense", cfg, r.expert_ids, c), argnums=(0, 1))(x, r.weights, fl)
    for impl in each_impl(CPU_IMPLS):
        f = _loss(impl, cfg, r.expert_ids, c)
        gx, gw, gew = jax.grad(f, argnums=(0, 1, 2), allow_int=True)(x, r.weights, qew)
        _close((gx, gw), want, 1e-5, f"{quant} {impl}: ")
        assert jax.tree.structure(gew) == jax.tree.structure(qew)
        for a, z in zip(jax.tree.leaves(gew), jax.tree.leaves(frozen_cotangent(qew))):
            assert a.dtype == z.dtype and a.shape == z.shape, impl
            if a.dtype != jax.dtypes.float0:
                assert not np.asarray(a).any(), f"{quant} {impl}: the frozen experts got a gradient"


@pytest.mark.parametrize("impl", cpu_impls([*CPU_IMPLS, "pallas"]))
@pytest.mark.slow
def test_empty_experts_get_zero_gradient(impl, rng):
    cfg = _cfg("gpt-oss-20b", d=16, f=16, e=8)  # biases too
    p = random_params(cfg, rng)
    ids, ws = skewed_routing(rng, 12, cfg.top_k, cfg.num_experts)
    used = np.unique(ids)
    empty = np.setdiff1d(np.arange(cfg.num_experts), used)
    assert empty.size
    x = jnp.asarray(rng.standard_normal((12, cfg.d_model)), jnp.float32)
    c = jnp.asarray(rng.standard_normal((12, cfg.d_model)), jnp.float32)
    gew = jax.grad(_loss(impl, cfg, jnp.asarray(ids), c), argnums=2)(x, jnp.asarray(ws), p.experts)
    for path, a in jax.tree_util.tree_leaves_with_path(gew):
        a = np.asarray(a)
        assert not a[empty].any(), f"{impl}: empty expert got gradient in {jax.tree_util.keystr(path)}"
        assert np.abs(a[used]).max() > 0, jax.tree_util.keystr(path)


@pytest.mark.parametrize("impl", cpu_impls([*CPU_IMPLS, "pallas"]))  # pallas: interpret mode
@pytest.mark.slow
def test_nan_weights_stay_in_their_row(impl, rng):
    """A token whose routing weights are NaN: NaN in its own row of dx only."""
    cfg = _cfg(d=16, f=16, e=4)
    p = random_params(cfg, rng)
    r = _routing(rng, 7, cfg.top_k, cfg.num_experts)
    w = r.weights.at[3].set(jnp.nan)
    x = jnp.asarray(rng.standard_normal((7, cfg.d_model)), jnp.float32)
    c = jnp.asarray(rng.standard_normal((7, cfg.d_model)), jnp.float32)
    gx, gw = jax.grad(_loss(impl, cfg, r.expert_ids, c), argnums=(0, 1))(x, w, p.experts)
    bad = np.asarray(np.isnan(np.asarray(gx)).any(axis=1))
    assert bad[3] and bad.sum() == 1, f"{impl}: NaN rows {np.flatnonzero(bad)}"
    assert np.isfinite(np.asarray(gw)[np.arange(7) != 3]).all(), impl


@pytest.mark.slow
def test_auto_backward_per_platform(rng):
    """``auto``'s backward is each platform's own strategy: lowered for Intel (xla_tiled) the
    gradient holds no loop (``gather``'s backward is a loop over the pairs); lowered for CUDA
    it runs the Pallas backward kernels (Triton calls) and no loop either."""
    cfg = _cfg(d=32, f=16, e=8)
    p = random_params(cfg, rng)
    x = jnp.asarray(rng.standard_normal((16, cfg.d_model)), jnp.float32)
    g = jax.jit(jax.grad(lambda p, x: jnp.sum(jnp.sin(jnp.asarray(jaxmoe.moe_apply(p, x, cfg)))), argnums=(0, 1)))
    for plat in ("oneapi", "cuda"):
        txt = g.trace(p, x).lower(lowering_platforms=(plat,)).as_text()
        assert "stablehlo.while" not in txt, plat
        if plat == "cuda":  # forward gmm + the backward's kernels, all Triton
            assert txt.count("__gpu$xla.gpu.triton") >= 3, txt.count("__gpu$xla.gpu.triton")


def test_xla_saves_no_expert_by_token_residual(rng, capsys):
    """The xla VJP saves its inputs and the O(T k) plan: no [T, E, ...] or [rows, F] array."""
    cfg = _cfg(d=32, f=24, e=8)
    p = random_params(cfg, rng)
    t = 40
    r = _routing(rng, t, cfg.top_k, cfg.num_experts)
    x = jnp.asarray(rng.standard_normal((t, cfg.d_model)), jnp.float32)
    f = get_impl("xla")
    print_saved_residuals(lambda x, w, ew: f(x, Routing(r.expert_ids, w), ew, cfg), x, r.weights, p.experts)
    out = capsys.readouterr().out
    shapes = [tuple(int(v) for v in s.split(",") if v) for s in re.findall(r"\[([\d,]*)\]", out)]
    assert shapes, out
    rows, cols = (t, t * cfg.top_k), (cfg.num_experts, cfg.expert_dim)  # 40, 80 / 8, 24: all distinct
    for s in shapes:
        assert not (set(s) & set(rows) and set(s) & set(cols)), out
    assert max(int(np.prod(s)) for s in shapes) <= max(x.size, cfg.num_experts * cfg.d_model * cfg.expert_dim), out


def test_frozen_cotangent_matches_structure():
    ew = quantize_experts(random_params(_cfg(d=32, f=32, e=2), np.random.default_rng(0)), "int4").experts
    z = frozen_cotangent(ew)
    assert isinstance(z, ExpertWeights)
    zg, wg = z.w_gate, ew.w_gate
    assert isinstance(zg, QuantizedTensor) and isinstance(wg, QuantizedTensor)
    assert zg.scales is not None and wg.scales is not None and zg.biases is not None
    assert zg.qdata.dtype == jax.dtypes.float0 and zg.scales.dtype == wg.scales.dtype
    assert not np.asarray(zg.scales).any() and not np.asarray(zg.biases).any()

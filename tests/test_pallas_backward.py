"""The Pallas backward (``impl="pallas"`` reverse mode, issue 13): each kernel of
`pallas_kernels.backward` against its pure-jnp reference in interpret mode, the whole
`jax.custom_vjp` against ``jax.grad`` of `experts_dense` (float32), frozen quantized
experts, and the CUDA lowering of the backward through Triton (no GPU needed; lowered
under an abstract H200 device as in test_pallas_lowering.py, so jax 0.11.2 passes too).

Interpret mode is slow: shapes are tiny and the cases few.
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import gguf_block_weight, gpu_target, quantize_experts, skewed_routing

import jaxmoe
from jaxmoe.dispatch import plan_dispatch
from jaxmoe.execution import ExecConfig
from jaxmoe.experts import experts_dense
from jaxmoe.impls.pallas import experts_pallas, kernel_weight
from jaxmoe.quant import quantize_int4_affine, quantize_int8
from pallas_kernels import backward as bw
from pallas_kernels.common import Activation
from pallas_kernels.launch import Launch, Plan

TRITON_CALL = re.compile(r"__gpu\$xla\.gpu\.triton|triton_kernel_call")


def _cfg(d, f, e, k, **kw):
    cfg = jaxmoe.load_config("qwen3-30b-a3b")
    return dataclasses.replace(
        cfg, d_model=d, expert_dim=f, router=dataclasses.replace(cfg.router, num_experts=e, top_k=k), **kw
    )


def _close(got, want, tol=2e-5, what=""):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(1.0, float(np.max(np.abs(want))) if want.size else 1.0)
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * scale, err_msg=what)


def _plan(ids, e, bm=16):
    plan = plan_dispatch(jnp.asarray(ids, jnp.int32), e, bm)
    return plan, Plan(plan.group_offsets, plan.tile_group, plan.tile_row, plan.num_tiles)


def _weights(rng, e, d, f, kind, group=32):
    ws = [rng.standard_normal(s).astype(np.float32) / 4 for s in ((e, d, f), (e, d, f), (e, f, d))]
    if kind == "int8":
        ws = [quantize_int8(w) for w in ws]
    elif kind == "int4":
        ws = [quantize_int4_affine(w, group_size=group) for w in ws]
    else:
        ws = [jnp.asarray(w) for w in ws]
    return [kernel_weight(w) for w in ws]


@pytest.mark.parametrize(
    "scale,act,bias,kind",
    [("output", "swiglu", False, "f32"), ("input", "swiglu_oai", True, "f32"), ("output", "swiglu", True, "int8")],
)
@pytest.mark.slow
def test_gate_up_backward_matches_reference(rng, scale, act, bias, kind):
    """dg, du, h and the input-scale gradient of every valid sorted row (skewed routing:
    one hot expert, empty experts, tiles straddling experts)."""
    t, k, e, d, f = 9, 2, 6, 64, 32
    ids, ws = skewed_routing(rng, t, k, e)
    plan, meta = _plan(ids, e)
    wg, wu, wd = _weights(rng, e, d, f, kind)
    x = jnp.asarray(rng.standard_normal((t, d)) * 2, jnp.float32)  # large enough to hit gpt-oss's clamp
    dy = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
    bg, bu = (jnp.asarray(rng.standard_normal((e, f)), jnp.float32) if bias else None for _ in range(2))
    rs = jnp.asarray(ws.reshape(-1), jnp.float32)[plan.sort_idx]
    biases = (bg, bu) if bias else None
    lc = Launch(block_m=16, block_n=16, block_k=32, interpret=True)
    kw = dict(scale=scale, act=Activation(act))
    got = bw.gate_up_backward(x, dy, plan.token_idx, meta, (wg, wu, wd), biases, rs, **kw, want_h=True, launch=lc)
    want = bw.gate_up_backward_reference(x, dy, plan.token_idx, plan.group_offsets, (wg, wu, wd), biases, rs, **kw)
    valid = np.asarray(plan.row_valid())
    for name, a, b in zip(("dg", "du", "h", "dscale"), got, want):
        assert (a is None) == (b is None) == (name == "dscale" and scale != "input"), name
        if a is not None:
            _close(np.asarray(a)[valid], np.asarray(b)[valid], what=name)


@pytest.mark.slow
def test_gmm_transposed_tgmm_group_sum(rng):
    """Input gradient with int4 weights read transposed; per-expert weight / bias sums:
    an empty expert gets exact zeros, one expert takes every token."""
    t, k, e, d, f = 11, 2, 5, 64, 48
    ids, ws = skewed_routing(rng, t, k, e, share=1.0)
    plan, meta = _plan(ids, e)
    p = t * k
    wg, wu, _ = _weights(rng, e, d, f, "int4", group=16)
    dg, du = (jnp.asarray(rng.standard_normal((p, f)), jnp.float32) for _ in range(2))
    rs = jnp.asarray(rng.uniform(0.1, 1.0, p), jnp.float32)
    got = bw.gmm_transposed(
        (dg, du), (wg, wu), meta, rs, launch=Launch(block_m=16, block_n=32, block_k=32, interpret=True)
    )
    want = bw.gmm_transposed_reference((dg, du), (wg, wu), plan.group_offsets, rs)
    _close(got, want, what="gmm_transposed")

    x = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
    lc = Launch(block_m=16, block_n=16, block_k=32, interpret=True)
    got = bw.tgmm(x, dg, plan.group_offsets, plan.token_idx, None, rs, launch=lc)
    want = bw.tgmm_reference(x, dg, plan.group_offsets, plan.token_idx, None, rs)
    _close(got, want, what="tgmm")
    sums = bw.group_sum(x, plan.group_offsets, plan.token_idx, rs, launch=lc)
    _close(sums, bw.tgmm_reference(None, x, plan.group_offsets, None, plan.token_idx, rs), what="group_sum")
    empty = np.setdiff1d(np.arange(e), ids)
    assert empty.size and not np.any(np.asarray(got)[empty]) and not np.any(np.asarray(sums)[empty])
    again = bw.tgmm(x, dg, plan.group_offsets, plan.token_idx, None, rs, launch=lc)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(got))  # deterministic


def _grads(fn, x, routing, ew, cfg, ct, experts=True):
    def loss(x, w, ew):
        return jnp.sum(fn(x, jaxmoe.Routing(routing.expert_ids, w), ew, cfg) * ct)

    return jax.grad(loss, argnums=(0, 1, 2) if experts else (0, 1))(x, routing.weights, ew)


@pytest.mark.parametrize(
    "variant,t", [("plain", 1), ("plain", 130), ("oai_bias", 7), ("weight_on_input", 7)], ids=lambda v: str(v)
)
@pytest.mark.slow
def test_vjp_matches_dense(rng, variant, t):
    """``jax.grad`` through ``impl="pallas"`` (interpret) equals that through `experts_dense`
    for x, the routing weights and every expert weight and bias. T = 1 runs the decode
    forward, T = 130 grouped with one expert in every token and empty experts."""
    kw = {"oai_bias": dict(activation="swiglu_oai", expert_bias=True), "weight_on_input": dict(weight_on_input=True)}
    d, f, e, k = 32, 32, 6, 2
    cfg = _cfg(d, f, e, k, **kw.get(variant, {}))
    ew = jaxmoe.init_params(cfg, jax.random.key(int(rng.integers(1 << 30))), dtype=jnp.float32).experts
    ew = jax.tree.map(lambda a: a + 0.3 * jnp.asarray(rng.standard_normal(a.shape), a.dtype), ew)
    ids, ws = skewed_routing(rng, t, k, e, share=1.0)
    r = jaxmoe.Routing(jnp.asarray(ids), jnp.asarray(ws))
    x = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
    ct = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
    got = _grads(functools.partial(experts_pallas, ex=ExecConfig(interpret=True)), x, r, ew, cfg, ct)
    want = _grads(experts_dense, x, r, ew, cfg, ct)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        assert a.dtype == b.dtype and a.shape == b.shape, jax.tree_util.keystr(path)
        _close(a, b, what=jax.tree_util.keystr(path))
    empty = np.setdiff1d(np.arange(e), ids)
    assert empty.size and not np.any(np.asarray(got[2].w_down)[empty])


#: GGUF mixes: Q4_K_M, and Q3_K / IQ4_XS (decoded in-kernel) with MXFP4 (decoded by XLA first).
_GGUF_MIXES = {"q4_k_m": ("q4_k", "q4_k", "q6_k"), "q3_iq4_mxfp4": ("q3_k", "iq4_xs", "mxfp4")}


@pytest.mark.parametrize("quant", ["int8", "int4", *_GGUF_MIXES])
@pytest.mark.slow
def test_frozen_quantized_experts(rng, quant):
    """Quantized experts: the input and routing-weight gradients equal those of the
    dequantized float weights; the experts get zero (float0 for the codes). GGUF Q4_K_M
    (Q4_K gate / up, Q6_K down) and Q3_K / IQ4_XS are read from their block bytes in the
    backward kernels too; MXFP4 reaches them decoded by XLA."""
    d, f, e, k, t = (256, 256, 4, 2, 7) if quant in _GGUF_MIXES else (64, 64, 4, 2, 7)
    cfg = _cfg(d, f, e, k)
    if quant in _GGUF_MIXES:
        kinds = _GGUF_MIXES[quant]
        stored = ((kinds[0], (e, f, d)), (kinds[1], (e, f, d)), (kinds[2], (e, d, f)))  # [E, out, in]
        ew = jaxmoe.ExpertWeights(*(gguf_block_weight(rng, kk, s)[0] for kk, s in stored))
    else:
        p = quantize_experts(jaxmoe.init_params(cfg, jax.random.key(int(rng.integers(1 << 30)))), quant)
        ew = p.experts
    deq = dataclasses.replace(ew, **{n: getattr(ew, n).dequantize(jnp.float32) for n in ("w_gate", "w_up", "w_down")})
    ids, ws = skewed_routing(rng, t, k, e)
    r = jaxmoe.Routing(jnp.asarray(ids), jnp.asarray(ws))
    x = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
    ct = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
    run = functools.partial(experts_pallas, cfg=cfg, ex=ExecConfig(interpret=True))
    _, vjp = jax.vjp(lambda x, w, ew: run(x, jaxmoe.Routing(r.expert_ids, w), ew), x, r.weights, ew)
    gx, gw, gew = vjp(ct)
    wx, ww = _grads(experts_dense, x, r, deq, cfg, ct, experts=False)
    _close(gx, wx, what="dx")
    _close(gw, ww, what="d routing weights")
    assert jax.tree.structure(gew) == jax.tree.structure(ew)
    for leaf in jax.tree.leaves(gew):
        assert leaf.dtype == jax.dtypes.float0 or not np.any(np.asarray(leaf))


def _lower(f, *args) -> str:
    with gpu_target():
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("kind,t", [("bf16", 2), ("bf16", 40), ("int4", 40)])
@pytest.mark.slow
def test_backward_lowers_to_triton(rng, kind, t):
    """The gradient program lowered for CUDA holds the backward kernels as Triton calls
    (float experts: the weight gradient's tgmm too; frozen int4: no tgmm)."""
    d, f, e, k = 128, 64, 8, 2
    cfg = _cfg(d, f, e, k, activation="swiglu_oai", expert_bias=True) if kind == "bf16" else _cfg(d, f, e, k)
    dt = jnp.bfloat16 if kind == "bf16" else jnp.float32
    p = jaxmoe.init_params(cfg, jax.random.key(0), dtype=dt)
    ew = quantize_experts(p, "int4").experts if kind == "int4" else p.experts
    x = jnp.asarray(rng.standard_normal((t, d)), dt)
    ids = jnp.asarray(np.argsort(rng.random((t, e)), axis=1)[:, :k], jnp.int32)

    def loss(x, w, ew):
        return jnp.sum(experts_pallas(x, jaxmoe.Routing(ids, w), ew, cfg, ExecConfig(interpret=False)))

    w = jnp.asarray(rng.random((t, k)), jnp.float32)
    if kind == "int4":
        txt = _lower(jax.grad(lambda x, w: loss(x, w, ew), argnums=(0, 1)), x, w)
    else:
        txt = _lower(jax.grad(loss, argnums=(0, 1, 2)), x, w, ew)
    assert "mosaic" not in txt.lower()
    names = set(re.findall(r"moe_[a-z_]+", txt))
    want = {"moe_gate_up_bwd", "moe_gmm_t"} | ({"moe_tgmm", "moe_group_sum"} if kind == "bf16" else set())
    assert want <= names, names
    assert "moe_tgmm" not in names or kind == "bf16"
    assert len(TRITON_CALL.findall(txt)) >= len(want) + 2  # + the forward's two


def test_bad_inputs_raise(rng):
    e, d, f, p = 3, 32, 16, 8
    wg, wu, wd = _weights(rng, e, d, f, "f32")
    plan, meta = _plan(rng.integers(0, e, (p // 2, 2)), e)
    lhs = jnp.zeros((p, f), jnp.float32)
    lc = Launch(block_m=16)
    with pytest.raises(ValueError, match="lhs and weights"):
        bw.gmm_transposed((lhs,), (wg, wu), meta, launch=lc)
    with pytest.raises(ValueError, match=r"lhs\[1\]"):
        bw.gmm_transposed((lhs, lhs[:, :8]), (wg, wu), meta, launch=lc)
    with pytest.raises(ValueError, match="sorted row counts"):
        bw.tgmm(lhs, lhs[:3], plan.group_offsets, launch=lc)
    x = jnp.zeros((p // 2, d), jnp.float32)
    with pytest.raises(ValueError, match="row_scale is required"):
        bw.gate_up_backward(x, x, plan.token_idx, meta, (wg, wu, wd), scale="output", launch=lc)
    with pytest.raises(ValueError, match="w_down"):
        bw.gate_up_backward(x, x, plan.token_idx, meta, (wg, wu, wg), scale="none", launch=lc)
    with pytest.raises(ValueError, match=r"gate_up_backward: weights must be \(w_gate, w_up, w_down\)"):
        bw.gate_up_backward(x, x, plan.token_idx, meta, (wg, wu), scale="none", launch=lc)
    with pytest.raises(ValueError, match=r"gate_up_backward: biases must be \(b_gate, b_up\) or None"):
        bw.gate_up_backward(x, x, plan.token_idx, meta, (wg, wu, wd), wg, scale="none", launch=lc)


def test_saved_residuals(rng, capsys):
    """The VJP saves its inputs and the unweighted expert outputs ``z [T * k, d]`` only:
    no ``[T, E, ...]`` and no ``[rows, F]`` array (h, g, u are recomputed)."""
    from jax.ad_checkpoint import print_saved_residuals

    d, f, e, k, t = 32, 24, 8, 2, 40
    cfg = _cfg(d, f, e, k)
    ew = jaxmoe.init_params(cfg, jax.random.key(0)).experts
    ids = jnp.asarray(np.argsort(rng.random((t, e)), axis=1)[:, :k], jnp.int32)
    x = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
    w = jnp.asarray(rng.random((t, k)), jnp.float32)
    run = functools.partial(experts_pallas, cfg=cfg, ex=ExecConfig(interpret=True))
    print_saved_residuals(lambda x, w, ew: run(x, jaxmoe.Routing(ids, w), ew), x, w, ew)
    out = capsys.readouterr().out
    shapes = {tuple(int(v) for v in s.split(",") if v) for s in re.findall(r"\[([\d,]*)\]", out)}
    allowed = {(t, d), (t, k), (e, d, f), (e, f, d), (t * k, d)}
    assert (t * k, d) in shapes and shapes <= allowed | {()}, out

"""``ExecConfig(activations="int8")`` in the C++ kernel (``impl="cpu"``, jaxmoe/impls/cpu/int_dot.h):
int8 / int4 experts multiply activations quantized to int8 per block of 32 with integer dot
products. The reference is a float64 numpy loop over the dequantized weights (gguf.quants /
the MLX rule) fed with the activations quantized by an independent numpy mirror of the rule
(float32 operations, as documented): the gate / up products match it within float rounding
(`grouped_swiglu_saving`), the layer output too once the few hidden activations that sit on a
rounding boundary are allowed either code. Also the documented error bound against float
activations, mixed kinds (non-integer kinds keep float activations), biases and gpt-oss,
batch invariance, NaN isolation, a mutated nibble, and the jnp `quantize_activations_q8`."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import np_act, skewed_routing
from hypothesis import given, settings
from hypothesis import strategies as st
from test_impls_cpu import cfg_of, quantized_case, uniform_routing

import jaxmoe
from jaxmoe import Routing
from jaxmoe.dispatch import plan_dispatch
from jaxmoe.execution import ExecConfig
from jaxmoe.impls.common import sorted_inputs
from jaxmoe.impls.cpu import experts_cpu
from jaxmoe.impls.cpu.kernel import grouped_swiglu_saving
from jaxmoe.quant import quantize_activations_q8

INT_FORMATS = ("q8_0", "q4_0_int4", "mlx4_g32", "mlx4_g64", "mlx4_g128", "int8_f32")
K_FORMATS = ("q4_k", "q6_k")  # GGUF super-blocks with integer dot products too (AVX2 builds)


def np_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The documented rule in numpy float32: ``(Q8(x) as float64, dx per element as float64)``."""
    x = np.asarray(x, np.float32)
    b = x.reshape(*x.shape[:-1], -1, 32)
    dx = np.abs(b).max(-1, keepdims=True) / np.float32(127)
    safe = np.where(dx > 0, dx, np.float32(1))
    xq = np.where(dx > 0, np.rint(np.clip(b / safe, np.float32(-127), np.float32(127))), 0)
    dxe = np.broadcast_to(dx, b.shape).reshape(x.shape).astype(np.float64)
    return (xq.astype(np.float64) * dx.astype(np.float64)).reshape(x.shape), dxe


def quantized_input(fmt: str) -> bool:
    return fmt in INT_FORMATS + K_FORMATS


def np_experts_q8(x, ids, ws, ref, cfg, fmts, window=2e-3):
    """float64 layer output with Q8 activations into the int8 / int4 projections (``fmts``:
    gate, up, down), and a per-output slack: a hidden activation whose ``h / dx`` lies within
    ``window`` of a rounding boundary may get either code in the kernel (its h is float32),
    which moves the output by ``dx |W_down[k, :]|`` times the routing weight."""
    x = np.asarray(x, np.float32)
    y = np.zeros(x.shape, np.float64)
    slack = np.zeros(x.shape, np.float64)
    xq = np_q8(x)[0] if quantized_input(fmts[0]) or quantized_input(fmts[1]) else None
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            e, w = int(ids[t, s]), np.float64(ws[t, s])
            xg = xq[t] if quantized_input(fmts[0]) else x[t].astype(np.float64)
            xu = xq[t] if quantized_input(fmts[1]) else x[t].astype(np.float64)
            g, u = xg @ ref["w_gate"][e], xu @ ref["w_up"][e]
            if "b_gate" in ref:
                g, u = g + ref["b_gate"][e], u + ref["b_up"][e]
            h = np_act(g, u, cfg.activation, cfg.swiglu_alpha, cfg.swiglu_limit)
            wd = ref["w_down"][e]
            if quantized_input(fmts[2]):
                hb = h.reshape(-1, 32)
                dx = np.abs(hb).max(-1, keepdims=True) / 127
                frac = np.abs(hb / dx - np.floor(hb / dx) - 0.5)
                amb = (frac < window).reshape(-1)
                hq = np_q8(h.astype(np.float32))[0]
                slack[t] += w * (np.broadcast_to(dx, hb.shape).reshape(-1)[amb, None] * np.abs(wd[amb])).sum(0)
                h = hq
            o = h @ wd
            if "b_down" in ref:
                o = o + ref["b_down"][e]
            y[t] += w * o
    return y, slack


INT8 = ExecConfig(impl="cpu", activations="int8")


def run_int8(cfg, ew, x, ids, ws):
    return np.asarray(experts_cpu(jnp.asarray(x), Routing(jnp.asarray(ids), jnp.asarray(ws)), ew, cfg, INT8))


def check_int8(cfg, fmts, ids, ws, rng, tol=3e-6, bias=False, gain=1.0):
    ew, ref = quantized_case(cfg, fmts, rng, bias=bias, gain=gain)
    x = rng.normal(size=(ids.shape[0], cfg.d_model)).astype(np.float32)
    y = run_int8(cfg, ew, x, ids, ws)
    assert y.shape == x.shape and y.dtype == np.float32
    want, slack = np_experts_q8(x, ids, ws, ref, cfg, fmts)
    err = np.abs(y - want)
    assert (err <= tol * np.abs(want).max() + slack).all(), f"max excess {np.max(err - slack):.3e}"
    return y, want, ew, ref, x


def pad_width(f: int, fmts) -> int:
    g = max(int(m.split("_g")[1]) if "_g" in m else 32 for m in fmts)
    return -(-f // g) * g


@pytest.mark.parametrize("fmt", INT_FORMATS)
@pytest.mark.parametrize("d, f", [(128, 96), (96, 160), (256, 384)])
@pytest.mark.slow
def test_int_formats_match_float64_of_q8_activations(fmt, d, f, rng):
    """Every integer kind, widths with an odd number of 32-blocks (a half pair at the end)."""
    fmts = (fmt,) * 3
    g = int(fmt.split("_g")[1]) if "_g" in fmt else 32
    d, f = -(-d // g) * g, pad_width(f, fmts)
    cfg = cfg_of(d, f, 10, 3)
    check_int8(cfg, fmts, *uniform_routing(rng, 9, 3, 10), rng)


@pytest.mark.parametrize("fmts", [("q4_k",) * 3, ("q6_k",) * 3, ("q4_k", "q4_k", "q6_k")])
@pytest.mark.parametrize("t", [1, 9])
def test_k_quants_match_float64_of_q8_activations(fmts, t, rng):
    """Q4_K (scales and mins per sub-block of 32), Q6_K (scales per 16), and the Q4_K_M mix."""
    cfg = cfg_of(512, 256, 6, 2)
    check_int8(cfg, fmts, *uniform_routing(rng, t, 2, 6), rng)


@pytest.mark.parametrize("t", [1, 7, 8, 9, 130])
@pytest.mark.parametrize(
    "fmts", [("q4_0_int4", "q4_0_int4", "q8_0"), ("mlx4_g64",) * 3, ("q8_0",) * 3, ("q4_k", "q4_k", "q6_k")]
)
@pytest.mark.slow
def test_one_expert_takes_every_token(t, fmts, rng):
    """k = 1 onto one expert: row tiles of 1..4 and row chunks (> 128 rows)."""
    cfg = cfg_of(256, 256, 6, 1)
    ids = np.full((t, 1), 4, np.int32)
    check_int8(cfg, fmts, ids, rng.uniform(0.1, 1.0, size=(t, 1)).astype(np.float32), rng)


@pytest.mark.parametrize(
    "fmts",
    [
        ("bf16", "q4_0_int4", "q8_0"),
        ("q8_0", "f32", "mlx4_g32"),
        ("q5_k", "mlx4_g32", "q4_1"),
        ("q4_0_int4", "q8_0", "q4_0_int4"),
        ("q4_k", "q8_0", "q6_k"),
        ("q4_k", "q4_0_int4", "q5_0"),
    ],
)
def test_mixed_kinds_and_empty_experts(fmts, rng):
    """Integer kinds take Q8 activations, the others (float, the other GGUF blocks) float
    ones, in one layer; gate and up of different kinds read the rows quantized in two orders."""
    cfg = cfg_of(256, 256, 12, 4)
    check_int8(cfg, fmts, *skewed_routing(rng, 40, 4, 12), rng, tol=1e-5)


def test_biases_and_clamped_activation(rng):
    from helpers import shrink

    base = shrink(jaxmoe.load_config("gpt-oss-20b"), d=64, f=96)
    assert base.activation == "swiglu_oai" and base.expert_bias
    ids, ws = uniform_routing(rng, 17, base.top_k, base.num_experts)
    y, *_ = check_int8(base, ("q4_0_int4", "mlx4_g32", "q8_0"), ids, ws, rng, tol=2e-5, bias=True, gain=30.0)
    assert np.isfinite(y).all()


@settings(max_examples=15, deadline=None)
@given(
    st.sampled_from([(32, 64), (64, 32), (96, 160), (160, 96)]),
    st.integers(1, 40),
    st.integers(1, 3),
    st.sampled_from(("q8_0", "q4_0_int4", "mlx4_g32", "int8_f32")),
    st.sampled_from(("q8_0", "q4_0_int4", "mlx4_g32", "int8_f32")),
    st.integers(0, 2**31 - 1),
)
@pytest.mark.slow
def test_hypothesis_shapes_and_routings(df, t, k, fmt_up, fmt_down, seed):
    d, f = df
    rng = np.random.default_rng(seed)
    cfg = cfg_of(d, f, 7, k)
    ids, ws = skewed_routing(rng, t, k, 7, share=0.9) if k > 1 and rng.random() < 0.5 else uniform_routing(rng, t, k, 7)
    check_int8(cfg, (fmt_up, fmt_up, fmt_down), ids, ws, rng, tol=5e-6)


def gate_up_products(cfg, ew, x, ids, ws):
    """The kernel's gate | up products ``[T k, 2F]`` in sorted pair order, and that order."""
    r = Routing(jnp.asarray(ids), jnp.asarray(ws))
    e = cfg.num_experts
    plan = plan_dispatch(r.expert_ids, e, 1)
    xs = sorted_inputs(jnp.asarray(x), r, plan, cfg)
    _, gu = grouped_swiglu_saving(xs, plan.group_offsets[:e], plan.group_sizes, ew, cfg, int_dot=True)
    return np.asarray(gu), np.asarray(xs), np.asarray(plan.group_offsets), np.asarray(plan.group_sizes)


@pytest.mark.parametrize("fmt", ["q4_0_int4", "q8_0", "mlx4_g64", "q4_k", "q6_k"])
def test_gate_up_products_exact_and_within_the_documented_error(fmt, rng):
    """The products before the activation: within float rounding of Q8(x) . W, and off the
    float-activation product by at most sum_k |W[k]| dx_k / 2 (docs/design.md, "int8 activations")."""
    cfg8 = cfg_of(256, 256, 6, 2)
    ew, ref = quantized_case(cfg8, (fmt,) * 3, rng)
    ids, ws = uniform_routing(rng, 11, 2, 6)
    x = rng.normal(size=(11, 256)).astype(np.float32)
    gu, xs, offs, sizes = gate_up_products(cfg8, ew, x, ids, ws)
    q, dx = np_q8(xs)
    f = cfg8.expert_dim
    for e in range(6):
        rows = slice(int(offs[e]), int(offs[e] + sizes[e]))
        if sizes[e] == 0:
            continue
        wgu = np.concatenate([ref["w_gate"][e], ref["w_up"][e]], axis=1)  # [d, 2F]
        want = q[rows] @ wgu
        np.testing.assert_allclose(gu[rows], want, rtol=0, atol=2e-6 * np.abs(want).max())
        exact = xs[rows].astype(np.float64) @ wgu
        bound = (dx[rows] / 2) @ np.abs(wgu)
        assert (np.abs(gu[rows] - exact) <= bound * (1 + 1e-5) + 1e-6 * np.abs(exact).max()).all()
        assert np.abs(gu[rows] - exact).max() > 0  # the activations really were quantized
    assert gu.shape[1] == 2 * f


def test_error_against_float_activations_is_small(rng):
    """What a user gives up: the layer output against float activations, relative to its
    size (measured ~1% for random data; a Q4_0 weight's own error is larger)."""
    cfg = cfg_of(256, 256, 8, 2)
    ew, ref = quantized_case(cfg, ("q4_0_int4",) * 3, rng)
    ids, ws = uniform_routing(rng, 16, 2, 8)
    x = rng.normal(size=(16, 256)).astype(np.float32)
    y8 = run_int8(cfg, ew, x, ids, ws)
    yf = np.asarray(experts_cpu(jnp.asarray(x), Routing(jnp.asarray(ids), jnp.asarray(ws)), ew, cfg))
    rel = np.linalg.norm(y8 - yf) / np.linalg.norm(yf)
    assert 1e-4 < rel < 3e-2, rel


def test_a_mutated_nibble_is_caught(rng):
    cfg = cfg_of(64, 64, 4, 1)
    ids = np.full((5, 1), 2, np.int32)
    ws = rng.uniform(0.5, 1.0, size=(5, 1)).astype(np.float32)
    y, want, ew, ref, x = check_int8(cfg, ("q4_0_int4",) * 3, ids, ws, rng)
    q = np.asarray(ew.w_down.qdata).copy()
    q[2, 7, 3] ^= 0x40  # one high nibble of expert 2's down projection
    bad = dataclasses.replace(ew, w_down=dataclasses.replace(ew.w_down, qdata=jnp.asarray(q)))
    y_bad = run_int8(cfg, bad, x, ids, ws)
    _, slack = np_experts_q8(x, ids, ws, ref, cfg, ("q4_0_int4",) * 3)
    assert (np.abs(y_bad - want) > 3e-6 * np.abs(want).max() + slack).any()


@pytest.mark.parametrize("fmts", [("q4_0_int4", "q4_0_int4", "q8_0"), ("mlx4_g64",) * 3, ("q4_k", "q4_k", "q6_k")])
@pytest.mark.slow
def test_batch_invariant(fmts, rng):
    """A token's output is the same bits alone and inside batches of other sizes (every row
    takes the same integer path whatever its expert's row count)."""
    cfg = cfg_of(256, 256, 8, 2)
    ew, _ = quantized_case(cfg, fmts, rng)
    x = rng.normal(size=(40, 256)).astype(np.float32)
    ids, ws = skewed_routing(rng, 40, 2, 8, hot=int(rng.integers(8)), share=0.9)
    f = jax.jit(lambda x, i, w: experts_cpu(x, Routing(i, w), ew, cfg, INT8))
    full = np.asarray(f(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(ws)))
    for n in (1, 3, 9):
        part = np.asarray(f(jnp.asarray(x[:n]), jnp.asarray(ids[:n]), jnp.asarray(ws[:n])))
        np.testing.assert_array_equal(part, full[:n])


def test_nan_stays_in_its_token(rng):
    cfg = cfg_of(64, 64, 4, 2)
    ew, _ = quantized_case(cfg, ("q4_0_int4", "q4_0_int4", "q8_0"), rng)
    x = rng.normal(size=(6, 64)).astype(np.float32)
    x[2, 5] = np.nan
    x[4, 40] = np.inf
    ids, ws = uniform_routing(rng, 6, 2, 4)
    y = run_int8(cfg, ew, x, ids, ws)
    assert np.isnan(y[2]).all() and np.isnan(y[4]).all()
    assert np.isfinite(np.delete(y, [2, 4], axis=0)).all()


def test_quantize_activations_q8_matches_the_rule(rng):
    x = (rng.normal(size=(5, 96)) * rng.uniform(1e-3, 1e3, size=(5, 1))).astype(np.float32)
    x[1, :32] = 0.0  # an all-zero block
    x[2, 40] = np.nan
    got = np.asarray(quantize_activations_q8(jnp.asarray(x)), np.float64)
    want, dx = np_q8(x)
    want[2, 32:64] = np.nan
    np.testing.assert_allclose(got, want, rtol=1e-7, atol=0)
    ok = np.isfinite(want)
    assert (np.abs(got[ok] - x[ok]) <= dx[ok] / 2 * (1 + 1e-6)).all()
    with pytest.raises(ValueError, match="multiple of the block"):
        quantize_activations_q8(jnp.zeros((2, 40)))


def test_the_option_is_checked(rng):
    with pytest.raises(ValueError, match="ExecConfig.activations: unknown 'int4'"):
        ExecConfig(activations="int4")
    with pytest.raises(ValueError, match="ExecConfig.activations: 'int8' is a mode of impl='cpu'"):
        ExecConfig(impl="xla", activations="int8")
    with pytest.raises(ValueError, match=r"MoEConfig.int8_activations: was removed.*ExecConfig\(activations='int8'\)"):
        cfg_of(64, 64, 4, 2, int8_activations=True)
    # auto: the mode is the host strategy's; on the CPU that is the kernel
    cfg = cfg_of(64, 64, 4, 2)
    ew, _ = quantized_case(cfg, ("q4_0_int4",) * 3, rng)
    ids, ws = uniform_routing(rng, 3, 2, 4)
    x = jnp.asarray(rng.normal(size=(3, 64)).astype(np.float32))
    r = Routing(jnp.asarray(ids), jnp.asarray(ws))
    p = jaxmoe.MoEParams(jnp.asarray(rng.normal(size=(64, 4)).astype(np.float32)), ew)
    y = jaxmoe.moe_apply(p, x, cfg, ExecConfig(activations="int8"), routing=r)
    np.testing.assert_array_equal(np.asarray(y), run_int8(cfg, ew, np.asarray(x), ids, ws))


def test_gradients_pass_straight_through(rng):
    """jax.grad of an int8-activation layer: the backward treats Q8 as the identity, so the
    input and routing-weight gradients are those of float activations up to Q8's error."""
    cfg = cfg_of(128, 64, 6, 2)
    ew, _ = quantized_case(cfg, ("q4_0_int4", "q4_0_int4", "q8_0"), rng)
    ids, ws = uniform_routing(rng, 5, 2, 6)
    x = jnp.asarray(rng.normal(size=(5, 128)).astype(np.float32))

    def loss(x, w, ex):
        return jnp.sum(experts_cpu(x, Routing(jnp.asarray(ids), w), ew, cfg, ex) ** 2)

    g8 = jax.grad(loss, argnums=(0, 1))(x, jnp.asarray(ws), INT8)
    gf = jax.grad(loss, argnums=(0, 1))(x, jnp.asarray(ws), None)
    for a, b in zip(g8, gf):
        rel = float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
        assert 0 < rel < 3e-2, rel

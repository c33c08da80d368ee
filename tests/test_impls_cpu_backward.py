"""The C++ backward of ``impl="cpu"`` (jaxmoe/impls/cpu/grouped_swiglu_bwd.cc via
`jaxmoe.impls.cpu.backward.cpu_vjp`) against ``jax.vjp`` of `experts_dense` and a
float64 numpy loop: input, routing-weight, weight and bias gradients; column tails,
empty experts, one expert taking every token, T = 1 / 7 / 130; gpt-oss activation with
biases; weight_on_input; bfloat16; frozen int8 / int4 / GGUF block experts; NaN isolation;
determinism; the gather fallback for kinds the backward does not read."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import gguf_block_weight, np_act, quantize_experts, random_params

from jaxmoe import MoEConfig, RouterConfig, Routing
from jaxmoe.experts import ExpertWeights, experts_dense, gather_vjp
from jaxmoe.impls.cpu import backward, cpu_kernel_status, experts_cpu
from jaxmoe.impls.cpu.backward import backward_kernel_status, backward_supports, cpu_vjp
from jaxmoe.quant import GGUF_BLOCKS, materialize


def test_kernels_build():
    """Both libraries build here (g++ is a documented requirement): without this, the
    backward would silently be gather's fallback and the tests below would still pass."""
    assert cpu_kernel_status()[0], cpu_kernel_status()[1]
    assert backward_kernel_status()[0], backward_kernel_status()[1]


def cfg_of(d, f, e, k, **kw):
    return MoEConfig(d_model=d, expert_dim=f, router=RouterConfig(num_experts=e, top_k=k), **kw)


def problem(rng, t, cfg, ids=None, bias=False, dtype=jnp.float32):
    e, k = cfg.num_experts, cfg.top_k
    if ids is None:
        ids = np.stack([rng.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32)
    ws = rng.uniform(0.05, 1.0, size=ids.shape).astype(np.float32)
    d, f = cfg.d_model, cfg.expert_dim
    shapes: dict[str, tuple[int, ...]] = dict(w_gate=(e, d, f), w_up=(e, d, f), w_down=(e, f, d))
    if bias:
        shapes.update(b_gate=(e, f), b_up=(e, f), b_down=(e, d))
    ew = ExpertWeights(**{n: jnp.asarray(rng.normal(size=s) * 0.3, dtype) for n, s in shapes.items()})
    x = jnp.asarray(rng.normal(size=(ids.shape[0], d)), dtype)
    g = jnp.asarray(rng.normal(size=(ids.shape[0], d)), jnp.float32)
    return x, Routing(jnp.asarray(ids), jnp.asarray(ws)), ew, g


def vjp_of(fn, cfg, x, r, ew, g):
    return jax.vjp(lambda x, r, w: fn(x, r, w, cfg), x, r, ew)[1](g)


def assert_grads_close(got, ref, rtol=1e-4, atol=1e-4):
    names = ["x", "weights", *[f"experts.{n}" for n in ("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down")]]
    gl = [got[0], got[1].weights, *jax.tree.leaves(got[2])]
    rl = [ref[0], ref[1].weights, *jax.tree.leaves(ref[2])]
    assert len(gl) == len(rl)
    for n, a, b in zip(names, gl, rl):
        assert a.shape == b.shape and a.dtype == b.dtype, (n, a.shape, a.dtype, b.shape, b.dtype)
        b = np.asarray(b, np.float32)
        np.testing.assert_allclose(
            np.asarray(a, np.float32), b, rtol=rtol, atol=atol * max(1.0, np.abs(b).max()), err_msg=n
        )


def test_backward_kernel_is_built():
    ok, msg = backward_kernel_status()
    assert ok, msg


@pytest.mark.parametrize(
    "t, d, f, e, k",
    [
        (1, 48, 40, 6, 2),
        (7, 40, 72, 8, 3),
        (130, 64, 136, 12, 4),
        (7, 50, 9, 5, 2),
        (1, 16, 8, 4, 1),
        (130, 50, 45, 6, 2),
    ],
)
@pytest.mark.slow
def test_equals_dense_vjp(t, d, f, e, k, rng):
    """Random shapes with column tails (d, F not multiples of the vector or the blocks); T = 130
    puts more than 16 rows on each expert (the packed, transposed weights and their tails)."""
    cfg = cfg_of(d, f, e, k)
    x, r, ew, g = problem(rng, t, cfg)
    assert_grads_close(vjp_of(experts_cpu, cfg, x, r, ew, g), vjp_of(experts_dense, cfg, x, r, ew, g))


def np_backward(x, ids, ws, ew, g, cfg):
    """float64 per-pair loop: (dx, dweights, dW_gate, dW_up, dW_down, db_gate, db_up, db_down)."""
    x, ws, g = (np.asarray(a, np.float64) for a in (x, ws, g))
    wg, wu, wd = (np.asarray(w, np.float64) for w in (ew.w_gate, ew.w_up, ew.w_down))
    bg, bu, bd = (np.asarray(b, np.float64) for b in (ew.b_gate, ew.b_up, ew.b_down))
    L, a = cfg.swiglu_limit, cfg.swiglu_alpha
    out = [np.zeros_like(x), np.zeros_like(ws), *(np.zeros_like(v) for v in (wg, wu, wd, bg, bu, bd))]
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            e, w = int(ids[t, s]), ws[t, s]
            gv, uv = x[t] @ wg[e] + bg[e], x[t] @ wu[e] + bu[e]
            h = np_act(gv, uv, "swiglu_oai", a, L)
            out[1][t, s] = g[t] @ (h @ wd[e] + bd[e])
            dh = w * (wd[e] @ g[t])
            gc, uc = np.minimum(gv, L), np.clip(uv, -L, L)
            sig = 1 / (1 + np.exp(-a * gc))
            dgv = dh * np.where(gv <= L, (uc + 1) * (sig + a * gc * sig * (1 - sig)), 0)
            duv = dh * np.where(np.abs(uv) <= L, gc * sig, 0)
            out[0][t] += wg[e] @ dgv + wu[e] @ duv
            out[2][e] += np.outer(x[t], dgv)
            out[3][e] += np.outer(x[t], duv)
            out[4][e] += np.outer(h, w * g[t])
            out[5][e] += dgv
            out[6][e] += duv
            out[7][e] += w * g[t]
    return out


@pytest.mark.slow
def test_gpt_oss_with_biases_equals_float64_loop(rng):
    cfg = cfg_of(40, 24, 6, 2, activation="swiglu_oai", expert_bias=True, swiglu_limit=1.5)
    x, r, ew, g = problem(rng, 9, cfg, bias=True)  # limit 1.5: both clamps active on some entries
    dx, dr, dew = vjp_of(experts_cpu, cfg, x, r, ew, g)
    want = np_backward(x, np.asarray(r.expert_ids), r.weights, ew, g, cfg)
    got = [dx, dr.weights, dew.w_gate, dew.w_up, dew.w_down, dew.b_gate, dew.b_up, dew.b_down]
    for i, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_allclose(np.asarray(a, np.float64), b, rtol=1e-4, atol=1e-4 * np.abs(b).max(), err_msg=str(i))
    assert_grads_close((dx, dr, dew), vjp_of(experts_dense, cfg, x, r, ew, g))


def test_weight_on_input(rng):
    cfg = cfg_of(32, 24, 6, 2, weight_on_input=True)
    x, r, ew, g = problem(rng, 11, cfg)
    assert_grads_close(vjp_of(experts_cpu, cfg, x, r, ew, g), vjp_of(experts_dense, cfg, x, r, ew, g))


@pytest.mark.parametrize("t", [1, 7, 130])
@pytest.mark.slow
def test_one_expert_takes_every_token_and_empty_experts(t, rng):
    """Slot 0 of every token on expert 3; experts 0 and 7 never chosen: zero weight gradients."""
    cfg = cfg_of(32, 40, 8, 2, expert_bias=True)
    ids = np.stack([[3, rng.choice([1, 2, 4, 5, 6])] for _ in range(t)]).astype(np.int32)
    x, r, ew, g = problem(rng, t, cfg, ids=ids, bias=True)
    got = vjp_of(experts_cpu, cfg, x, r, ew, g)
    assert_grads_close(got, vjp_of(experts_dense, cfg, x, r, ew, g))
    for leaf in jax.tree.leaves(got[2]):
        assert not np.asarray(leaf)[[0, 7]].any()
        assert np.asarray(leaf)[3].any()


@pytest.mark.slow
def test_bfloat16_weights_and_activations(rng):
    cfg = cfg_of(48, 40, 6, 2)
    x, r, ew, g = problem(rng, 13, cfg, dtype=jnp.bfloat16)
    got = vjp_of(experts_cpu, cfg, x, r, ew, g)
    assert got[0].dtype == jnp.bfloat16 and got[2].w_gate.dtype == jnp.bfloat16
    # the dense path rounds its hidden cotangent to bfloat16, the kernel keeps float32
    assert_grads_close(got, vjp_of(experts_dense, cfg, x, r, ew, g), rtol=3e-2, atol=2e-2)


@pytest.mark.parametrize("quant", ["int8", "int4"])
@pytest.mark.slow
def test_quantized_experts_are_frozen(quant, rng):
    """Input and routing gradients equal those of the dequantized float weights; the
    experts get zero cotangents."""
    cfg = cfg_of(64, 32, 6, 2)
    qp = quantize_experts(random_params(cfg, rng), quant)
    qew = qp.experts
    assert backward_supports(qew) is None
    few = ExpertWeights(*(materialize(w, jnp.float32) for w in (qew.w_gate, qew.w_up, qew.w_down)))
    x, r, _, g = problem(rng, 9, cfg)
    dx, dr, dew = vjp_of(experts_cpu, cfg, x, r, qew, g)
    rx, rr, _ = vjp_of(experts_dense, cfg, x, r, few, g)
    np.testing.assert_allclose(np.asarray(dx), np.asarray(rx), rtol=1e-4, atol=1e-4 * float(jnp.abs(rx).max()))
    np.testing.assert_allclose(np.asarray(dr.weights), np.asarray(rr.weights), rtol=1e-4, atol=1e-4)
    for leaf in jax.tree.leaves(dew):
        assert not np.asarray(leaf).astype(bool).any()


def test_nan_routing_weight_stays_in_its_row(rng):
    cfg = cfg_of(32, 24, 6, 2)
    x, r, ew, g = problem(rng, 9, cfg)
    r = Routing(r.expert_ids, r.weights.at[4, 1].set(jnp.nan))
    dx, dr, _ = vjp_of(experts_cpu, cfg, x, r, ew, g)
    bad = np.isnan(np.asarray(dx)).any(axis=1) | np.isnan(np.asarray(dr.weights)).any(axis=1)
    assert bad.tolist() == [i == 4 for i in range(9)]


def test_deterministic(rng):
    cfg = cfg_of(64, 136, 4, 2)
    x, r, ew, g = problem(rng, 130, cfg)
    a, b = (jax.tree.leaves(vjp_of(experts_cpu, cfg, x, r, ew, g)) for _ in range(2))
    for u, v in zip(a, b):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


@pytest.mark.parametrize(
    "fmts",
    [("q4_k", "q4_k", "q6_k"), ("q5_k", "q6_k", "q4_k"), ("q5_0", "q5_1", "q4_1")]
    + [("q2_k", "q3_k", "iq4_xs"), ("iq4_nl", "mxfp4", "iq4_nl"), ("q4_0", "q4_0", "q4_0")]
    + [("iq2_xxs", "iq2_xs", "iq2_s"), ("iq3_xxs", "iq3_s", "iq1_s"), ("iq1_m", "tq1_0", "tq2_0")],
)
@pytest.mark.parametrize("t", [3, 20])
@pytest.mark.slow
def test_gguf_block_experts_are_frozen_in_the_kernel(fmts, t, rng):
    """GGUF block kinds (Q4_K_M's q4_k gate/up with q6_k down, ...) in the C++ backward:
    input and routing gradients equal those of the float weights gguf.quants decodes from
    the same bytes (float64 reference loop through experts_dense); the experts get zero
    cotangents; the compiled gradient runs the backward custom call (no gather loop).
    F = 96 / 256 with 64-column tasks: blocks split across tasks are decoded whole."""
    block = max(GGUF_BLOCKS[f][0] for f in fmts)
    d, f = (256, 256) if block == 256 else (64, 96)
    cfg = cfg_of(d, f, 6, 2)
    shapes = {"w_gate": (6, f, d), "w_up": (6, f, d), "w_down": (6, d, f)}  # stored [E, out, in]
    qw, fw = {}, {}
    for (name, shape), kind in zip(shapes.items(), fmts):
        qw[name], ref = gguf_block_weight(rng, kind, shape)
        fw[name] = jnp.asarray(ref.astype(np.float32))
    qew, few = ExpertWeights(**qw), ExpertWeights(**fw)
    assert backward_supports(qew) is None
    x, r, _, g = problem(rng, t, cfg)
    dx, dr, dew = vjp_of(experts_cpu, cfg, x, r, qew, g)
    rx, rr, _ = vjp_of(experts_dense, cfg, x, r, few, g)
    np.testing.assert_allclose(np.asarray(dx), np.asarray(rx), rtol=1e-4, atol=1e-4 * float(jnp.abs(rx).max()))
    np.testing.assert_allclose(
        np.asarray(dr.weights), np.asarray(rr.weights), rtol=1e-4, atol=1e-4 * float(jnp.abs(rr.weights).max())
    )
    for leaf in jax.tree.leaves(dew):
        assert not np.asarray(leaf).astype(bool).any()
    grad = jax.jit(jax.grad(lambda x: jnp.sum(experts_cpu(x, r, qew, cfg) * g)))
    assert backward.BWD_TARGET in grad.lower(x).compile().as_text()


@pytest.mark.slow
def test_kinds_the_backward_does_not_read_fall_back_to_gather(rng, monkeypatch):
    """A quantized kind outside `BWD_KINDS` (every kind the forward reads is in it; here
    int8 is taken out): `backward_supports` names it and `cpu_vjp` returns gather's VJP
    (experts frozen)."""
    cfg = cfg_of(64, 32, 4, 2)
    q = quantize_experts(random_params(cfg, rng), "int8").experts
    x, r, _, g = problem(rng, 5, cfg)
    want = jax.tree.leaves(cpu_vjp(cfg, (x, r, q), g))
    monkeypatch.setattr(backward, "BWD_KINDS", {"int4": 2})
    assert "'int8'" in (backward_supports(q) or "")
    got = cpu_vjp(cfg, (x, r, q), g)
    assert_same = jax.tree.leaves(gather_vjp(cfg, (x, r, q), g))
    for a, b, c in zip(jax.tree.leaves(got), assert_same, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        if a.dtype == jax.dtypes.float0:
            continue
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(c, np.float32), rtol=1e-4, atol=1e-4)


def test_forward_saves_gate_up_products(rng):
    """`grouped_swiglu_saving`'s residual is each sorted row's ``x W_g | x W_u``
    before the biases (float64 reference), for float, int4 and GGUF q4_k gate / up; the
    outputs equal those of the call that saves nothing."""
    from jaxmoe.dispatch import plan_dispatch
    from jaxmoe.impls.common import sorted_inputs
    from jaxmoe.impls.cpu.kernel import grouped_swiglu, grouped_swiglu_saving

    assert cpu_kernel_status()[0]  # builds and registers the custom call
    cfg = cfg_of(256, 72, 5, 2, expert_bias=True)
    x, r, ew, _ = problem(rng, 11, cfg, bias=True)
    qg, fg = gguf_block_weight(rng, "q4_k", (5, 72, 256))
    for gate in (ew.w_gate, qg):
        e = ExpertWeights(gate, ew.w_up, ew.w_down, ew.b_gate, ew.b_up, ew.b_down)
        plan = plan_dispatch(r.expert_ids, 5, 1)
        xs = sorted_inputs(x, r, plan, cfg).astype(jnp.float32)
        off, sizes = plan.group_offsets[:5], plan.group_sizes
        ys, gu = grouped_swiglu_saving(xs, off, sizes, e, cfg)
        np.testing.assert_array_equal(np.asarray(ys), np.asarray(grouped_swiglu(xs, off, sizes, e, cfg)))
        wg = fg if gate is qg else np.asarray(ew.w_gate, np.float64)
        owner = np.repeat(np.arange(5), np.asarray(sizes))
        xs64 = np.asarray(xs, np.float64)
        want_g = np.einsum("pd,pdf->pf", xs64, wg[owner])
        want_u = np.einsum("pd,pdf->pf", xs64, np.asarray(ew.w_up, np.float64)[owner])
        np.testing.assert_allclose(np.asarray(gu), np.concatenate([want_g, want_u], 1), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("case", ["float", "gpt_oss_bias", "bf16", "q4_k_m"])
@pytest.mark.slow
def test_saved_and_recomputed_gate_up_agree(case, rng):
    """The backward reading the forward's gate | up residual (what `jax.vjp` runs) and the
    one recomputing them (`cpu_vjp` without it) give the same gradients, and those equal
    `experts_dense`'s (for Q4_K_M: of the float weights gguf.quants decodes); a changed
    residual changes the gradients (the backward reads it)."""
    from jaxmoe.dispatch import plan_dispatch
    from jaxmoe.impls.common import sorted_inputs
    from jaxmoe.impls.cpu.kernel import grouped_swiglu_saving

    kw = dict(activation="swiglu_oai", expert_bias=True, swiglu_limit=1.5) if case == "gpt_oss_bias" else {}
    d, f = (256, 256) if case == "q4_k_m" else (48, 40)
    cfg = cfg_of(d, f, 6, 2, **kw)
    dtype = jnp.bfloat16 if case == "bf16" else jnp.float32
    x, r, ew, g = problem(rng, 21, cfg, bias=case == "gpt_oss_bias", dtype=dtype)
    ref_ew = ew
    if case == "q4_k_m":
        stored = {"w_gate": ("q4_k", (6, f, d)), "w_up": ("q4_k", (6, f, d)), "w_down": ("q6_k", (6, d, f))}
        made = {n: gguf_block_weight(rng, kind, shape) for n, (kind, shape) in stored.items()}
        ew = ExpertWeights(**{n: q for n, (q, _) in made.items()})
        ref_ew = ExpertWeights(**{n: jnp.asarray(w.astype(np.float32)) for n, (_, w) in made.items()})
    saved = vjp_of(experts_cpu, cfg, x, r, ew, g)
    recomputed = cpu_vjp(cfg, (x, r, ew), g)
    ref = vjp_of(experts_dense, cfg, x, r, ref_ew, g)
    if case == "q4_k_m":  # frozen experts: the input and routing-weight gradients
        saved, recomputed, ref = ((v[0], v[1], None) for v in (saved, recomputed, ref))
        pairs = [(saved, recomputed, 1e-5), (saved, ref, 1e-4)]
        for a, b, tol in pairs:
            for u, v in ((a[0], b[0]), (a[1].weights, b[1].weights)):
                v = np.asarray(v, np.float32)
                np.testing.assert_allclose(np.asarray(u), v, rtol=tol, atol=tol * np.abs(v).max())
    else:
        tol = dict(rtol=3e-2, atol=2e-2) if case == "bf16" else dict(rtol=1e-5, atol=1e-5)
        assert_grads_close(recomputed, saved, **tol)
        assert_grads_close(saved, ref, **(tol if case == "bf16" else {}))
    plan = plan_dispatch(r.expert_ids, 6, 1)  # the residual as the forward makes it
    xs = sorted_inputs(x, r, plan, cfg).astype(jnp.float32)
    _, gu = grouped_swiglu_saving(xs, plan.group_offsets[:6], plan.group_sizes, ew, cfg, round_h=case == "bf16")
    moved = cpu_vjp(cfg, (x, r, ew, gu * 1.01), g)
    assert not np.allclose(np.asarray(moved[0], np.float32), np.asarray(saved[0], np.float32))


def np_shared_grads(x, g, wg, wu, wd, gate):
    """Hand-derived float64 gradients of ``y = s * (silu(x Wg) * (x Wu)) Wd``,
    ``s = sigmoid(x . gate)`` (1 without a gate), for the upstream ``g``: ``(dx, dWg, dWu,
    dWd, dgate)``."""
    x, g, wg, wu, wd = (np.asarray(a, np.float64) for a in (x, g, wg, wu, wd))
    a, b = x @ wg, x @ wu
    sig = 1.0 / (1.0 + np.exp(-a))
    h = a * sig * b
    o = h @ wd
    s = np.ones(x.shape[0]) if gate is None else 1.0 / (1.0 + np.exp(-(x @ np.asarray(gate, np.float64))))
    do = s[:, None] * g
    dh = do @ wd.T
    da = dh * b * sig * (1.0 + a * (1.0 - sig))
    db = dh * a * sig
    dx = da @ wg.T + db @ wu.T
    dgate = None
    if gate is not None:
        dlogit = (g * o).sum(1) * s * (1.0 - s)
        dx = dx + dlogit[:, None] * np.asarray(gate, np.float64)[None, :]
        dgate = x.T @ dlogit
    return dx, x.T @ da, x.T @ db, h.T @ do, dgate


@pytest.mark.parametrize("case", ["f32", "f32_no_gate", "bf16_weights", "bf16_x", "int8", "int4", "q4_k_m"])
@pytest.mark.parametrize("t", [1, 7, 33])
@pytest.mark.slow
def test_shared_expert_backward_in_the_kernel(case, t, rng):
    """The shared expert's backward (`shared_expert_cpu`'s VJP) runs in the C++ backward
    kernel as one expert owning every row: input, gate and (float) weight gradients equal
    a hand-derived float64 numpy gradient; quantized matrices (int8, int4, Q4_K_M's q4_k /
    q6_k, reference weights decoded by gguf.quants) are frozen (zero cotangents) and the
    gate vector still trains; the compiled gradient runs the backward custom call."""
    from jaxmoe.experts import SharedWeights
    from jaxmoe.impls.cpu.kernel import shared_expert_cpu
    from jaxmoe.quant import quantize_int4_affine, quantize_int8

    d, f = (256, 256) if case == "q4_k_m" else (96, 72 if case.startswith(("f32", "bf16")) else 96)
    cfg = cfg_of(d, 32, 4, 2)
    wg, wu = (jnp.asarray(rng.normal(size=(d, f)) * 0.1, jnp.float32) for _ in range(2))
    wd = jnp.asarray(rng.normal(size=(f, d)) * 0.1, jnp.float32)
    gate = None if case == "f32_no_gate" else jnp.asarray(rng.normal(size=d) * 0.2, jnp.float32)
    mats = (wg, wu, wd)
    if case in ("bf16_weights", "bf16_x"):  # bf16_x: the kernel wants bfloat16 weights too
        mats = tuple(w.astype(jnp.bfloat16) for w in mats)
    elif case in ("int8", "int4"):
        q = quantize_int8 if case == "int8" else (lambda w: quantize_int4_affine(w, 32))
        mats = tuple(q(w) for w in mats)
    elif case == "q4_k_m":
        made = [
            gguf_block_weight(rng, k, s) for k, s in (("q4_k", (1, f, d)), ("q4_k", (1, f, d)), ("q6_k", (1, d, f)))
        ]
        mats = tuple(jax.tree.map(lambda a: a[0], q) for q, _ in made)
    ref_mats = [np.asarray(materialize(w, jnp.float32), np.float64) for w in mats]
    if case == "q4_k_m":
        ref_mats = [w[0] for _, w in made]
    sw = SharedWeights(*mats, gate)
    x_dtype = jnp.bfloat16 if case == "bf16_x" else jnp.float32
    x = jnp.asarray(rng.normal(size=(t, d)), x_dtype)
    g = jnp.asarray(rng.normal(size=(t, d)), jnp.float32)
    dx, dsw = jax.vjp(lambda x, sw: shared_expert_cpu(x, sw, cfg), x, sw)[1](g)
    want = np_shared_grads(np.asarray(x, np.float64), g, *ref_mats, gate)
    tol = 2e-2 if "bf16" in case else 1e-4

    def close(a, b, what):
        a, b = np.asarray(a, np.float64), np.asarray(b)
        assert np.abs(a - b).max() <= tol * np.abs(b).max(), what

    assert dx.dtype == x_dtype
    close(dx, want[0], "dx")
    if gate is None:
        assert dsw.gate is None
    else:
        close(dsw.gate, want[4], "gate")
    frozen = case in ("int8", "int4", "q4_k_m")
    for name, got, w in zip(("w_gate", "w_up", "w_down"), (dsw.w_gate, dsw.w_up, dsw.w_down), want[1:4]):
        if frozen:
            for leaf in jax.tree.leaves(got):
                assert not np.asarray(leaf).astype(bool).any(), f"frozen {name} got a gradient"
        else:
            assert got.dtype == getattr(sw, name).dtype
            close(got, w, name)
    grad = jax.jit(jax.grad(lambda x: jnp.sum(shared_expert_cpu(x, sw, cfg) * g)))
    assert backward.BWD_TARGET in grad.lower(x).compile().as_text()


@pytest.mark.slow
def test_xla_shared_expert_freezes_quantized_matrices(rng):
    """`jaxmoe.experts.shared_expert` (every strategy's shared expert outside the C++
    kernel) gives a quantized shared expert's scales no gradient, as the kernel's backward
    does; its float gate still trains."""
    from jaxmoe.experts import SharedWeights, shared_expert
    from jaxmoe.quant import quantize_int8

    cfg = cfg_of(64, 32, 4, 2)
    sw = SharedWeights(
        *(quantize_int8(jnp.asarray(rng.normal(size=s) * 0.1, jnp.float32)) for s in ((64, 96), (64, 96), (96, 64))),
        jnp.asarray(rng.normal(size=64) * 0.2, jnp.float32),
    )
    x = jnp.asarray(rng.normal(size=(5, 64)), jnp.float32)
    dsw = jax.grad(lambda sw: jnp.sum(shared_expert(x, sw, cfg) ** 2), allow_int=True)(sw)
    for w in (dsw.w_gate, dsw.w_up, dsw.w_down):
        assert not np.asarray(w.scales).any()
    assert np.abs(np.asarray(dsw.gate)).max() > 0

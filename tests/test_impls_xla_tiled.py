"""``xla_tiled`` (the loop-free XLA formulation for GPUs without Pallas) against the float64
numpy references: every preset family (shrunk), quantized and not, uneven routing, empty
experts, one expert taking every token, every layout (pairs, capacity, tiles); and its
shape: no loop, no ``[T, E, ...]`` array, and in the capacity layout no copy of the
weights but the overflow visits' in the traced program."""

import dataclasses

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import np_experts, np_moe, params_to_numpy, quantize_experts, random_params, shrink, skewed_routing
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.test_util import check_grads

import jaxmoe
from jaxmoe import MoEConfig, RouterConfig, Routing
from jaxmoe.execution import ExecConfig
from jaxmoe.experts import experts_dense
from jaxmoe.impls.xla_tiled import (
    LAYOUTS,
    MAX_BLOCK_M,
    MIN_CAPACITY,
    batched_mm,
    choose_block_m,
    experts_xla_tiled,
    overflow_branch,
    overflow_buckets,
    overflow_visits,
)

PRESETS = jaxmoe.list_presets()
F32 = dict(rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("t", [1, 11])
@pytest.mark.slow
def test_presets_match_float64(preset, t, rng):
    cfg = shrink(jaxmoe.load_config(preset))
    p = random_params(cfg, rng)
    x = rng.normal(size=(t, cfg.d_model)).astype(np.float32)
    y = jaxmoe.moe_apply(p, jnp.asarray(x), cfg, impl="xla_tiled")
    ref, _, _ = np_moe(x, params_to_numpy(p), cfg)
    np.testing.assert_allclose(np.asarray(y), ref, **F32)


@pytest.mark.parametrize("preset", ["qwen3.6-35b-a3b", "gpt-oss-20b"])
@pytest.mark.parametrize("quant", ["int8", "int4"])
@pytest.mark.parametrize("t", [1, 9])
@pytest.mark.slow
def test_quantized_experts(preset, quant, t, rng):
    cfg = shrink(jaxmoe.load_config(preset))
    p = random_params(cfg, rng)
    p = quantize_experts(p, quant)
    x = rng.normal(size=(t, cfg.d_model)).astype(np.float32)
    ref, _, _ = np_moe(x, params_to_numpy(p), cfg)
    y = jaxmoe.moe_apply(p, jnp.asarray(x), cfg, impl="xla_tiled")
    np.testing.assert_allclose(np.asarray(y), ref, **F32)


def hot_expert_ids(rng, t: int, e: int, cap: int, visits: int) -> np.ndarray:
    """``[t, 1]`` ids in random order: expert 0 takes ``cap * (visits + 1)`` rows (its
    first block and exactly ``visits`` overflow blocks), the other rows go round the other
    experts, at most ``cap`` each (no overflow of their own)."""
    hot = cap * (visits + 1)
    rest = np.arange(t - hot, dtype=np.int32) % (e - 1) + 1
    assert np.bincount(rest, minlength=e).max() <= cap
    return rng.permutation(np.concatenate([np.zeros(hot, np.int32), rest]))[:, None]


def with_random_biases(p, rng):
    """``p`` with random (nonzero) routed-expert biases: init leaves them zero."""
    ew = p.experts
    biases = {b: jnp.asarray(rng.normal(size=getattr(ew, b).shape), jnp.float32) for b in ("b_gate", "b_up", "b_down")}
    return dataclasses.replace(p, experts=dataclasses.replace(ew, **biases))


# uneven routing, empty experts and block sizes: tests/test_impls.py::test_uneven_routing_block_sizes


@pytest.mark.parametrize("layout", ["capacity", "tiles"])
@pytest.mark.parametrize("block_m", [None, 1, 8, 64])
@pytest.mark.slow
def test_one_expert_takes_every_token(block_m, layout, rng):
    """At block_m 8 the capacity layout's overflow bound is reached: 29 rows of one expert
    make cdiv(29, 8) - 1 = 3 = overflow_visits(29, 8) overflow blocks."""
    cfg = MoEConfig(d_model=32, expert_dim=16, router=RouterConfig(num_experts=8, top_k=1), expert_bias=True)
    p = with_random_biases(random_params(cfg, rng), rng)
    t = 29
    ids = np.full((t, 1), 5, np.int32)
    ws = rng.uniform(0.1, 1.0, size=(t, 1)).astype(np.float32)
    x = rng.normal(size=(t, 32)).astype(np.float32)
    ref = np_experts(x, ids, ws, params_to_numpy(p), cfg)
    r = Routing(jnp.asarray(ids), jnp.asarray(ws))
    y = experts_xla_tiled(jnp.asarray(x), r, p.experts, cfg, ExecConfig(block_m=block_m, layout=layout))
    np.testing.assert_allclose(np.asarray(y), ref, **F32)


@pytest.mark.parametrize("cap", [1, 2, 3, 8])
@pytest.mark.parametrize("quant", [None, "int4"])
@pytest.mark.slow
def test_capacity_overflow(cap, quant, rng):
    """Hot experts far over the capacity, others at or just over it, several empty; biases."""
    cfg = MoEConfig(d_model=64, expert_dim=32, router=RouterConfig(num_experts=12, top_k=3), expert_bias=True)
    p = with_random_biases(random_params(cfg, rng), rng)
    if quant:
        p = quantize_experts(p, quant)
    t = 23
    ids, ws = skewed_routing(rng, t, 3, 12, share=0.9)
    ids[:4, 2] = 11  # expert 11: exactly 4 rows unless the pool holds it
    x = rng.normal(size=(t, 64)).astype(np.float32)
    ref = np_experts(x, ids, ws, params_to_numpy(p), cfg)
    r = Routing(jnp.asarray(ids), jnp.asarray(ws))
    y = experts_xla_tiled(jnp.asarray(x), r, p.experts, cfg, ExecConfig(block_m=cap, layout="capacity"))
    np.testing.assert_allclose(np.asarray(y), ref, **F32)
    sizes = np.bincount(ids.ravel(), minlength=12)
    assert (sizes > cap).any() and (sizes == 0).any()  # overflow and empty experts both happen


@settings(deadline=None)
@given(st.lists(st.integers(0, 60), min_size=1, max_size=24), st.integers(1, 17))
def test_overflow_visits_bound(sizes, cap):
    """Every routing's overflow blocks fit the static bound (a numpy count, not the code's)."""
    blocks = sum(max(-(-n // cap) - 1, 0) for n in sizes)
    assert blocks <= overflow_visits(sum(sizes), cap)


def test_overflow_buckets():
    """Written out: 0, powers of 4 from 2 below the bound, the bound."""
    assert overflow_buckets(2048, 16) == (0, 2, 8, 32, 127)  # Qwen3.6 at T = 256
    assert overflow_buckets(512, 8) == (0, 2, 8, 32, 63)
    assert overflow_buckets(17, 8) == (0, 2)
    assert overflow_buckets(9, 8) == (0, 1)
    assert overflow_buckets(8, 8) == (0,)


@pytest.mark.parametrize("p, cap", [(2048, 16), (512, 8), (256, 8), (288, 8), (17, 8), (9, 8), (4096, 8)])
def test_overflow_branch_picks_the_smallest_count_holding_the_visits(p, cap):
    """The closed form of the branch index against a numpy search over `overflow_buckets`,
    for every visit count up to the bound (`lax.switch` clamps past the last branch)."""
    buckets = overflow_buckets(p, cap)
    visits = np.arange(buckets[-1] + 1)
    want = np.searchsorted(np.asarray(buckets), visits, side="left")
    got = np.minimum(np.asarray(overflow_branch(jnp.asarray(visits, jnp.int32))), len(buckets) - 1)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("visits", [0, 1, 2, 3, 8, 9, 30, 31])
@pytest.mark.slow
def test_capacity_takes_the_branch_holding_its_visits(visits, rng):
    """Calls whose overflow visits land on, just past and just under each compiled count
    (0, 2, 8, 31 for P = 256, C = 8): every row gets its own expert's result."""
    e, k, cap, t = 32, 1, 8, 256
    cfg = MoEConfig(d_model=32, expert_dim=16, router=RouterConfig(num_experts=e, top_k=k), expert_bias=True)
    p = with_random_biases(random_params(cfg, rng), rng)
    assert overflow_buckets(t * k, cap) == (0, 2, 8, 31)
    ids = hot_expert_ids(rng, t, e, cap, visits)
    ws = rng.uniform(0.1, 1.0, size=(t, k)).astype(np.float32)
    x = rng.normal(size=(t, 32)).astype(np.float32)
    ref = np_experts(x, ids, ws, params_to_numpy(p), cfg)
    r = Routing(jnp.asarray(ids), jnp.asarray(ws))
    y = experts_xla_tiled(jnp.asarray(x), r, p.experts, cfg, ExecConfig(block_m=cap, layout="capacity"))
    np.testing.assert_allclose(np.asarray(y), ref, **F32)


@pytest.mark.parametrize("t", [9, 41])
def test_capacity_copies_only_overflow_weights(t, rng):
    """The first block of every expert reads the weights as they are (a dot on the stored
    ``[E, d, F]``); the only weight gathers are the overflow visits', three per compiled
    visit count (`overflow_buckets`), the largest the static bound."""
    e, k = 23, 2
    cfg = MoEConfig(d_model=16, expert_dim=8, router=RouterConfig(num_experts=e, top_k=k))
    p = random_params(cfg, rng)
    r = Routing(*map(jnp.asarray, skewed_routing(rng, t, k, e)))
    cap = choose_block_m(t * k, e) if t * k > e else 4
    jaxpr = jax.make_jaxpr(lambda x, w: experts_xla_tiled(x, r, w, cfg, ExecConfig(block_m=cap, layout="capacity")))(
        jnp.asarray(rng.normal(size=(t, 16)), jnp.float32), p.experts
    ).jaxpr
    weights = {(e, 16, 8), (e, 8, 16)}
    eqns = list(_eqns(jaxpr))
    gathered = [
        q.outvars[0].aval.shape for q in eqns if q.primitive.name == "gather" and q.invars[0].aval.shape in weights
    ]
    buckets = overflow_buckets(t * k, cap)  # one switch branch per visit count past 0
    assert sorted(s[0] for s in gathered) == sorted(3 * buckets[1:]), gathered
    assert max(s[0] for s in gathered) == overflow_visits(t * k, cap)
    direct = [q for q in eqns if q.primitive.name == "dot_general" and any(v.aval.shape in weights for v in q.invars)]
    # each projection once: `batched_mm` takes the platform group from the call's ExecConfig
    # (no switch of its own); one gate, up and down dot on the stored weights
    assert len(direct) == 3, [q.invars for q in direct]


@settings(deadline=None, max_examples=30)
@given(
    st.integers(0, 2**31 - 1),
    st.integers(1, 5),
    st.sampled_from([1, 2, 3, 8]),
    st.sampled_from(["float32", "bfloat16"]),
    st.booleans(),
    st.sampled_from(["cpu", "default"]),
)
def test_batched_mm_matches_float64(seed, v, m, dtype, jit, platform):
    """Each platform form of `batched_mm` (the CPU's: a transposed float32 operand, bf16
    operands as stored, or an upcast matrix-vector product; the other platforms': the
    operands as stored) against a float64 einsum of the same (rounded) operands."""
    r = np.random.default_rng(seed)
    k, n = int(r.integers(1, 70)), int(r.integers(1, 40))
    a = jnp.asarray(r.normal(size=(v, m, k)), dtype)
    b = jnp.asarray(r.normal(size=(v, k, n)), dtype)
    fn = jax.jit(batched_mm, static_argnums=2) if jit else batched_mm
    y = fn(a, b, platform)
    assert y.dtype == jnp.float32 and y.shape == (v, m, n)
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    ref = np.einsum("vmk,vkn->vmn", a64, b64)
    scale = np.einsum("vmk,vkn->vmn", np.abs(a64), np.abs(b64))  # float32 sums: error within k eps of this
    np.testing.assert_array_less(np.abs(np.asarray(y) - ref), 1e-6 * k * scale + 1e-30)


@pytest.mark.parametrize("m", [1, 4])
def test_batched_mm_bf16_weights_stay_bf16_on_the_cpu(m, rng):
    """Lowered for the CPU, bf16 products with more than one row keep the ``[V, K, N]``
    operand in bf16 (no float32 copy of every expert's weights per call); matrix-vector
    products (``m = 1``) upcast it, which is faster there."""
    v, k, n = 6, 64, 40
    a = jnp.asarray(rng.normal(size=(v, m, k)), jnp.bfloat16)
    b = jnp.asarray(rng.normal(size=(v, k, n)), jnp.bfloat16)
    hlo = jax.jit(batched_mm).lower(a, b).compile().as_text()
    upcast = f"f32[{v},{k},{n}]" in hlo
    assert upcast == (m == 1), hlo


@pytest.mark.slow
def test_weight_on_input_and_bf16(rng):
    cfg = MoEConfig(
        d_model=32,
        expert_dim=16,
        router=RouterConfig(num_experts=8, top_k=2, score_fn="sigmoid_topk", renorm="none"),
        weight_on_input=True,
    )
    p = random_params(cfg, rng)
    for t in (2, 21):  # pairs and capacity
        x = rng.normal(size=(t, 32)).astype(np.float32)
        ref, _, _ = np_moe(x, params_to_numpy(p), cfg)
        np.testing.assert_allclose(np.asarray(jaxmoe.moe_apply(p, jnp.asarray(x), cfg, impl="xla_tiled")), ref, **F32)
        r = jaxmoe.layer.compute_routing(p, jnp.asarray(x), cfg)
        ids, ws = np.asarray(r.expert_ids), np.asarray(r.weights)
        ref = np_experts(x, ids, ws, params_to_numpy(p), cfg)
        for layout in LAYOUTS:
            y = experts_xla_tiled(jnp.asarray(x), r, p.experts, cfg, ExecConfig(block_m=2, layout=layout))
            np.testing.assert_allclose(np.asarray(y), ref, **F32)
    pb = random_params(cfg, rng, jnp.bfloat16)
    xb = jnp.asarray(rng.normal(size=(21, 32)), jnp.bfloat16)
    y = jaxmoe.moe_apply(pb, xb, cfg, impl="xla_tiled")
    assert y.dtype == jnp.bfloat16
    yd = jaxmoe.moe_apply(pb, xb, cfg, impl="dense")
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(yd, np.float32), rtol=3e-2, atol=3e-2)


@pytest.mark.slow
def test_nan_token_isolated(rng):
    cfg = shrink(jaxmoe.load_config("qwen3.6-35b-a3b"))
    p = random_params(cfg, rng)
    x = rng.normal(size=(9, cfg.d_model)).astype(np.float32)
    x[4, 3] = np.nan
    y = np.asarray(jaxmoe.moe_apply(p, jnp.asarray(x), cfg, impl="xla_tiled"))
    assert np.isnan(y[4]).all()
    rest = np.delete(np.arange(9), 4)
    ref, _, _ = np_moe(x[rest], params_to_numpy(p), cfg)
    np.testing.assert_allclose(y[rest], ref, **F32)


XLA_CFG = MoEConfig(d_model=16, expert_dim=8, router=RouterConfig(num_experts=12, top_k=3))


@settings(deadline=None)
@given(
    st.integers(0, 2**31 - 1),
    st.sampled_from(["uniform", "skewed", "few"]),
    st.sampled_from([None, 1, 2, 3, 16]),
    st.sampled_from([None, *LAYOUTS]),
)
@pytest.mark.slow
def test_hypothesis(seed, mode, block_m, layout):
    r = np.random.default_rng(seed)
    t, k, e = 24, 3, 12
    if mode == "skewed":
        ids, ws = skewed_routing(r, t, k, e, share=0.9)
    else:
        pool = r.choice(e, size=k + 1, replace=False) if mode == "few" else np.arange(e)
        ids = np.stack([r.choice(pool, k, replace=False) for _ in range(t)]).astype(np.int32)
        ws = r.uniform(0.05, 1, size=(t, k)).astype(np.float32)
    p = random_params(XLA_CFG, r)
    x = r.normal(size=(t, 16)).astype(np.float32)
    y = experts_xla_tiled(
        jnp.asarray(x),
        Routing(jnp.asarray(ids), jnp.asarray(ws)),
        p.experts,
        XLA_CFG,
        ExecConfig(block_m=block_m, layout=layout),
    )
    np.testing.assert_allclose(np.asarray(y), np_experts(x, ids, ws, params_to_numpy(p), XLA_CFG), **F32)


def _eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _eqns(sub)


@pytest.mark.parametrize("t", [1, 41])
def test_no_loop_and_no_tokens_by_experts_array(t, rng):
    """A bounded set of ops (no while / scan), and work that grows with T*k, not T*E."""
    e, k = 23, 2
    cfg = MoEConfig(d_model=16, expert_dim=8, router=RouterConfig(num_experts=e, top_k=k))
    p = random_params(cfg, rng)
    r = Routing(*map(jnp.asarray, skewed_routing(rng, t, k, e)))
    x = jnp.asarray(rng.normal(size=(t, 16)), jnp.float32)
    jaxpr = jax.make_jaxpr(lambda x: experts_xla_tiled(x, r, p.experts, cfg))(x).jaxpr
    eqns = list(_eqns(jaxpr))
    prims = {q.primitive.name for q in eqns}
    assert not prims & {"while", "scan"}, prims
    shapes = {tuple(getattr(v.aval, "shape", ())) for q in eqns for v in q.outvars}
    bad = [s for s in shapes if (t in s or t * k in s) and e in s and t > 1]
    assert not bad, bad
    loopy = jax.make_jaxpr(lambda x: jaxmoe.impls.xla.experts_xla(x, r, p.experts, cfg))(x).jaxpr
    assert "while" in {q.primitive.name for q in _eqns(loopy)}  # the check itself can fail


def test_choose_block_m():
    assert choose_block_m(8, 256) == 1  # decode: pairs layout
    assert choose_block_m(128, 256) == 1
    assert choose_block_m(129, 256) == MIN_CAPACITY == 8  # past E / 2 pairs: capacity
    assert choose_block_m(257, 256) == MIN_CAPACITY
    assert choose_block_m(2048, 256) == 16
    assert choose_block_m(8192, 256) == 64
    assert choose_block_m(10**7, 8) == MAX_BLOCK_M


@pytest.mark.slow
def test_matches_dense_at_every_layout(rng):
    cfg = shrink(jaxmoe.load_config("mixtral-8x7b"))
    p = random_params(cfg, rng)
    x = jnp.asarray(rng.normal(size=(17, cfg.d_model)), jnp.float32)
    r = jaxmoe.layer.compute_routing(p, x, cfg)
    yd = experts_dense(x, r, p.experts, cfg)
    for bm in (1, 2, 4, 32, 256):
        for layout in (None, "tiles"):
            y = experts_xla_tiled(x, r, p.experts, cfg, ExecConfig(block_m=bm, layout=layout))
            np.testing.assert_allclose(np.asarray(y), np.asarray(yd), **F32)


def test_bad_input(rng):
    cfg = shrink(jaxmoe.load_config("qwen3-30b-a3b"))
    p = random_params(cfg, rng)
    r = Routing(*map(jnp.asarray, skewed_routing(rng, 4, cfg.top_k, cfg.num_experts)))
    x = jnp.asarray(rng.normal(size=(4, cfg.d_model)), jnp.float32)
    with pytest.raises(ValueError, match="x must be"):
        experts_xla_tiled(x[0], r, p.experts, cfg)
    with pytest.raises(ValueError, match="block_m"):
        experts_xla_tiled(x, r, p.experts, cfg, ExecConfig(block_m=0))
    with pytest.raises(ValueError, match="ExecConfig.layout: unknown 'dense'"):
        experts_xla_tiled(x, r, p.experts, cfg, ExecConfig(layout="dense"))
    with pytest.raises(TypeError, match="unexpected keyword"):
        experts_xla_tiled(x, r, p.experts, cfg, block_m=4)  # a removed keyword
    empty = experts_xla_tiled(x[:0], Routing(r.expert_ids[:0], r.weights[:0]), p.experts, cfg)
    assert empty.shape == (0, cfg.d_model)


@pytest.mark.parametrize("visits", [0, 1, 3])
@pytest.mark.slow
def test_capacity_gradients_through_the_overflow_branch(visits, rng):
    """Reverse and forward mode through the `lax.switch` of the overflow visits (finite
    differences in float64; the dots accumulate in float32): x, routing weights, expert
    weights and biases, for calls taking the branches of 0, 2 and 5 (the bound) visits."""
    with jax.enable_x64(True):
        e, cap, t = 8, 2, 12
        cfg = MoEConfig(d_model=8, expert_dim=6, router=RouterConfig(num_experts=e, top_k=1), expert_bias=True)
        p = with_random_biases(random_params(cfg, rng, jnp.float64), rng)
        assert overflow_buckets(t, cap) == (0, 2, 5)
        ids = hot_expert_ids(rng, t, e, cap, visits)
        x = jnp.asarray(rng.standard_normal((t, 8)))
        c = jnp.asarray(rng.standard_normal((t, 8)))
        w = jnp.asarray(rng.uniform(0.1, 1.0, (t, 1)))

        def loss(x, w, ew):
            r = Routing(jnp.asarray(ids), w)
            return jnp.sum(experts_xla_tiled(x, r, ew, cfg, ExecConfig(block_m=cap, layout="capacity")) * c)

        check_grads(loss, (x, w, p.experts), 1, ("rev", "fwd"), eps=1e-3, atol=1e-3, rtol=1e-3)

"""The XLA grouped path (``xla``), the C++ CPU kernel (``cpu``), ``ragged_dot`` and the
``gather`` decode loop against the float64 numpy references and the dense oracle; and the
``auto`` backend choice."""

import dataclasses
import re

import chex
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import np_experts, np_moe, params_to_numpy, quantize_experts, random_params, shrink, skewed_routing
from hypothesis import given
from hypothesis import strategies as st

import jaxmoe
from jaxmoe import MoEConfig, RouterConfig, Routing
from jaxmoe.execution import ExecConfig
from jaxmoe.experts import experts_dense
from jaxmoe.impls import policy, registry
from jaxmoe.impls.cpu import experts_cpu
from jaxmoe.impls.ragged import experts_ragged_dot
from jaxmoe.impls.xla import choose_block_m, experts_xla
from jaxmoe.impls.xla_tiled import experts_xla_tiled
from jaxmoe.platforms import GATHER_MAX_PAIRS, INTEL_PLATFORMS, platform_group

PRESETS = jaxmoe.list_presets()
GROUPED = ["xla", "ragged_dot", "cpu"]
QUANT_IMPLS = ["xla", "ragged_dot", "gather", "cpu"]  # cpu reads int8/int4 in place (tests/test_impls_cpu.py)
F32 = dict(rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("impl", GROUPED)
@pytest.mark.slow
def test_presets_match_float64_and_dense(preset, impl, rng):
    cfg = shrink(jaxmoe.load_config(preset))
    p = random_params(cfg, rng)
    x = rng.normal(size=(11, cfg.d_model)).astype(np.float32)
    y, r = jaxmoe.moe_apply(p, jnp.asarray(x), cfg, impl=impl, return_routing=True)
    ref, ids, _ = np_moe(x, params_to_numpy(p), cfg)
    np.testing.assert_array_equal(np.sort(np.asarray(r.expert_ids), 1), np.sort(ids, 1))
    np.testing.assert_allclose(np.asarray(y), ref, **F32)
    yd = jaxmoe.moe_apply(p, jnp.asarray(x), cfg, impl="dense")
    np.testing.assert_allclose(np.asarray(y), np.asarray(yd), **F32)


@pytest.mark.parametrize("preset", ["qwen3.6-35b-a3b", "gpt-oss-20b"])
@pytest.mark.parametrize("quant", ["int8", "int4"])
@pytest.mark.slow
def test_quantized_experts(preset, quant, rng):
    cfg = shrink(jaxmoe.load_config(preset))
    p = random_params(cfg, rng)
    p = quantize_experts(p, quant)
    x = rng.normal(size=(9, cfg.d_model)).astype(np.float32)
    ref, _, _ = np_moe(x, params_to_numpy(p), cfg)
    for impl in QUANT_IMPLS:
        y = jaxmoe.moe_apply(p, jnp.asarray(x), cfg, impl=impl)
        np.testing.assert_allclose(np.asarray(y), ref, **F32, err_msg=impl)
    assert policy.resolve_impl("auto", 9 * cfg.top_k, platform="cpu", experts=p.experts) == "cpu"


@pytest.mark.parametrize("preset", ["qwen3.6-35b-a3b", "gpt-oss-20b"])
@pytest.mark.slow
def test_bf16_matches_dense(preset, rng):
    cfg = shrink(jaxmoe.load_config(preset))
    p = random_params(cfg, rng, jnp.bfloat16)
    x = jnp.asarray(rng.normal(size=(13, cfg.d_model)), jnp.bfloat16)
    yd = jaxmoe.moe_apply(p, x, cfg, impl="dense")
    for impl in GROUPED + ["gather"]:
        y = jaxmoe.moe_apply(p, x, cfg, impl=impl)
        assert y.dtype == jnp.bfloat16
        np.testing.assert_allclose(
            np.asarray(y, np.float32), np.asarray(yd, np.float32), rtol=3e-2, atol=3e-2, err_msg=impl
        )


@pytest.mark.parametrize("fn", [experts_xla, experts_xla_tiled], ids=["xla", "xla_tiled"])
@pytest.mark.parametrize(
    "t, block_m", [(1, None), (1, 1), (1, 16), (5, 4), (13, 8), (37, 1), (37, 4), (37, 16), (37, 64)]
)
@pytest.mark.slow
def test_uneven_routing_block_sizes(fn, t, block_m, rng):
    """One expert takes most pairs, half the experts are empty, T*k not a multiple of block_m."""
    cfg = shrink(jaxmoe.load_config("qwen3-30b-a3b"), e=12)
    p = random_params(cfg, rng)
    ids, ws = skewed_routing(rng, t, cfg.top_k, cfg.num_experts)
    x = rng.normal(size=(t, cfg.d_model)).astype(np.float32)
    ref = np_experts(x, ids, ws, params_to_numpy(p), cfg)
    r = Routing(jnp.asarray(ids), jnp.asarray(ws))
    y = fn(jnp.asarray(x), r, p.experts, cfg, ExecConfig(block_m=block_m))
    chex.assert_shape(y, (t, cfg.d_model))
    np.testing.assert_allclose(np.asarray(y), ref, **F32)


@pytest.mark.parametrize("impl", GROUPED + ["gather"])
@pytest.mark.slow
def test_forced_routing_through_moe_apply(impl, rng):
    cfg = shrink(jaxmoe.load_config("qwen3.6-35b-a3b"))
    p = random_params(cfg, rng)
    t = 19
    ids, ws = skewed_routing(rng, t, cfg.top_k, cfg.num_experts, share=0.95)
    x = rng.normal(size=(t, cfg.d_model)).astype(np.float32)
    routing = Routing(jnp.asarray(ids), jnp.asarray(ws))
    y, r = jaxmoe.moe_apply(p, jnp.asarray(x), cfg, impl=impl, routing=routing, return_routing=True)
    assert r is routing
    yd = jaxmoe.moe_apply(p, jnp.asarray(x), cfg, impl="dense", routing=routing)
    np.testing.assert_allclose(np.asarray(y), np.asarray(yd), **F32)
    pn = params_to_numpy(p)
    shared = np_moe(x, pn | dict(w_gate=0 * pn["w_gate"], w_up=0 * pn["w_up"], w_down=0 * pn["w_down"]), cfg)[0]
    np.testing.assert_allclose(np.asarray(y), np_experts(x, ids, ws, pn, cfg) + shared, **F32)


@pytest.mark.slow
def test_every_pair_on_one_expert(rng):
    """k = 1, every token on the same expert: one group spanning many chunks."""
    cfg = MoEConfig(d_model=32, expert_dim=16, router=RouterConfig(num_experts=8, top_k=1))
    p = random_params(cfg, rng)
    t = 29
    ids = np.full((t, 1), 5, np.int32)
    ws = rng.uniform(0.1, 1.0, size=(t, 1)).astype(np.float32)
    x = rng.normal(size=(t, 32)).astype(np.float32)
    ref = np_experts(x, ids, ws, params_to_numpy(p), cfg)
    for bm in (None, 64):
        y = experts_xla(
            jnp.asarray(x), Routing(jnp.asarray(ids), jnp.asarray(ws)), p.experts, cfg, ExecConfig(block_m=bm)
        )
        np.testing.assert_allclose(np.asarray(y), ref, **F32)


@st.composite
def routings(draw, t=24, k=3, e=12):
    """Routings of fixed shape (one compile per block size): uniform, skewed, or few experts."""
    mode = draw(st.sampled_from(["uniform", "skewed", "few"]))
    r = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    if mode == "skewed":
        ids, ws = skewed_routing(r, t, k, e, share=draw(st.floats(0.5, 1.0)))
    else:
        pool = r.choice(e, size=k + 1, replace=False) if mode == "few" else np.arange(e)
        ids = np.stack([r.choice(pool, k, replace=False) for _ in range(t)]).astype(np.int32)
        ws = r.uniform(0.05, 1, size=(t, k)).astype(np.float32)
    return ids, ws, int(r.integers(1 << 30))


XLA_CFG = MoEConfig(d_model=16, expert_dim=8, router=RouterConfig(num_experts=12, top_k=3))


@given(routings(), st.sampled_from([None, 1, 5]))
@pytest.mark.slow
def test_xla_hypothesis(case, block_m):
    ids, ws, seed = case
    rng = np.random.default_rng(seed)
    p = random_params(XLA_CFG, rng)
    x = rng.normal(size=(ids.shape[0], 16)).astype(np.float32)
    y = experts_xla(
        jnp.asarray(x), Routing(jnp.asarray(ids), jnp.asarray(ws)), p.experts, XLA_CFG, ExecConfig(block_m=block_m)
    )
    np.testing.assert_allclose(np.asarray(y), np_experts(x, ids, ws, params_to_numpy(p), XLA_CFG), **F32)


@pytest.mark.slow
def test_weight_on_input(rng):
    cfg = MoEConfig(
        d_model=32,
        expert_dim=16,
        router=RouterConfig(num_experts=8, top_k=2, score_fn="sigmoid_topk", renorm="none"),
        shared_expert_dim=16,
        num_shared_experts=1,
        weight_on_input=True,
    )
    p = random_params(cfg, rng)
    x = rng.normal(size=(10, 32)).astype(np.float32)
    ref, _, _ = np_moe(x, params_to_numpy(p), cfg)
    ref_out, _, _ = np_moe(x, params_to_numpy(p), dataclasses.replace(cfg, weight_on_input=False))
    assert np.abs(ref - ref_out).max() > 1e-3  # the option matters for these inputs
    for impl in GROUPED + ["gather"]:
        y = jaxmoe.moe_apply(p, jnp.asarray(x), cfg, impl=impl)
        np.testing.assert_allclose(np.asarray(y), ref, **F32, err_msg=impl)


@pytest.mark.parametrize("impl", GROUPED + ["gather"])
def test_nan_token_isolated(impl, rng):
    cfg = shrink(jaxmoe.load_config("qwen3.6-35b-a3b"))
    p = random_params(cfg, rng)
    x = rng.normal(size=(9, cfg.d_model)).astype(np.float32)
    x[4, 3] = np.nan
    y = np.asarray(jaxmoe.moe_apply(p, jnp.asarray(x), cfg, impl=impl))
    assert np.isnan(y[4]).all()
    rest = np.delete(np.arange(9), 4)
    ref, _, _ = np_moe(x[rest], params_to_numpy(p), cfg)
    np.testing.assert_allclose(y[rest], ref, **F32)


@pytest.mark.slow
def test_single_token(rng):
    cfg = shrink(jaxmoe.load_config("deepseek-v3"))
    p = random_params(cfg, rng)
    x = rng.normal(size=(1, cfg.d_model)).astype(np.float32)
    ref, _, _ = np_moe(x, params_to_numpy(p), cfg)
    for impl in GROUPED + ["gather"]:
        np.testing.assert_allclose(np.asarray(jaxmoe.moe_apply(p, jnp.asarray(x), cfg, impl=impl)), ref, **F32)


class JitParityTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_xla_jit_and_eager(self):
        rng = np.random.default_rng(7)
        cfg = shrink(jaxmoe.load_config("gpt-oss-20b"))
        p = random_params(cfg, rng)
        x = jnp.asarray(rng.normal(size=(10, cfg.d_model)), jnp.float32)
        f = self.variant(lambda p, x: jaxmoe.moe_apply(p, x, cfg, impl="xla"))
        ref, _, _ = np_moe(np.asarray(x), params_to_numpy(p), cfg)
        chex.assert_trees_all_close(f(p, x), jnp.asarray(ref, jnp.float32), rtol=2e-5, atol=2e-5)


def _all_shapes(jaxpr):
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            yield tuple(getattr(v.aval, "shape", ()))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _all_shapes(sub)


@pytest.mark.slow
def test_xla_has_no_tokens_by_experts_intermediate(rng):
    """Work grows with T*k: no array in the traced program has both a T and an E axis."""
    t, e, k = 41, 23, 2
    cfg = MoEConfig(d_model=16, expert_dim=8, router=RouterConfig(num_experts=e, top_k=k))
    p = random_params(cfg, rng)
    r = Routing(jnp.zeros((t, k), jnp.int32), jnp.ones((t, k), jnp.float32))
    jaxpr = jax.make_jaxpr(lambda x: experts_xla(x, r, p.experts, cfg))(jnp.ones((t, 16))).jaxpr
    shapes = set(_all_shapes(jaxpr))
    bad = [s for s in shapes if (t in s or t * k in s) and e in s]
    assert not bad, bad
    dense = jax.make_jaxpr(lambda x: experts_dense(x, r, p.experts, cfg))(jnp.ones((t, 16))).jaxpr
    assert any(t in s and e in s for s in _all_shapes(dense))  # the check itself can fail


def test_choose_block_m():
    assert choose_block_m(8, 256) == 1
    assert choose_block_m(2048, 256) == 8
    assert choose_block_m(2000, 256) == 8
    assert choose_block_m(8192, 256) == 32
    assert choose_block_m(10**7, 8) == 256


def test_bad_input(rng):
    cfg = shrink(jaxmoe.load_config("qwen3-30b-a3b"))
    p = random_params(cfg, rng)
    r = Routing(jnp.zeros((4, cfg.top_k), jnp.int32), jnp.ones((4, cfg.top_k)))
    for fn in (experts_xla, experts_ragged_dot, experts_cpu):
        with pytest.raises(ValueError, match="x must be"):
            fn(jnp.ones((4,)), r, p.experts, cfg)
        with pytest.raises(ValueError, match="expert_ids"):
            fn(jnp.ones((5, cfg.d_model)), r, p.experts, cfg)
        with pytest.raises(ValueError, match="routing.weights"):
            fn(jnp.ones((4, cfg.d_model)), Routing(r.expert_ids, jnp.ones((4, 1))), p.experts, cfg)
        with pytest.raises(ValueError, match="w_gate"):
            fn(jnp.ones((4, cfg.d_model + 1)), r, p.experts, cfg)


# --- backend choice ---------------------------------------------------------------------


def test_auto_resolution():
    small, big = GATHER_MAX_PAIRS, GATHER_MAX_PAIRS + 1
    assert policy.resolve_impl("auto", small, platform="cpu") == "gather"
    assert policy.resolve_impl("auto", big, platform="cpu") == "xla"
    for plat in INTEL_PLATFORMS:  # the loop-free XLA formulation at every T
        assert policy.resolve_impl("auto", big, platform=plat) == "xla_tiled"
        assert policy.resolve_impl("auto", small, platform=plat) == "xla_tiled"
        assert policy.resolve_impl("xla", big, platform=plat) == "xla_tiled"  # xla's GPU shape
        assert policy.resolve_impl("gather", big, platform=plat) == "gather"
    for plat in ("cuda", "rocm"):
        assert policy.resolve_impl("auto", big, platform=plat) == "pallas"
        assert policy.resolve_impl("auto", small, platform=plat) == "pallas"  # the kernels have a decode path
    assert policy.resolve_impl("auto", big, platform="cpu") == "xla"
    assert policy.resolve_impl("gather", 10**6, platform="cpu") == "gather"  # explicit choices are kept


def test_auto_takes_the_cpu_kernel_for_float_experts(rng):
    cfg = shrink(jaxmoe.load_config("qwen3-30b-a3b"))
    p = random_params(cfg, rng)
    pb = random_params(cfg, rng, jnp.bfloat16)
    assert policy.resolve_impl("auto", 1, platform="cpu", experts=p.experts) == "cpu"
    assert policy.resolve_impl("auto", 10**4, platform="cpu", experts=pb.experts, dtype=jnp.bfloat16) == "cpu"
    # bf16 compute over f32 experts would need a rounded copy of every expert: not the kernel's job
    assert policy.resolve_impl("auto", 10**4, platform="cpu", experts=p.experts, dtype=jnp.bfloat16) == "xla"
    for plat in INTEL_PLATFORMS:  # an XLA:CPU custom call only
        assert policy.resolve_impl("auto", 10**4, platform=plat, experts=p.experts) == "xla_tiled"
        with pytest.raises(ValueError, match="cpu.*" + plat):
            policy.resolve_impl("cpu", 64, platform=plat)


def test_lowering_table_per_platform_group(rng):
    """``auto``'s branch per lowering platform group (`policy.run_experts` switches on it)."""
    cfg = shrink(jaxmoe.load_config("qwen3-30b-a3b"))
    p = random_params(cfg, rng)
    table = policy.lowering_table("auto", 10**4, experts=p.experts, dtype=jnp.float32)
    # the CPU entry is the kernel whenever it takes the experts: whether it built is asked
    # when the program is lowered for the CPU (tests/test_lowering_platforms.py)
    assert table == {
        "cpu": "cpu",
        "triton": "pallas",
        "intel": "xla_tiled",
        "default": "xla",
    }
    assert policy.lowering_table("auto", 1, experts=p.experts)["default"] == "gather"
    forced = policy.lowering_table("xla", 64)
    assert forced == {"cpu": "xla", "triton": "xla", "intel": "xla_tiled", "default": "xla"}
    assert set(policy.lowering_table("gather", 64).values()) == {"gather"}
    with pytest.raises(ValueError, match="unknown impl"):
        policy.lowering_table("nope", 8)
    assert {platform_group(plat) for plat in INTEL_PLATFORMS} == {"intel"}
    assert platform_group("cuda") == platform_group("gpu") == "triton" and platform_group("tpu") == "default"


def test_pallas_forced_where_it_cannot_lower():
    for plat in INTEL_PLATFORMS:
        with pytest.raises(ValueError, match="pallas.*" + plat):
            policy.resolve_impl("pallas", 64, platform=plat)


def test_unknown_impl():
    with pytest.raises(ValueError, match="unknown impl 'nope'"):
        policy.resolve_impl("nope", 8)


def test_registry_is_an_explicit_table():
    assert set(registry.BUILTIN) == {"dense", "gather", "xla", "xla_tiled", "ragged_dot", "cpu", "pallas"}
    assert registry.available_impls()[0] == "auto"
    assert registry.get_impl("xla").routed is experts_xla
    assert registry.get_impl("cpu").layer is not None  # cpu's contract covers the shared expert
    with pytest.raises(ValueError, match="already registered"):
        registry.register_impl("xla", experts_dense)
    with pytest.raises(ValueError, match="auto"):
        registry.register_impl("auto", experts_dense)


@pytest.mark.slow
def test_a_user_impl_runs_through_moe_apply(rng):
    cfg = shrink(jaxmoe.load_config("mixtral-8x7b"))
    p = random_params(cfg, rng)
    x = jnp.asarray(rng.standard_normal((5, cfg.d_model)), jnp.float32)
    calls = []

    def mine(x, routing, experts, cfg, ex):
        calls.append((x.shape, ex.batch_invariant, ex.platform))
        return experts_dense(x, routing, experts, cfg, ex)

    registry.register_impl("mine", mine)
    try:
        with pytest.raises(ValueError, match="already registered"):
            registry.register_impl("mine", mine)
        assert "mine" in jaxmoe.available_impls()
        y = jaxmoe.moe_apply(p, x, cfg, jaxmoe.ExecConfig(impl="mine", batch_invariant=True))
        chex.assert_trees_all_close(y, jaxmoe.moe_apply(p, x, cfg, impl="dense"), rtol=1e-6, atol=1e-6)
        # one trace: a user impl that tells no platform apart is one branch, "default"
        assert calls == [((5, cfg.d_model), True, "default")]
    finally:
        registry.unregister_impl("mine")
    assert "mine" not in jaxmoe.available_impls()


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.slow
def test_xla_bf16_converts_only_the_selected_experts(grad):
    """The compiled CPU program of ``xla`` over bfloat16 experts holds no float32 copy of a
    whole ``[E, ...]`` weight: XLA:CPU used to rewrite each expert's upcast into one of all
    ``E`` experts hoisted out of the loop (0.8-1.2 s per Qwen3.6 layer call at ``T = 1``
    instead of ~12 ms; `jaxmoe.impls.xla.loop_take`). Forward and backward (x gradient)."""
    cfg = shrink(jaxmoe.load_config("qwen3-30b-a3b"), d=64, f=32, e=16)
    rng = np.random.default_rng(7)
    ew = jaxmoe.ExpertWeights(
        *(
            jnp.asarray(rng.standard_normal(s, np.float32), jnp.bfloat16)
            for s in ((16, 64, 32), (16, 64, 32), (16, 32, 64))
        )
    )
    x = jnp.asarray(rng.standard_normal((3, 64), np.float32), jnp.bfloat16)
    r = Routing(
        jnp.asarray(rng.choice(16, (3, cfg.top_k)), jnp.int32), jnp.asarray(rng.random((3, cfg.top_k)), jnp.float32)
    )
    if grad:
        fn = jax.jit(jax.grad(lambda x, r, ew: experts_xla(x, r, ew, cfg).sum()))
    else:
        fn = jax.jit(lambda x, r, ew: experts_xla(x, r, ew, cfg))
    hlo = fn.lower(x, r, ew).compile().as_text()  # weights as arguments, as in a model
    buffers = unfused_instructions(hlo)  # what XLA materializes (a fused convert + slice is not)
    whole = [i for i in buffers if re.search(r"= f32\[16,(64,32|32,64)\]", i)]
    assert not whole, f"a float32 copy of every expert's weights in the compiled program: {whole}"
    assert any("bf16[16,64,32]" in i for i in buffers)  # the check reads the right program


def unfused_instructions(hlo: str) -> list[str]:
    """The instructions of an HLO module's computations that are not fusion bodies (ENTRY,
    loop bodies, branches): each one's result is a buffer."""
    comps: dict[str, list[str]] = {}
    name = None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head and not line.startswith(" "):
            name = head.group(1)
            comps[name] = []
        elif name is not None and line.startswith("  "):
            comps[name].append(line.strip())
    fused = {c for body in comps.values() for i in body for c in re.findall(r"calls=%([\w.\-]+)", i) if " fusion(" in i}
    return [i for n, body in comps.items() if n not in fused for i in body]

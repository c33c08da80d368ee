"""Expert ids outside [0, E): a ValueError when concrete, a pair that adds exactly zero under jit.

Every shipped impl (pallas in interpret mode), `moe_apply(routing=...)`,
`moe_apply_ep(routing=...)` and the pallas decode wrappers (docs/routing.md, "Invalid
expert ids"). The jit results are compared with a float64 numpy loop over the valid
pairs only.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import cpu_impls, np_experts, params_to_numpy, random_params, shrink
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxmoe
from jaxmoe import parallel
from jaxmoe.dispatch import check_expert_ids, plan_dispatch
from jaxmoe.execution import ExecConfig
from jaxmoe.impls.pallas import experts_pallas
from jaxmoe.impls.registry import BUILTIN, get_impl
from jaxmoe.routing import Routing
from pallas_kernels.decode import decode_down, decode_gate_up
from pallas_kernels.launch import DecodeLaunch

E = 8


def _impl(name):
    if name == "pallas":
        return lambda x, r, ew, cfg: experts_pallas(x, r, ew, cfg, ExecConfig(interpret=True))
    return get_impl(name)


# every shipped strategy, so a new one is covered too (cpu: a skip when its kernel did not build)
IMPLS = cpu_impls(BUILTIN)


def _cfg(bias=False, woi=False):
    cfg = shrink(jaxmoe.load_config("gpt-oss-20b" if bias else "qwen3-30b-a3b"), d=32, f=16, e=E)
    return dataclasses.replace(cfg, weight_on_input=woi, router=dataclasses.replace(cfg.router, top_k=2))


def _routing(rng, t, k, n_bad):
    ids = np.stack([rng.permutation(E)[:k] for _ in range(t)]).astype(np.int32)  # distinct per token
    bad = rng.choice(t * k, size=min(n_bad, t * k), replace=False)
    ids.reshape(-1)[bad] = rng.choice([-1, -E, E, E + 1, 2**31 - 1, -(2**31)], size=bad.size)
    ws = rng.uniform(0.1, 1.0, size=(t, k)).astype(np.float32)
    return ids, ws


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.slow
def test_eager_out_of_range_ids_raise(impl, rng):
    cfg = _cfg()
    p = random_params(cfg, rng)
    x = jnp.asarray(rng.standard_normal((5, cfg.d_model)), jnp.float32)
    fn = _impl(impl)
    for bad in (-1, E, 10**6):
        ids, ws = _routing(rng, 5, 2, 0)
        ids[3, 1] = bad
        with pytest.raises(ValueError, match=rf"expert_ids must lie in \[0, {E}\).*expert_ids\[3, 1\] = {bad}"):
            fn(x, Routing(jnp.asarray(ids), jnp.asarray(ws)), p.experts, cfg)
    ids, ws = _routing(rng, 5, 2, 0)
    with pytest.raises(ValueError, match="expert_ids must be an integer array"):
        fn(x, Routing(jnp.asarray(ids, jnp.float32), jnp.asarray(ws)), p.experts, cfg)
    with pytest.raises(ValueError, match="expert_ids"):
        fn(x, Routing(jnp.asarray(ids[:4]), jnp.asarray(ws[:4])), p.experts, cfg)
    with pytest.raises(ValueError, match="weights"):
        fn(x, Routing(jnp.asarray(ids), jnp.asarray(ws[:, :1])), p.experts, cfg)
    # in-range ids pass
    fn(x, Routing(jnp.asarray(ids), jnp.asarray(ws)), p.experts, cfg)


@settings(max_examples=8)  # each example compiles every impl afresh
@given(seed=st.integers(0, 2**31 - 1), t=st.integers(1, 12), n_bad=st.integers(1, 6), variant=st.integers(0, 2))
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.slow
def test_jit_invalid_pairs_add_zero(impl, seed, t, n_bad, variant):
    """Under jit every impl gives the float64 sum over the valid pairs only (no OOB read)."""
    rng = np.random.default_rng(seed)
    cfg = _cfg(bias=variant == 1, woi=variant == 2)
    p = random_params(cfg, rng)
    x = rng.standard_normal((t, cfg.d_model)).astype(np.float32)
    ids, ws = _routing(rng, t, cfg.top_k, n_bad)
    fn = _impl(impl)
    y = jax.jit(lambda x, r, ew: fn(x, r, ew, cfg))(
        jnp.asarray(x), Routing(jnp.asarray(ids), jnp.asarray(ws)), p.experts
    )
    want = np_experts(x, ids, ws, params_to_numpy(p), cfg)
    np.testing.assert_allclose(np.asarray(y), want, atol=2e-4, rtol=2e-4)


def test_plan_drops_invalid_ids(rng):
    ids = rng.integers(0, E, size=(40, 3)).astype(np.int32)
    ids[rng.random(ids.shape) < 0.3] = E + 2
    ids[0, 0] = -1
    plan = plan_dispatch(jnp.asarray(ids), E, 4)
    valid = (ids >= 0) & (ids < E)
    assert int(plan.num_valid) == valid.sum() == int(plan.group_sizes.sum())
    np.testing.assert_array_equal(np.asarray(plan.group_sizes), np.bincount(ids[valid], minlength=E))
    np.testing.assert_array_equal(np.asarray(plan.pair_valid()), valid.reshape(-1))
    # every tile visit lies inside the valid rows
    rows = np.asarray(plan.tile_row)[: int(plan.num_tiles)] * 4
    assert (rows < valid.sum()).all()
    # the invalid pairs are the last sorted rows
    sorted_valid = valid.reshape(-1)[np.asarray(plan.sort_idx)]
    assert sorted_valid[: valid.sum()].all() and not sorted_valid[valid.sum() :].any()


def test_check_expert_ids_messages():
    with pytest.raises(ValueError, match=r"f: routing.expert_ids must be \[T, k\]"):
        check_expert_ids(jnp.zeros((3,), jnp.int32), E, "f")
    with pytest.raises(ValueError, match=r"has shape \(3, 2\), expected \(4, \*\)"):
        check_expert_ids(jnp.zeros((3, 2), jnp.int32), E, "f", shape=(4, None))
    with pytest.raises(ValueError, match="integer array, got dtype bool"):
        check_expert_ids(jnp.zeros((3, 2), bool), E, "f")
    with pytest.raises(ValueError, match="routing.weights must be a float array"):
        check_expert_ids(jnp.zeros((3, 2), jnp.int32), E, "f", weights=jnp.zeros((3, 2), jnp.int32))
    check_expert_ids(jnp.full((3, 2), E - 1, jnp.int32), E, "f", shape=(3, 2))


@pytest.mark.slow
def test_moe_apply_and_ep_reject_then_drop(rng):
    cfg = _cfg()
    p = random_params(cfg, rng)
    x = jnp.asarray(rng.standard_normal((6, cfg.d_model)), jnp.float32)
    ids, ws = _routing(rng, 6, 2, 3)
    r = Routing(jnp.asarray(ids), jnp.asarray(ws))
    mesh = parallel.make_mesh(4)
    with pytest.raises(ValueError, match=r"moe_apply: routing.expert_ids must lie in \[0, 8\)"):
        jaxmoe.moe_apply(p, x, cfg, impl="xla", routing=r)
    with pytest.raises(ValueError, match=r"moe_apply_ep: routing.expert_ids must lie in \[0, 8\)"):
        parallel.moe_apply_ep(p, x, cfg, mesh, impl="xla", routing=r)
    with pytest.raises(ValueError, match=r"moe_apply: routing.expert_ids has shape \(6, 1\)"):
        jaxmoe.moe_apply(p, x, cfg, routing=Routing(r.expert_ids[:, :1], r.weights[:, :1]))
    want = np_experts(x, ids, ws, params_to_numpy(p), cfg)
    y = jax.jit(lambda r: jaxmoe.moe_apply(p, x, cfg, impl="xla", routing=r))(r)
    np.testing.assert_allclose(np.asarray(y), want, atol=2e-4, rtol=2e-4)
    y_ep, stats = jax.jit(lambda r: parallel.moe_apply_ep(p, x, cfg, mesh, impl="xla", routing=r, return_stats=True))(r)
    np.testing.assert_allclose(np.asarray(y_ep), want, atol=2e-4, rtol=2e-4)
    np.testing.assert_array_equal(np.asarray(stats.kept), (ids >= 0) & (ids < E))
    assert int(stats.dropped_pairs) == 0


def test_pallas_decode_wrappers_check_and_bound(rng):
    t, k, d, f = 3, 2, 32, 16
    x = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
    wg, wu = (jnp.asarray(rng.standard_normal((E, d, f)), jnp.float32) for _ in range(2))
    wd = jnp.asarray(rng.standard_normal((E, f, d)), jnp.float32)
    ids = rng.integers(0, E, size=(t, k)).astype(np.int32)
    ids[1, 0] = E
    kw = dict(launch=DecodeLaunch(block_n=16, block_k=32, interpret=True))
    with pytest.raises(ValueError, match=r"decode_gate_up: expert_ids: expert ids must lie in \[0, 8\)"):
        decode_gate_up(x, jnp.asarray(ids), wg, wu, **kw)
    h = jnp.asarray(rng.standard_normal((t * k, f)), jnp.float32)
    with pytest.raises(ValueError, match=r"decode_down: expert_ids: expert ids must lie in \[0, 8\)"):
        decode_down(h, jnp.asarray(ids), wd, **kw)
    # under jit: the invalid pair's row is zero, the others match the reference
    hj = jax.jit(lambda i: decode_gate_up(x, i, wg, wu, **kw))(jnp.asarray(ids))
    yj = jax.jit(lambda i: decode_down(h, i, wd, **kw))(jnp.asarray(ids))
    assert not np.asarray(hj)[2].any() and not np.asarray(yj)[2].any()
    ok = np.ones(t * k, bool)
    ok[2] = False
    safe = np.where(ids < E, ids, 0)
    yr = np.einsum("pf,pfd->pd", np.asarray(h, np.float64), np.asarray(wd, np.float64)[safe.reshape(-1)])
    np.testing.assert_allclose(np.asarray(yj)[ok], yr[ok], atol=1e-4, rtol=1e-4)

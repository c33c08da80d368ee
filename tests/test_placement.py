"""Redundant experts (jaxmoe.placement) and expert parallelism with a placement.

Placement invariants are drawn by hypothesis over load vectors and checked against
properties a numpy count can state (each expert placed, equal slots per device, the
replicas of the hottest experts first, device loads no worse than static placement or
a plain greedy packing). The mesh path with replicas is compared with the one-device
layer on 8 forced host CPU devices (tests/conftest.py).
"""

import dataclasses
import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_parallel import TOL, rand_params, shrunk, single

import jaxmoe
from jaxmoe import parallel
from jaxmoe import placement as pm
from jaxmoe.evaluation.cli import cli_main as eval_cli_main
from jaxmoe.evaluation.kinds import load_any
from jaxmoe.evaluation.schema import ConfigError
from jaxmoe.execution import ExecConfig
from jaxmoe.quant import quantize_int4_affine, quantize_int8

_replica_slots = jax.jit(pm.replica_slots)


@st.composite
def loads_and_sizes(draw, hierarchical=False):
    """(load [E], P, D[, N, G]): skewed or flat loads, E in 4..32, D | E, R a multiple of D."""
    e = draw(st.sampled_from([4, 8, 16, 32]))
    d = draw(st.sampled_from([x for x in (1, 2, 4, 8) if e % x == 0]))
    r = d * draw(st.integers(0, 2 * e // d))
    seed = draw(st.integers(0, 2**31 - 1))
    shape = draw(st.sampled_from(["zipf", "uniform", "spiky", "ints"]))
    rng = np.random.default_rng(seed)
    if shape == "zipf":
        load = rng.permutation(1.0 / np.arange(1, e + 1) ** rng.uniform(0.5, 2.0)) * rng.uniform(1, 1e4)
    elif shape == "uniform":
        load = rng.uniform(0, 100, e)
    elif shape == "spiky":
        load = rng.uniform(0, 1, e) * (rng.random(e) < 0.3) * 1e3
    else:
        load = rng.integers(0, 20, e).astype(float)
    if not hierarchical:
        return load, e + r, d
    n = draw(st.sampled_from([x for x in (2, 4) if d % x == 0] or [1]))
    g = draw(st.sampled_from([x for x in (n, 2 * n, 4 * n) if e % x == 0]))
    return load, e + r, d, n, g


def static_max(load, d):
    """Max device load of expert ``e`` on device ``e // (E / D)``, no replicas."""
    return load.reshape(d, -1).sum(1).max()


def greedy_max(load, p, d):
    """An independent plain greedy (no swaps): numpy replication by repeated argmax of
    load / count, then each slot heaviest first into the lightest device with room."""
    e = load.size
    cnt = np.ones(e)
    for _ in range(p - e):
        cnt[np.argmax(load / cnt)] += 1
    w = np.sort(np.repeat(load / cnt, cnt.astype(int)))[::-1]
    dev, fill = np.zeros(d), np.zeros(d)
    for x in w:
        j = min((i for i in range(d) if fill[i] < p // d), key=lambda i: dev[i])
        dev[j] += x
        fill[j] += 1
    return dev.max()


def check_hottest_first(load, counts):
    """The last replica of each replicated expert went to the largest load per replica:
    ``load[e] / (c_e - 1) >= load[f] / c_f`` for every ``f``; and hotter never has fewer."""
    lpr = load / counts
    for x in np.flatnonzero(counts > 1):
        assert load[x] / (counts[x] - 1) >= lpr.max() * (1 - 1e-12), (x, counts, load)
    order = np.argsort(-load, kind="stable")
    hot, cold = load[order[:, None]] > load[order[None, :]], counts[order[:, None]] < counts[order[None, :]]
    assert not (hot & cold).any()


@given(loads_and_sizes())
def test_placement_invariants(case):
    load, p, d = case
    pl = pm.rebalance(load, p, d)
    e = load.size
    p2l = np.asarray(pl.phy2log)
    chex.assert_shape(p2l, (p,))
    chex.assert_shape(pl.log2phy, (e, p - e + 1))
    counts = np.bincount(p2l, minlength=e)
    assert counts.min() >= 1 and counts.sum() == p
    np.testing.assert_array_equal(counts, pl.replica_count)
    assert pl.slots_per_device * d == p
    check_hottest_first(load, counts)
    dev = pm.device_loads(load, pl)
    np.testing.assert_allclose(dev.sum(), load.sum(), rtol=1e-9)
    tol = 1e-9 * max(1.0, load.sum())
    assert dev.max() <= static_max(load, d) + tol
    assert dev.max() <= greedy_max(load, p, d) + tol


@given(loads_and_sizes(hierarchical=True))
def test_hierarchical_placement_invariants(case):
    load, p, d, n, g = case
    pl = pm.rebalance(load, p, d, num_nodes=n, num_groups=g)
    e = load.size
    p2l = np.asarray(pl.phy2log)
    counts = np.bincount(p2l, minlength=e)
    assert counts.min() >= 1 and counts.sum() == p
    node_of_slot = np.arange(p) // (p // n)
    group = p2l // (e // g)
    # every group (its experts and their replicas) lives in one node; each node holds g / n groups
    node_of_group = np.full(g, -1)
    for s in range(p):
        assert node_of_group[group[s]] in (-1, node_of_slot[s])
        node_of_group[group[s]] = node_of_slot[s]
    np.testing.assert_array_equal(np.bincount(node_of_group, minlength=n), g // n)
    for node in range(n):  # replicas within a node go to its hottest experts first
        mine = np.flatnonzero(np.isin(np.arange(e) // (e // g), np.flatnonzero(node_of_group == node)))
        check_hottest_first(load[mine], counts[mine])
    dev = pm.device_loads(load, pl)
    assert dev.max() <= static_max(load, d) + 1e-9 * max(1.0, load.sum())


def test_replicas_lower_the_max_load(rng):
    """Zipf(1.2) load on 8 devices: the hottest expert alone exceeds the mean device load
    (no placement without replicas can balance); E/8 and E/4 replicas bring the max
    within 1% of the mean."""
    e, d = 64, 8
    load = rng.permutation(1.0 / np.arange(1, e + 1) ** 1.2)
    m0, m1, m2 = (pm.device_loads(load, pm.rebalance(load, e + r, d)).max() for r in (0, e // 8, e // 4))
    mean = load.sum() / d
    assert load.max() > 2 * mean and m0 >= load.max() and m0 <= static_max(load, d)
    assert m1 < 1.01 * mean and m2 < 1.01 * mean


@given(st.integers(0, 2**31 - 1), st.floats(0.0, 0.5))
def test_replica_rule_matches_numpy_and_is_balanced(seed, invalid):
    """One shape (one compile): ids drawn with a fraction ``invalid`` out of range."""
    rng = np.random.default_rng(seed)
    e, d, t, k = 8, 4, 32, 4
    pl = pm.Placement.from_phy2log(rng.permutation(np.concatenate([np.arange(e), rng.integers(0, e, 8)])), e, d)
    ids = np.where(rng.random((t, k)) < invalid, rng.choice([-1, e, e + 3], (t, k)), rng.integers(0, e, (t, k)))
    start = rng.integers(0, 5, e)
    got = np.asarray(_replica_slots(jnp.asarray(ids), pl.log2phy, pl.replica_count, jnp.asarray(start)))
    # numpy: continue each expert's numbering at start[e]
    ref = np.full(ids.shape, pl.num_slots)
    seen = start.copy()
    l2p, cnt = np.asarray(pl.log2phy), np.asarray(pl.replica_count)
    for i in range(t):
        for s in range(k):
            x = ids[i, s]
            if 0 <= x < e:
                ref[i, s] = l2p[x, seen[x] % cnt[x]]
                seen[x] += 1
    np.testing.assert_array_equal(got, ref)
    slots = pm.replica_slots_np(ids, pl)
    zero = jnp.zeros(e, jnp.int32)
    np.testing.assert_array_equal(
        np.asarray(_replica_slots(jnp.asarray(ids), pl.log2phy, pl.replica_count, zero)), slots
    )
    pm.check_replica_balance(ids, slots, pl)


def test_first_replica_rule_fails_the_balance_check(rng):
    """A rule sending every pair to the expert's first replica is caught by the check."""
    e, d = 8, 4
    pl = pm.rebalance(rng.permutation(np.arange(1.0, e + 1)), e + 4, d)
    ids = rng.integers(0, e, (40, 2))
    first = np.asarray(pl.log2phy)[ids, 0]
    with pytest.raises(AssertionError, match="replicas got"):
        pm.check_replica_balance(ids, first, pl)
    wrong = (first + 1) % pl.num_slots  # a slot of another expert
    with pytest.raises(AssertionError, match="sent to slot"):
        pm.check_replica_balance(ids, np.where(np.asarray(pl.phy2log)[wrong] != ids, wrong, first), pl)
    pm.check_replica_balance(ids, pm.replica_slots_np(ids, pl), pl)


def test_placement_errors_name_the_fault():
    good = pm.Placement.from_phy2log(np.array([0, 1, 2, 3, 0, 1]), 4, 2)
    with pytest.raises(pm.PlacementError, match=r"no slot for expert\(s\) \[3\]"):
        pm.Placement.from_phy2log(np.array([0, 1, 2, 0]), 4, 2)
    with pytest.raises(pm.PlacementError, match="not divisible by num_devices=4"):
        pm.Placement.from_phy2log(np.array([0, 1, 2, 3, 0, 1]), 4, 4)
    with pytest.raises(pm.PlacementError, match=r"replica_count\[0\] = 1"):
        dataclasses.replace(good, replica_count=np.array([1, 2, 1, 1], np.int32))
    with pytest.raises(pm.PlacementError, match=r"log2phy\[1\]"):
        dataclasses.replace(good, log2phy=np.asarray(good.log2phy)[[0, 2, 1, 3]])
    with pytest.raises(pm.PlacementError, match="log2phy has shape"):
        dataclasses.replace(good, log2phy=np.asarray(good.log2phy)[:, :2])
    with pytest.raises(pm.PlacementError, match="outside"):
        pm.Placement.from_phy2log(np.array([0, 1, 2, 4]), 4, 2)
    with pytest.raises(pm.PlacementError, match="num_slots=6"):
        pm.rebalance(np.ones(8), 6, 2)
    with pytest.raises(pm.PlacementError, match="non-negative"):
        pm.rebalance(np.array([1.0, -1.0]), 2, 1)
    with pytest.raises(pm.PlacementError, match="num_groups=3"):
        pm.rebalance(np.ones(8), 8, 4, num_nodes=2, num_groups=3)
    with pytest.raises(pm.PlacementError, match="experts hold 8"):
        pm.physical_experts(jaxmoe.ExpertWeights(*(jnp.ones((8, 2, 2)),) * 3), good)


def random_placement(rng, e, n, r):
    """Each expert once plus ``r`` random replicas, shuffled over the ``n`` devices."""
    return pm.Placement.from_phy2log(rng.permutation(np.concatenate([np.arange(e), rng.integers(0, e, r)])), e, n)


def with_slots(p, pl):
    return dataclasses.replace(p, experts=pm.physical_experts(p.experts, pl))


MESHES = [pytest.param(m, marks=pytest.mark.slow) for m in ((8, 1), (4, 2), (2, 4))]


@pytest.mark.parametrize("mesh_shape", MESHES, ids=["8x1", "4x2", "2x4"])
def test_ep_with_replicas_matches_one_device(mesh_shape, rng):
    """Random placements (R a random multiple of the expert axis) on each mesh: the output
    equals the one-device layer, and each slot computed exactly the pairs the replica
    rule (numpy) sends it."""
    cfg = shrunk("qwen3.6-35b-a3b", e=16)
    p = rand_params(cfg, rng)
    x = jnp.asarray(rng.standard_normal((37, cfg.d_model)), jnp.float32)  # padded to the device count
    y1, r1 = single(p, x, cfg)
    n = mesh_shape[0]
    mesh = parallel.make_mesh(*mesh_shape)
    for r in (n, n * int(rng.integers(2, 4))):
        pl = random_placement(rng, 16, n, r)
        y, st_ = parallel.moe_apply_ep(with_slots(p, pl), x, cfg, mesh, impl="gather", placement=pl, return_stats=True)
        np.testing.assert_allclose(np.asarray(y), np.asarray(y1), **TOL)
        slots = pm.replica_slots_np(r1.expert_ids, pl)
        pm.check_replica_balance(r1.expert_ids, slots, pl)
        np.testing.assert_array_equal(np.asarray(st_.expert_load), np.bincount(slots.reshape(-1), minlength=16 + r))
        assert int(st_.dropped_pairs) == 0


@pytest.mark.slow
def test_new_placement_does_not_recompile(rng):
    cfg = shrunk("deepseek-v3", e=16)
    p = rand_params(cfg, rng)
    x = jnp.asarray(rng.standard_normal((24, cfg.d_model)), jnp.float32)
    mesh = parallel.make_mesh(8)
    traces = []

    @jax.jit
    def step(p, x, pl):
        traces.append(1)
        return parallel.moe_apply_ep(p, x, cfg, mesh, impl="gather", placement=pl)

    y1, _ = single(p, x, cfg)
    before = parallel._ep_jit._cache_size()  # noqa: SLF001
    for _ in range(3):
        pl = random_placement(rng, 16, 8, 8)
        ps = with_slots(p, pl)
        np.testing.assert_allclose(np.asarray(step(ps, x, pl)), np.asarray(y1), **TOL)
        np.testing.assert_allclose(
            np.asarray(parallel.moe_apply_ep(ps, x, cfg, mesh, impl="gather", placement=pl)), np.asarray(y1), **TOL
        )
    assert len(traces) == 1
    assert parallel._ep_jit._cache_size() == before + 1  # noqa: SLF001


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["gather", "xla"])
def test_replicas_bitwise_with_batch_invariance(impl, rng):
    """With batch invariance the slot a pair lands on (and its device) does not change
    its bits: equal to the mesh without replicas and to the one-device layer."""
    cfg = shrunk("deepseek-v3", e=16)
    p = rand_params(cfg, rng)
    ex = ExecConfig(impl=impl, batch_invariant=True)
    x = jnp.asarray(rng.standard_normal((29, cfg.d_model)), jnp.float32)
    mesh = parallel.make_mesh(4, 2)
    base = np.asarray(parallel.moe_apply_ep(p, x, cfg, mesh, ex))
    pl = random_placement(rng, 16, 4, 12)
    y = np.asarray(parallel.moe_apply_ep(with_slots(p, pl), x, cfg, mesh, ex, placement=pl))
    np.testing.assert_array_equal(y, base)
    np.testing.assert_array_equal(
        y, np.asarray(jax.jit(jaxmoe.moe_apply, static_argnames=("cfg", "ex"))(p, x, cfg, ex))
    )


@pytest.mark.slow
def test_quantized_experts_with_replicas(rng):
    """physical_experts gathers every QuantizedTensor leaf (data, scales, biases)."""
    cfg = shrunk("qwen3.6-35b-a3b")
    p = rand_params(cfg, rng)
    ew = p.experts
    p = dataclasses.replace(
        p,
        experts=jaxmoe.ExpertWeights(
            quantize_int8(ew.w_gate), quantize_int4_affine(ew.w_up, group_size=32), quantize_int8(ew.w_down)
        ),
    )
    x = jnp.asarray(rng.standard_normal((21, cfg.d_model)), jnp.float32)
    pl = random_placement(rng, 16, 8, 8)
    mesh = parallel.make_mesh(8)
    ps = parallel.shard_params(with_slots(p, pl), mesh)
    y = parallel.moe_apply_ep(ps, x, cfg, mesh, impl="gather", placement=pl)
    np.testing.assert_allclose(np.asarray(y), np.asarray(single(p, x, cfg)[0]), **TOL)


def test_ep_placement_errors(rng):
    cfg = shrunk("mixtral-8x7b", e=8)
    p = rand_params(cfg, rng)
    x = jnp.asarray(rng.standard_normal((4, cfg.d_model)), jnp.float32)
    mesh = parallel.make_mesh(4)
    pl = random_placement(rng, 8, 4, 4)
    with pytest.raises(pm.PlacementError, match="params hold 8 experts but the placement has 12"):
        parallel.moe_apply_ep(p, x, cfg, mesh, placement=pl)
    with pytest.raises(pm.PlacementError, match="placement is for 2 devices"):
        parallel.moe_apply_ep(with_slots(p, pl), x, cfg, mesh, placement=random_placement(rng, 8, 2, 4))
    with pytest.raises(pm.PlacementError, match="16 logical experts"):
        parallel.moe_apply_ep(with_slots(p, pl), x, cfg, mesh, placement=random_placement(rng, 16, 4, 0))


@pytest.mark.slow
def test_eval_reports_device_loads_before_and_after(tmp_path):
    """`jaxmoe eval` with ``load_balance``: device loads before / after, the plot, and a
    replica count the mesh cannot split is a config error naming the key."""
    cfg_text = """
kind: expert-parallel
name: ep-lb
model: {preset: qwen3.6-35b-a3b, shrink: {d_model: 32, expert_dim: 16, shared_expert_dim: 16, num_experts: 16}}
impls: [gather]
tokens: [8]
mesh: [{expert: 4}]
repeats: 1
load_balance: {expert: 4, tokens: 64, zipf: 1.2, replicas: [0, 4], seed: 3}
"""
    path = tmp_path / "ep.yaml"
    path.write_text(cfg_text)
    assert eval_cli_main([str(path), "--out", str(tmp_path / "out")]) == 0
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    r0, r4 = res["load_balance"]
    for k in (r0, r4):
        assert k["status"] == "pass" and k["max_rel_err"] <= 1e-5
        assert sum(k["device_load_before"]) == sum(k["device_load_after"]) == 64 * 8
    assert r4["max_over_mean_after"] < r4["max_over_mean_before"]
    assert (tmp_path / "out" / "device_load.png").stat().st_size > 0
    assert "| 4 | 20 |" in (tmp_path / "out" / "report.md").read_text()
    path.write_text(cfg_text.replace("replicas: [0, 4]", "replicas: [0, 3]"))
    with pytest.raises(ConfigError, match=r"key 'load_balance.replicas\[1\]'"):
        load_any(path)

"""Expert parallelism (jaxmoe.parallel) on 8 forced host CPU devices.

Every case compares the expert-parallel output with the single-device `moe_apply`
(float32, tight tolerance) and with the float64 numpy loop of tests/reference.py.
"""

import dataclasses
import functools
import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import np_act, np_moe, params_to_numpy
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxmoe
from jaxmoe import parallel
from jaxmoe.evaluation.cli import cli_main as eval_cli_main
from jaxmoe.evaluation.expert_parallel import ExpertParallelConfig
from jaxmoe.evaluation.kinds import load_any
from jaxmoe.evaluation.schema import ConfigError
from jaxmoe.execution import ExecConfig
from jaxmoe.quant import quantize_int4_affine, quantize_int8

TOL = dict(atol=2e-5, rtol=2e-5)  # float32, EP vs single device
TOL64 = dict(atol=2e-4, rtol=2e-4)  # float32 vs the float64 loop


def shrunk(name, e=16, d=64, f=32):
    cfg = jaxmoe.load_config(name)
    fs = 48 if cfg.shared_expert_dim else 0
    return dataclasses.replace(
        cfg, d_model=d, expert_dim=f, shared_expert_dim=fs, router=dataclasses.replace(cfg.router, num_experts=e)
    )


def rand_params(cfg, rng):
    """Fresh numpy-random MoEParams (normal, fan-in scaled; biases and gates nonzero)."""
    d, e, f, fs = cfg.d_model, cfg.num_experts, cfg.expert_dim, cfg.shared_expert_dim

    def nrm(*shape, fan_in=None):
        return jnp.asarray(rng.standard_normal(shape) / np.sqrt(fan_in or shape[-2]), jnp.float32)

    ew = jaxmoe.ExpertWeights(nrm(e, d, f), nrm(e, d, f), nrm(e, f, d))
    if cfg.expert_bias:
        ew = dataclasses.replace(ew, b_gate=nrm(e, f, fan_in=4), b_up=nrm(e, f, fan_in=4), b_down=nrm(e, d, fan_in=4))
    shared = None
    if fs:
        shared = jaxmoe.SharedWeights(
            nrm(d, fs), nrm(d, fs), nrm(fs, d), nrm(d, fan_in=d) if cfg.shared_expert_gate else None
        )
    return jaxmoe.MoEParams(
        nrm(d, e),
        ew,
        nrm(e, fan_in=1) if cfg.router.router_bias else None,
        nrm(e, fan_in=100) if cfg.router.use_selection_bias else None,
        shared,
    )


@functools.partial(jax.jit, static_argnames=("cfg", "impl"))
def single(p, x, cfg, impl="gather", routing=None):
    """The single-device layer (jitted: one compile instead of many eager ones)."""
    return jaxmoe.moe_apply(p, x, cfg, impl=impl, return_routing=True, routing=routing)


def kept_reference(x, p, cfg, ids, ws, kept):
    """float64 loop over the kept (token, slot) pairs only, plus the shared expert."""
    x = np.asarray(x, np.float64)
    ids, ws, kept = np.asarray(ids), np.asarray(ws, np.float64), np.asarray(kept)
    f = lambda a: None if a is None else np.asarray(a, np.float64)  # noqa: E731
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            if not kept[t, s]:
                continue
            e = ids[t, s]
            g, u = x[t] @ f(p["w_gate"][e]), x[t] @ f(p["w_up"][e])
            if p.get("b_gate") is not None:
                g, u = g + f(p["b_gate"][e]), u + f(p["b_up"][e])
            o = np_act(g, u, cfg.activation, cfg.swiglu_alpha, cfg.swiglu_limit) @ f(p["w_down"][e])
            if p.get("b_down") is not None:
                o = o + f(p["b_down"][e])
            y[t] += ws[t, s] * o
    if p.get("s_gate") is not None:
        h = x @ f(p["s_gate"])
        o = (h / (1.0 + np.exp(-h)) * (x @ f(p["s_up"]))) @ f(p["s_down"])
        if p.get("s_sigmoid") is not None:
            o = o / (1.0 + np.exp(-(x @ f(p["s_sigmoid"]))))[:, None]
        y += o
    return y


def np_drops(ids, n_e, n_tok, el, c):
    """Numpy count of the capacity rule: tokens padded and split into ``n_tok`` chunks
    (chunk i on the device with expert index i % n_e); each chunk's pairs, in (token,
    slot) order, fill ``c`` rows per destination device ``id // el``.
    Returns (kept [T, k] bool, dropped int)."""
    t, k = ids.shape
    per = -(-t // n_tok)
    kept = np.zeros((t, k), bool)
    for chunk in range(n_tok):
        fill = np.zeros(n_e, int)
        for tok in range(chunk * per, min(t, (chunk + 1) * per)):
            for s in range(k):
                dst = ids[tok, s] // el
                kept[tok, s] = fill[dst] < c
                fill[dst] += 1
    return kept, int((~kept).sum())


PARITY = [
    ("qwen3.6-35b-a3b", (8, 1)),
    ("qwen3.6-35b-a3b", (4, 2)),
    ("qwen3.6-35b-a3b", (2, 4)),
    ("deepseek-v3", (8, 1)),
    ("mixtral-8x7b", (4, 2)),
    ("gpt-oss-20b", (2, 4)),
]


@pytest.mark.parametrize("preset,mesh_shape", PARITY, ids=[f"{p}-{m[0]}x{m[1]}" for p, m in PARITY])
@pytest.mark.slow
def test_ep_matches_single_device(preset, mesh_shape, rng):
    e = 8 if preset.startswith("mixtral") else 16
    cfg = shrunk(preset, e=e)
    p = rand_params(cfg, rng)
    x = jnp.asarray(rng.standard_normal((37, cfg.d_model)), jnp.float32)  # 37: padded to the device count
    mesh = parallel.make_mesh(*mesh_shape)
    y, r, stats = parallel.moe_apply_ep(p, x, cfg, mesh, impl="gather", return_routing=True, return_stats=True)
    y1, r1 = single(p, x, cfg)
    chex.assert_shape(y, x.shape)
    np.testing.assert_array_equal(np.asarray(r.expert_ids), np.asarray(r1.expert_ids))
    np.testing.assert_allclose(np.asarray(r.weights), np.asarray(r1.weights), **TOL)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y1), **TOL)
    y64, ids64, _ = np_moe(np.asarray(x), params_to_numpy(p), cfg)
    np.testing.assert_array_equal(np.asarray(r.expert_ids), ids64)
    np.testing.assert_allclose(np.asarray(y), y64, **TOL64)
    assert int(stats.dropped_pairs) == 0 and bool(stats.kept.all())
    np.testing.assert_array_equal(
        np.asarray(stats.expert_load), np.bincount(ids64.reshape(-1), minlength=cfg.num_experts)
    )


def test_uneven_routing_one_expert_takes_most(rng):
    """Expert 5 is every token's first choice (forced through the selection bias); no drop."""
    cfg = shrunk("deepseek-v3")
    p = rand_params(cfg, rng)
    p = dataclasses.replace(p, selection_bias=p.selection_bias.at[5].set(50.0))
    x = jnp.asarray(rng.standard_normal((3, 11, cfg.d_model)), jnp.float32)
    y, r, stats = parallel.moe_apply_ep(
        p, x, cfg, parallel.make_mesh(4, 2), impl="dense", return_routing=True, return_stats=True
    )
    assert bool((r.expert_ids[:, 0] == 5).all())
    y1, _ = single(p, x, cfg, "dense")
    np.testing.assert_allclose(np.asarray(y), np.asarray(y1), **TOL)
    assert int(stats.dropped_pairs) == 0 and int(stats.expert_load[5]) == 33


@pytest.mark.parametrize("mesh_shape", [(8, 1), (4, 2)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.slow
def test_worst_case_all_pairs_to_one_device(mesh_shape, rng):
    """Given routing sends every pair to the experts of device 0 (and 70% to expert 1)."""
    cfg = shrunk("gpt-oss-20b", e=16)  # k = 4
    n = mesh_shape[0]
    el = cfg.num_experts // n
    p = rand_params(cfg, rng)
    t, k = 29, cfg.top_k
    ids = np.zeros((t, k), np.int64)
    for i in range(t):  # distinct experts per token, all among the first max(E/n, k): device 0 (and 1 at 8x1)
        row = rng.permutation(max(el, k))[:k]
        if rng.random() < 0.7:  # expert 1 first for ~70% of the tokens
            row = np.concatenate([[1], row[row != 1]])[:k]
        ids[i] = row
    ws = rng.random((t, k)).astype(np.float32) + 0.1
    routing = jaxmoe.Routing(jnp.asarray(ids, jnp.int32), jnp.asarray(ws))
    x = jnp.asarray(rng.standard_normal((t, cfg.d_model)), jnp.float32)
    y, stats = parallel.moe_apply_ep(
        p, x, cfg, parallel.make_mesh(*mesh_shape), impl="gather", routing=routing, return_stats=True
    )
    y1, _ = single(p, x, cfg, "dense", routing)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y1), **TOL)
    ref = kept_reference(x, params_to_numpy(p), cfg, ids, ws, np.ones_like(ids, bool))
    np.testing.assert_allclose(np.asarray(y), ref, **TOL64)
    assert int(stats.dropped_pairs) == 0
    np.testing.assert_array_equal(np.asarray(stats.expert_load), np.bincount(ids.reshape(-1), minlength=16))


@pytest.mark.slow
def test_quantized_experts_shard(rng):
    """int8 (Q8_0) gate and down, int4 affine up: every QuantizedTensor leaf splits on its expert axis."""
    cfg = shrunk("qwen3.6-35b-a3b")
    p = rand_params(cfg, rng)
    ew = p.experts
    p = dataclasses.replace(
        p,
        experts=jaxmoe.ExpertWeights(
            quantize_int8(ew.w_gate, 32), quantize_int4_affine(ew.w_up, 32), quantize_int8(ew.w_down, 32)
        ),
    )
    mesh = parallel.make_mesh(4, 2)
    ps = parallel.shard_params(p, mesh)
    assert ps.experts.w_gate.qdata.sharding.spec == jax.sharding.PartitionSpec("expert")
    assert len(ps.experts.w_down.scales.addressable_shards) == 8
    assert ps.experts.w_down.scales.addressable_shards[0].data.shape[0] == 4
    assert ps.experts.w_up.biases.addressable_shards[0].data.shape[0] == 4
    x = jnp.asarray(rng.standard_normal((24, cfg.d_model)), jnp.float32)
    y = parallel.moe_apply_ep(ps, x, cfg, mesh, impl="gather")
    y1, _ = single(p, x, cfg)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y1), **TOL)
    y64, _, _ = np_moe(np.asarray(x), params_to_numpy(p), cfg)
    np.testing.assert_allclose(np.asarray(y), y64, **TOL64)


def skewed(rng, t=45):
    """qwen3.6 shrunk where experts 0..3 (on device 0 of every mesh here) are in every
    token's top 8: a skewed load that overflows a capacity factor near 1."""
    cfg = shrunk("qwen3.6-35b-a3b")
    p = rand_params(cfg, rng)
    u = rng.standard_normal(cfg.d_model)
    u /= np.linalg.norm(u)
    p = dataclasses.replace(p, w_router=p.w_router.at[:, :4].add(jnp.asarray(2.0 * u[:, None], jnp.float32)))
    x = jnp.asarray(rng.standard_normal((t, cfg.d_model)) + 4.0 * u, jnp.float32)
    return cfg, p, x


@pytest.mark.parametrize(
    "mesh_shape,cf", [((8, 1), 1.0), ((4, 2), 0.6), ((2, 4), 1.0)], ids=["8x1-cf1.0", "4x2-cf0.6", "2x4-cf1.0"]
)
@pytest.mark.slow
def test_capacity_factor_drops_are_counted_exactly(mesh_shape, cf, rng):
    cfg, p, x = skewed(rng)
    t = x.shape[0]
    mesh = parallel.make_mesh(*mesh_shape)
    y, r, stats = parallel.moe_apply_ep(p, x, cfg, mesh, impl="gather", capacity_factor=cf, return_routing=True)
    n_e, n_tok = mesh_shape[0], mesh_shape[0] * mesh_shape[1]
    per = -(-t // n_tok)
    c = int(np.ceil(cf * per * cfg.top_k / n_e))
    assert stats.capacity == c
    ids = np.asarray(r.expert_ids)
    kept, dropped = np_drops(ids, n_e, n_tok, cfg.num_experts // n_e, c)
    assert dropped > 0
    assert int(stats.dropped_pairs) == dropped
    np.testing.assert_array_equal(np.asarray(stats.kept), kept)
    np.testing.assert_array_equal(np.asarray(stats.expert_load), np.bincount(ids[kept], minlength=cfg.num_experts))
    ref = kept_reference(x, params_to_numpy(p), cfg, ids, np.asarray(r.weights), kept)
    np.testing.assert_allclose(np.asarray(y), ref, **TOL64)


def test_capacity_factor_large_enough_drops_nothing(rng):
    cfg = shrunk("qwen3.6-35b-a3b")
    p = rand_params(cfg, rng)
    x = jnp.asarray(rng.standard_normal((37, cfg.d_model)), jnp.float32)
    y, stats = parallel.moe_apply_ep(p, x, cfg, parallel.make_mesh(4, 2), impl="gather", capacity_factor=100.0)
    assert stats.capacity == 5 * 4  # clipped to the no-drop worst case T_local * min(k, E/n) = 5 * min(8, 4)
    assert int(stats.dropped_pairs) == 0
    np.testing.assert_allclose(np.asarray(y), np.asarray(single(p, x, cfg)[0]), **TOL)


def _ragged_emulated(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    """`jax.lax.ragged_all_to_all` as its docstring specifies it, built from a dense
    all_to_all (XLA:CPU has no ragged-all-to-all thunk)."""
    n = input_offsets.shape[0]
    r = operand.shape[0]
    rows = jnp.arange(r)
    padded = jnp.concatenate([operand, jnp.zeros_like(operand)])
    chunks = jnp.stack([jax.lax.dynamic_slice_in_dim(padded, input_offsets[j], r) for j in range(n)])
    live = rows[None, :] < send_sizes[:, None]  # [n, r]
    got = jax.lax.all_to_all(chunks, axis_name, 0, 0, tiled=True)
    got_live = jax.lax.all_to_all(live, axis_name, 0, 0, tiled=True)
    got_off = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    for i in range(n):
        idx = jnp.where(got_live[i] & (rows < recv_sizes[i]), got_off[i] + rows, output.shape[0])
        output = output.at[idx].set(got[i], mode="drop")
    return output


@pytest.mark.slow
def test_ragged_exchange_matches_padded(rng, monkeypatch):
    """The ragged exchange's offsets and sizes, run through an emulation of the op."""
    # No other test traces exchange="ragged" at these shapes, so the jit cache holds no
    # real-op trace to collide with (the lowering test below uses T=16).
    monkeypatch.setattr(parallel, "_ragged_all_to_all", _ragged_emulated)
    cfg, p, x = skewed(rng)  # with drops, so sizes < C and > C both occur
    mesh = parallel.make_mesh(4, 2)
    outs = [
        parallel.moe_apply_ep(p, x, cfg, mesh, impl="gather", exchange=ex, capacity_factor=0.6, return_stats=True)
        for ex in ("padded", "ragged")
    ]
    (yp, sp), (yr, sr) = outs
    assert sr.exchange == "ragged" and sp.exchange == "padded"
    assert int(sp.dropped_pairs) > 0
    np.testing.assert_allclose(np.asarray(yr), np.asarray(yp), **TOL)
    assert int(sr.dropped_pairs) == int(sp.dropped_pairs)
    np.testing.assert_array_equal(np.asarray(sr.kept), np.asarray(sp.kept))


def test_ragged_exchange_lowers_for_gpu_and_tpu(rng):
    cfg = shrunk("qwen3.6-35b-a3b")
    p = rand_params(cfg, rng)
    x = jnp.asarray(rng.standard_normal((16, cfg.d_model)), jnp.float32)
    tr = parallel._ep_jit.trace(
        p,
        x,
        None,
        None,
        cfg=cfg,
        mesh=parallel.make_mesh(4, 2),
        ex=ExecConfig(impl="gather"),
        c=4,
        kind="ragged",
        given=False,
    )
    for plat in ("cuda", "tpu"):
        txt = tr.lower(lowering_platforms=(plat,)).as_text()
        assert txt.count("ragged_all_to_all") == 4, plat  # x, ids, weights out; results back
    assert parallel.resolve_exchange("auto", "cuda") == "ragged"
    assert parallel.resolve_exchange("auto", "cpu") == "padded"


@pytest.mark.slow
def test_block_with_mesh_and_explicit_mesh(rng):
    cfg = shrunk("qwen3.6-35b-a3b")
    p = rand_params(cfg, rng)
    x = jnp.asarray(rng.standard_normal((2, 9, cfg.d_model)), jnp.float32)
    block = jaxmoe.MoEBlock(cfg, params=p, impl="gather", mesh=jax.make_mesh((2, 4), ("expert", "data")))
    y, r = block(x, return_routing=True)
    y1, r1 = single(p, x, cfg)
    chex.assert_shape(y, x.shape)
    np.testing.assert_array_equal(np.asarray(r.expert_ids), np.asarray(r1.expert_ids))
    np.testing.assert_allclose(np.asarray(y), np.asarray(y1), **TOL)
    # impl="auto": the grouped path (``xla`` once registered) runs inside shard_map
    y2 = jaxmoe.MoEBlock(cfg, params=p, impl="auto", mesh=parallel.make_mesh(8))(x)
    np.testing.assert_allclose(np.asarray(y2), np.asarray(y1), **TOL)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["auto", "xla", "gather"])
def test_batch_invariance_holds_on_the_mesh(impl, rng):
    """ExecConfig(batch_invariant=True) reaches each device's share (moe_apply_ep runs the
    same run_experts as moe_apply): on 8 devices a token's output is the same bits alone
    and among other tokens at any position (it fails with invariance off: the batch's
    routing and tiles change with T)."""
    cfg = shrunk("deepseek-v3", e=16)  # a shared expert, sigmoid + group-limited routing
    p = rand_params(cfg, rng)
    ex = ExecConfig(impl=impl, batch_invariant=True)
    mesh = parallel.make_mesh(8)
    needle = jnp.asarray(rng.standard_normal((1, cfg.d_model)), jnp.float32)
    alone = np.asarray(parallel.moe_apply_ep(p, needle, cfg, mesh, ex))[0]
    # the same layer as on one device (there ``cpu`` fuses the shared expert into its C++
    # call: another order of the same sums)
    np.testing.assert_allclose(alone, np.asarray(jaxmoe.moe_apply(p, needle, cfg, ex))[0], **TOL)
    for t in (5, 29):
        pos = int(rng.integers(t))
        xb = jnp.asarray(rng.standard_normal((t, cfg.d_model)), jnp.float32).at[pos].set(needle[0])
        np.testing.assert_array_equal(np.asarray(parallel.moe_apply_ep(p, xb, cfg, mesh, ex))[pos], alone)
    with pytest.raises(TypeError, match="'block_m' was removed"):
        parallel.moe_apply_ep(p, needle, cfg, mesh, block_m=4)


def test_inside_user_jit(rng):
    cfg = shrunk("mixtral-8x7b", e=8)
    p = rand_params(cfg, rng)
    mesh = parallel.make_mesh(8)
    x = jnp.asarray(rng.standard_normal((16, cfg.d_model)), jnp.float32)
    f = jax.jit(lambda p, x: parallel.moe_apply_ep(p, x, cfg, mesh, impl="gather") * 2.0)
    np.testing.assert_allclose(
        np.asarray(f(parallel.shard_params(p, mesh), x)), 2.0 * np.asarray(single(p, x, cfg)[0]), **TOL
    )


def test_errors_name_the_fault(rng):
    cfg = shrunk("qwen3.6-35b-a3b")
    p = rand_params(cfg, rng)
    x = jnp.asarray(rng.standard_normal((8, cfg.d_model)), jnp.float32)
    with pytest.raises(ValueError, match=r"num_experts=16 .*'expert' axis size 3"):
        parallel.moe_apply_ep(p, x, cfg, parallel.make_mesh(3))
    with pytest.raises(ValueError, match=r"num_experts=16 .*size 3"):
        parallel.shard_params(p, parallel.make_mesh(3))
    with pytest.raises(ValueError, match="num_experts=16 .*size 3"):
        jaxmoe.MoEBlock(cfg, params=p, mesh=parallel.make_mesh(3))(x)
    with pytest.raises(ValueError, match="axis named 'expert'"):
        parallel.moe_apply_ep(p, x, cfg, jax.make_mesh((8,), ("data",)))
    with pytest.raises(ValueError, match="unsupported mesh axis"):
        parallel.moe_apply_ep(p, x, cfg, jax.make_mesh((4, 2), ("expert", "model")))
    with pytest.raises(ValueError, match="capacity_factor"):
        parallel.moe_apply_ep(p, x, cfg, parallel.make_mesh(8), capacity_factor=0.0)
    with pytest.raises(ValueError, match=r"moe_apply_ep: routing.expert_ids has shape \(8, 2\), expected \(8, 8\)"):
        parallel.moe_apply_ep(
            p, x, cfg, parallel.make_mesh(8), routing=jaxmoe.Routing(jnp.zeros((8, 2), jnp.int32), jnp.ones((8, 2)))
        )
    with pytest.raises(ValueError, match="exchange"):
        parallel.moe_apply_ep(p, x, cfg, parallel.make_mesh(8), exchange="nccl")
    with pytest.raises(ValueError, match="width 32 but d_model is 64"):
        parallel.moe_apply_ep(p, x[:, :32], cfg, parallel.make_mesh(8))
    with pytest.raises(ValueError, match="expert=4 x data=4 needs 16 devices"):
        parallel.make_mesh(4, 4)


@settings(max_examples=6)
@given(
    t=st.integers(1, 12),
    k=st.integers(1, 4),
    n=st.sampled_from([1, 2, 4]),
    el=st.integers(1, 3),
    c=st.integers(1, 8),
    seed=st.integers(0, 2**31 - 1),
)
def test_plan_matches_numpy(t, k, n, el, c, seed):
    """The send-buffer plan (row per pair, kept mask, sizes, drops) against a numpy loop."""
    r = np.random.default_rng(seed)
    e = n * el
    k = min(k, e)
    ids = np.stack([r.permutation(e)[:k] for _ in range(t)])
    valid = r.random(t) < 0.8
    slot, kept, sizes, dropped = jax.jit(parallel._plan, static_argnums=(2, 3, 4))(
        jnp.asarray(ids, jnp.int32), jnp.asarray(valid), n, el, c
    )
    fill = np.zeros(n, int)
    want_slot = np.full(t * k, n * c)
    for i in range(t * k):
        if not valid[i // k]:
            continue
        dst = ids[i // k, i % k] // el
        if fill[dst] < c:
            want_slot[i] = dst * c + fill[dst]
        fill[dst] += 1
    np.testing.assert_array_equal(np.asarray(slot), want_slot)
    np.testing.assert_array_equal(np.asarray(kept), want_slot < n * c)
    np.testing.assert_array_equal(np.asarray(sizes), np.minimum(fill, c))
    assert int(dropped) == int((fill - np.minimum(fill, c)).sum())


@pytest.mark.slow
def test_eval_runner_meshes_vs_single_device(tmp_path, rng):
    """`jaxmoe eval <yaml>` runs a `kind: expert-parallel` config with this runner."""
    seed = int(rng.integers(1000))
    cfg_text = f"""
kind: expert-parallel
name: ep-test
model: {{preset: mixtral-8x7b, shrink: {{d_model: 32, expert_dim: 16}}, seed: {seed}}}
inputs: {{kind: random, seed: {seed}}}
impls: [gather]
tokens: [12]
mesh: [{{expert: 4, data: 2}}, {{expert: 16}}]
capacity_factors: [null]
repeats: 1
tolerance: 1.0e-5
"""
    path = tmp_path / "ep.yaml"
    path.write_text(cfg_text)
    assert eval_cli_main([str(path), "--out", str(tmp_path / "out")]) == 0
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    ok, skipped = res["cases"]
    assert ok["status"] == "pass" and ok["dropped_pairs"] == 0 and ok["max_rel_err"] <= 1e-5
    assert ok["capacity"] == 2 * 2  # ceil(12 / 8) tokens per device * min(k=2, E/n=2)
    assert skipped["status"] == "skipped" and "needs 16 devices" in skipped["reason"]
    assert "| 12 | gather | 4x2 |" in (tmp_path / "out" / "report.md").read_text()
    # the shipped config is valid; a bad key is exit code 2 naming it
    shipped = load_any("expert-parallel")
    assert isinstance(shipped, ExpertParallelConfig)
    assert [m.expert for m in shipped.mesh][:4] == [1, 2, 4, 8]
    path.write_text(cfg_text.replace("tolerance:", "tolerence:"))
    assert eval_cli_main([str(path)]) == 2
    with pytest.raises(ConfigError, match=r"ep\.yaml: key 'tolerence': unknown key"):
        load_any(path)


@pytest.mark.parametrize("exchange", ["padded", "ragged"])
@pytest.mark.slow
def test_padding_rows_are_not_computed(exchange, rng, monkeypatch):
    """The unused rows of the [n, C] exchange buffers carry an id the plan drops: the
    grouped path computes exactly the T * k real pairs (before: all n * n * C rows, up to
    8x the work at 8 devices), and the output is unchanged."""
    from jaxmoe.dispatch import plan_dispatch
    from jaxmoe.impls.registry import register_impl, unregister_impl
    from jaxmoe.impls.xla import experts_xla

    if exchange == "ragged":  # XLA:CPU has no ragged-all-to-all: emulate it (as test_ragged_exchange_matches_padded)
        monkeypatch.setattr(parallel, "_ragged_all_to_all", _ragged_emulated)
    counts = []

    def counting(x, routing, ew, cfg, ex):
        plan = plan_dispatch(routing.expert_ids, ew.num_experts, 1)
        jax.debug.callback(lambda v, r: counts.append((int(v), int(r))), plan.num_valid, routing.expert_ids.shape[0])
        return experts_xla(x, routing, ew, cfg, ex)

    register_impl("count_rows_test", counting)
    try:
        cfg = shrunk("qwen3.6-35b-a3b", e=16)
        p = rand_params(cfg, rng)
        t = 37
        x = jnp.asarray(rng.standard_normal((t, cfg.d_model)), jnp.float32)
        mesh = parallel.make_mesh(8)
        y, stats = parallel.moe_apply_ep(p, x, cfg, mesh, impl="count_rows_test", exchange=exchange, return_stats=True)
        jax.block_until_ready(y)
    finally:
        unregister_impl("count_rows_test")
    assert len(counts) == 8
    computed = sum(v for v, _ in counts)
    buffer_rows = sum(r for _, r in counts)
    assert computed == t * cfg.top_k, (computed, buffer_rows)
    assert buffer_rows == 8 * 8 * stats.capacity > 2 * computed  # all of these were computed before
    np.testing.assert_array_equal(np.asarray(stats.expert_load).sum(), t * cfg.top_k)
    y1, _ = single(p, x, cfg)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y1), **TOL)

"""Routing statistics (`jaxmoe.stats`, `MoEBlock(track_load=True)`) against a numpy count, and
routing traces (`jaxmoe.traces`): write / read / replay bit for bit, and every bad trace."""

import json
from types import SimpleNamespace

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from helpers import random_params, shrink
from hypothesis import given
from hypothesis import strategies as st
from safetensors.numpy import save_file

import jaxmoe
from jaxmoe import parallel
from jaxmoe.evaluation.offload import SweepInput, prepare_input
from jaxmoe.execution import ExecConfig
from jaxmoe.offload.traces import load_trace, save_trace, synthetic_trace
from jaxmoe.stats import contiguous_devices, device_load, expert_counts
from jaxmoe.traces import (
    HEADER_KEYS,
    RoutingTrace,
    TraceError,
    TraceRecorder,
    ids_dtype,
    load_routing_trace,
    save_routing_trace,
)


@pytest.fixture(scope="module")
def cfg():
    return shrink(jaxmoe.load_config("qwen3.6-35b-a3b"))  # E 16, k 8, gated shared expert


def np_counts(ids, e, valid=None):
    """The independent count: a Python loop over the (token, slot) pairs."""
    ids = np.asarray(ids).reshape(-1, np.asarray(ids).shape[-1])
    out = np.zeros(e, np.int64)
    for t, row in enumerate(ids):
        if valid is not None and not np.asarray(valid).reshape(-1)[t]:
            continue
        for i in row:
            if 0 <= i < e:
                out[i] += 1
    return out


def loaded(block) -> np.ndarray:
    """``block.expert_load`` as numpy."""
    assert block.expert_load is not None
    return np.asarray(block.expert_load.get_value())


# ------------------------------------------------------------------ statistics


COUNTS = jax.jit(expert_counts, static_argnums=1)  # one compile per shape drawn


@given(
    e=st.sampled_from([1, 16, 40]),  # few shapes: few compiles
    t=st.sampled_from([0, 1, 30]),
    k=st.sampled_from([1, 6]),
    seed=st.integers(0, 2**31 - 1),
    lead=st.sampled_from([(), (2,)]),
)
def test_expert_counts_match_a_numpy_count(e, t, k, seed, lead):
    """Ids anywhere in ``[-3, E + 3)`` (out of range ones do not count), with and without a
    random padding mask, a leading batch axis, int32 or int16 ids, a `Routing` or its ids."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(-3, e + 3, size=(*lead, t, k)).astype([np.int32, np.int16][int(rng.integers(2))])
    valid = rng.random((*lead, t)) < 0.7
    got = COUNTS(jnp.asarray(ids), e, valid=jnp.asarray(valid))
    chex.assert_shape(got, (e,))
    chex.assert_type(got, jnp.int32)
    np.testing.assert_array_equal(np.asarray(got), np_counts(ids, e, valid))
    r = jaxmoe.Routing(jnp.asarray(ids), jnp.asarray(rng.random(ids.shape), jnp.float32))
    np.testing.assert_array_equal(np.asarray(COUNTS(r, e)), np_counts(ids, e))


def test_expert_counts_eager():
    ids = jnp.asarray([[0, 3], [3, -1], [7, 2]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(expert_counts(ids, 4)), [1, 0, 1, 2])
    valid = jnp.asarray([True, False, True])
    np.testing.assert_array_equal(np.asarray(expert_counts(ids, 4, valid=valid)), [1, 0, 1, 1])


@given(n=st.sampled_from([1, 5, 24]), d=st.sampled_from([1, 3, 6]), seed=st.integers(0, 2**31 - 1))
def test_device_load_matches_a_numpy_sum(n, d, seed):
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 1000, size=(3, n)).astype(np.int32)
    dev = rng.integers(-1, d + 1, size=n).astype(np.int32)  # -1 and d: not counted
    want = np.zeros((3, d), np.int64)
    for j in range(n):
        if 0 <= dev[j] < d:
            want[:, dev[j]] += counts[:, j]
    got = jax.jit(device_load, static_argnums=2)(jnp.asarray(counts), jnp.asarray(dev), d)
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(np.asarray(device_load(counts[0], dev, d)), want[0])


def test_contiguous_devices_and_bad_inputs():
    np.testing.assert_array_equal(contiguous_devices(8, 4), [0, 0, 1, 1, 2, 2, 3, 3])
    with pytest.raises(ValueError, match="num_devices=3 does not divide num_slots=8"):
        contiguous_devices(8, 3)
    with pytest.raises(ValueError, match="expert_counts: expert_ids must be an integer array"):
        expert_counts(jnp.ones((4, 2)), 8)
    with pytest.raises(ValueError, match=r"expert_counts: valid must be bool \(4,\)"):
        expert_counts(jnp.zeros((4, 2), jnp.int32), 8, valid=jnp.ones((3,), bool))
    with pytest.raises(ValueError, match="num_experts must be a positive int"):
        expert_counts(jnp.zeros((4, 2), jnp.int32), 0)
    with pytest.raises(ValueError, match=r"device_load: expert_to_device must be integer \[5\]"):
        device_load(jnp.zeros((5,), jnp.int32), np.zeros(4, np.int32), 2)


@pytest.mark.slow
def test_block_accumulates_its_load_and_resets(cfg, rng):
    """Eager calls add the call's counts, outputs are the untracked block's bit for bit,
    `reset_expert_load` zeroes the counter."""
    p = random_params(cfg, rng)
    block = jaxmoe.MoEBlock(cfg, params=p, track_load=True)
    plain = jaxmoe.MoEBlock(cfg, params=p)
    assert plain.expert_load is None and isinstance(block.expert_load, jaxmoe.ExpertLoad)
    assert "expert_load" not in nnx.state(block, nnx.Param)
    x1 = jnp.asarray(rng.standard_normal((2, 5, cfg.d_model)), jnp.float32)
    x2 = jnp.asarray(rng.standard_normal((7, cfg.d_model)), jnp.float32)
    y, r = block(x1, return_routing=True)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(plain(x1)))
    y2, r2 = block(x2, return_routing=True)
    np.testing.assert_array_equal(np.asarray(y2), np.asarray(plain(x2)))
    want = np_counts(r.expert_ids, cfg.num_experts) + np_counts(r2.expert_ids, cfg.num_experts)
    np.testing.assert_array_equal(loaded(block), want)
    assert int(loaded(block).sum()) == 17 * cfg.top_k
    block.reset_expert_load()
    np.testing.assert_array_equal(loaded(block), 0)
    block(x2)
    np.testing.assert_array_equal(loaded(block), np_counts(r2.expert_ids, cfg.num_experts))
    with pytest.raises(ValueError, match="track_load=True"):
        plain.reset_expert_load()
    with pytest.raises(ValueError, match="track_load must be a bool"):
        jaxmoe.MoEBlock(cfg, params=p, track_load=1)  # type: ignore[arg-type]


@pytest.mark.slow
def test_block_load_under_nnx_jit_and_grad(cfg, rng):
    """``nnx.jit``, ``nnx.grad`` and ``return_aux`` calls add their counts too."""
    p = random_params(cfg, rng)
    block = jaxmoe.MoEBlock(cfg, params=p, track_load=True)
    plain = jaxmoe.MoEBlock(cfg, params=p)
    x1 = jnp.asarray(rng.standard_normal((2, 5, cfg.d_model)), jnp.float32)
    x2 = jnp.asarray(rng.standard_normal((7, cfg.d_model)), jnp.float32)
    r = plain(x1, return_routing=True)[1]
    want = np.zeros(cfg.num_experts, np.int64)
    y2 = nnx.jit(lambda m, a: m(a))(block, x2)
    np.testing.assert_array_equal(np.asarray(y2), np.asarray(plain(x2)))
    want += np_counts(plain(x2, return_routing=True)[1].expert_ids, cfg.num_experts)
    np.testing.assert_array_equal(loaded(block), want)
    g = nnx.grad(lambda m: m(x1).sum())(block)
    assert float(jnp.abs(g["w_up"].get_value()).max()) > 0
    _, aux = block(x2, return_aux=True)
    want += np_counts(r.expert_ids, cfg.num_experts) + np_counts(aux.routing.expert_ids, cfg.num_experts)
    np.testing.assert_array_equal(loaded(block), want)
    assert int(loaded(block).sum()) == (10 + 2 * 7) * cfg.top_k


@pytest.mark.slow
def test_block_on_a_mesh_accumulates_its_load(cfg, rng):
    """Under expert parallelism (4 devices, a token count the mesh pads): padding rows do
    not count; per-device load from the counts and the contiguous layout."""
    p = random_params(cfg, rng)
    block = jaxmoe.MoEBlock(cfg, params=p, impl="gather", mesh=parallel.make_mesh(4), track_load=True)
    x = jnp.asarray(rng.standard_normal((9, cfg.d_model)), jnp.float32)
    y = block(x)
    y1, r = jaxmoe.moe_apply(p, x, cfg, impl="gather", return_routing=True)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y1), atol=2e-5, rtol=2e-5)
    want = np_counts(r.expert_ids, cfg.num_experts)
    np.testing.assert_array_equal(loaded(block), want)
    per_dev = device_load(loaded(block), contiguous_devices(cfg.num_experts, 4), 4)
    np.testing.assert_array_equal(np.asarray(per_dev), want.reshape(4, -1).sum(1))


# ------------------------------------------------------------------ traces


def record(cfg, rng, layers=(0, 1, 2), t=11):
    """Per layer: its own params and input; the recorded routing and output of ``moe_apply``."""
    rec = TraceRecorder(cfg.num_experts, cfg.top_k, model="shrunk qwen", preset="qwen3.6-35b-a3b")
    calls = {}
    for layer in layers:
        p = random_params(cfg, rng)
        x = jnp.asarray(rng.standard_normal((t, cfg.d_model)), jnp.float32)
        y, r = jaxmoe.moe_apply(p, x, cfg, return_routing=True)
        rec.record(layer, jaxmoe.Routing(r.expert_ids[:5], r.weights[:5]))  # two calls of one layer
        rec.record(layer, jaxmoe.Routing(r.expert_ids[5:], r.weights[5:]))
        calls[layer] = (p, x, y, r)
    return rec, calls


@pytest.mark.slow
def test_trace_round_trip_replays_bit_exactly(cfg, rng, tmp_path):
    rec, calls = record(cfg, rng, layers=(3, 5, 6))
    trace = rec.trace()
    save_routing_trace(tmp_path / "t.safetensors", trace)
    back = load_routing_trace(tmp_path / "t.safetensors", num_experts=cfg.num_experts, top_k=cfg.top_k)
    assert back.expert_ids.dtype == np.uint8 and back.weights is not None and back.weights.dtype == np.float32
    assert (back.layers, back.model, back.preset) == ((3, 5, 6), "shrunk qwen", "qwen3.6-35b-a3b")
    assert back.shape == (3, 11, cfg.top_k) and back.top_k == cfg.top_k
    for layer, (p, x, y, r) in calls.items():
        rr = back.routing(layer)
        np.testing.assert_array_equal(np.asarray(rr.expert_ids), np.asarray(r.expert_ids))
        np.testing.assert_array_equal(np.asarray(rr.weights), np.asarray(r.weights))
        y2 = jaxmoe.moe_apply(p, x, cfg, routing=rr)
        np.testing.assert_array_equal(np.asarray(y2), np.asarray(y))
    # bfloat16 weights: a smaller file that replays the weights rounded to bfloat16
    save_routing_trace(tmp_path / "b.safetensors", trace.with_weights("bfloat16"))
    half = load_routing_trace(tmp_path / "b.safetensors")
    assert half.weights is not None and half.weights.dtype == ml_dtypes.bfloat16
    assert (tmp_path / "b.safetensors").stat().st_size < (tmp_path / "t.safetensors").stat().st_size
    p, x, y, r = calls[5]
    w16 = np.asarray(r.weights).astype(ml_dtypes.bfloat16).astype(np.float32)
    want = jaxmoe.moe_apply(p, x, cfg, routing=jaxmoe.Routing(r.expert_ids, jnp.asarray(w16)))
    np.testing.assert_array_equal(np.asarray(jaxmoe.moe_apply(p, x, cfg, routing=half.routing(5))), np.asarray(want))


@pytest.mark.slow
def test_trace_replays_into_moe_apply_ep_bit_exactly(cfg, rng, tmp_path):
    p = random_params(cfg, rng)
    x = jnp.asarray(rng.standard_normal((10, cfg.d_model)), jnp.float32)
    mesh = parallel.make_mesh(4, 2)
    ex = ExecConfig(impl="gather")
    y, r = jaxmoe.moe_apply_ep(p, x, cfg, mesh, ex, return_routing=True)
    rec = TraceRecorder(cfg.num_experts, cfg.top_k)
    rec.record(0, r)
    save_routing_trace(tmp_path / "ep.safetensors", rec.trace())
    rr = load_routing_trace(tmp_path / "ep.safetensors").routing(0)
    np.testing.assert_array_equal(np.asarray(jaxmoe.moe_apply_ep(p, x, cfg, mesh, ex, routing=rr)), np.asarray(y))


@pytest.mark.parametrize(
    "e,dt", [(2, np.uint8), (256, np.uint8), (257, np.uint16), (65536, np.uint16), (65537, np.uint32)]
)
def test_ids_take_the_smallest_unsigned_type(e, dt, rng, tmp_path):
    assert ids_dtype(e) == np.dtype(dt)
    ids = np.stack([rng.choice(e, size=2, replace=False) for _ in range(6)]).reshape(2, 3, 2)
    ids[0, 0] = [e - 1, 0]
    tr = RoutingTrace(ids.astype(np.int64), rng.random((2, 3, 2)).astype(np.float32), e)
    save_routing_trace(tmp_path / "t.safetensors", tr)
    back = load_routing_trace(tmp_path / "t.safetensors", num_experts=e)
    assert back.expert_ids.dtype == np.dtype(dt)
    np.testing.assert_array_equal(back.expert_ids.astype(np.int64), ids)


def test_offload_traces_read_and_write_the_safetensors_format(cfg, rng, tmp_path):
    """`jaxmoe.offload.traces`: ``[tokens, layers, k]`` through an id-only safetensors trace;
    a trace with weights loads too, and the sweep replays a safetensors file."""
    e, k, nl = cfg.num_experts, cfg.top_k, 3
    ids = synthetic_trace(20, nl, e, k, locality=0.5, seed=int(rng.integers(1000)))
    save_trace(tmp_path / "o.safetensors", ids, e, model="m")
    tr = load_routing_trace(tmp_path / "o.safetensors")
    assert tr.weights is None and tr.expert_ids.dtype == np.uint8 and tr.model == "m"
    np.testing.assert_array_equal(load_trace(tmp_path / "o.safetensors", nl, e, k), ids)
    with pytest.raises(TraceError, match="no weights"):
        tr.routing(0)
    with pytest.raises(TraceError, match=f"num_experts={e}, the model has 32"):
        load_trace(tmp_path / "o.safetensors", nl, 32, k)
    with pytest.raises(ValueError, match="needs num_experts"):
        save_trace(tmp_path / "n.safetensors", ids)
    rec, _ = record(cfg, rng, layers=(0, 1))
    save_routing_trace(tmp_path / "w.safetensors", rec.trace())
    full = load_trace(tmp_path / "w.safetensors", 2, e, k)
    np.testing.assert_array_equal(full, rec.trace().expert_ids.transpose(1, 0, 2))
    model = SimpleNamespace(cfg=cfg, num_layers=nl)  # what prepare_input reads of an OffloadedModel
    _, _, _, trtr, trte = prepare_input(SweepInput(kind="trace", path=str(tmp_path / "o.safetensors")), model, 8, 100)
    assert trtr is not None and trte is not None
    np.testing.assert_array_equal(np.concatenate([trtr, trte]), ids)


# ------------------------------------------------------------------ bad traces


def good_file(rng, tmp_path, e=16, k=4, weights="float32"):
    ids = np.stack([rng.choice(e, size=k, replace=False) for _ in range(2 * 5)]).reshape(2, 5, k)
    w = None if weights == "none" else rng.random((2, 5, k)).astype(np.float32)
    tr = RoutingTrace(ids, w, e, (0, 1), "m", "p")
    if weights == "bfloat16":
        tr = tr.with_weights("bfloat16")
    path = tmp_path / "good.safetensors"
    save_routing_trace(path, tr)
    return path, tr


def write(tmp_path, tensors, meta, name="bad.safetensors"):
    path = tmp_path / name
    save_file(tensors, str(path), metadata=meta)
    return path


def test_the_good_file_loads(rng, tmp_path):
    for w in ("float32", "bfloat16", "none"):
        path, tr = good_file(rng, tmp_path, weights=w)
        back = load_routing_trace(path, num_experts=16, top_k=4)
        np.testing.assert_array_equal(back.expert_ids, tr.expert_ids)
        assert back.weights_dtype == w


@pytest.mark.parametrize("key", HEADER_KEYS)
def test_a_missing_header_key_is_named(key, rng, tmp_path):
    _, tr = good_file(rng, tmp_path)
    meta = tr.header()
    del meta[key]
    path = write(tmp_path, {"expert_ids": tr.expert_ids, "weights": tr.weights}, meta)
    with pytest.raises(TraceError, match=rf"bad\.safetensors: the header lacks key\(s\) \['{key}'\]"):
        load_routing_trace(path)


BAD_HEADERS = [
    ({"version": "2"}, r"unknown format version '2'"),
    ({"format": "other"}, r"header key 'format' is 'other'"),
    ({"weights_dtype": "float16"}, r"unknown weights_dtype 'float16'"),
    ({"ids_dtype": "uint16"}, r"ids_dtype 'uint16', but num_experts=16 is stored as uint8"),
    ({"num_experts": "sixteen"}, r"header key 'num_experts' is not an integer"),
    ({"top_k": "0"}, r"header key 'top_k' must be positive"),
    ({"top_k": "3"}, r"tensor 'expert_ids' has shape \(2, 5, 4\), expected \[layers, tokens, top_k=3\]"),
    ({"layers": "[0, 1"}, r"header key 'layers' is not a JSON list"),
    ({"layers": "[0, 1, 2]"}, r"layers \[0, 1, 2\] must be 2 distinct"),
    ({"num_experts": "8"}, r"expert_ids holds id \d+ outside \[0, num_experts=8\)"),
    ({"weights_dtype": "bfloat16"}, r"tensor 'weights' is float32, the header says bfloat16"),
    ({"weights_dtype": "none"}, r"tensors \['expert_ids', 'weights'\], expected \['expert_ids'\]"),
]


@pytest.mark.parametrize("change,msg", BAD_HEADERS)
def test_a_bad_header_is_a_named_error(change, msg, rng, tmp_path):
    _, tr = good_file(rng, tmp_path)
    path = write(tmp_path, {"expert_ids": tr.expert_ids, "weights": tr.weights}, {**tr.header(), **change})
    with pytest.raises(TraceError, match=rf"bad\.safetensors: .*(?:{msg})"):
        load_routing_trace(path)


def test_bad_tensors_are_named_errors(rng, tmp_path):
    path, tr = good_file(rng, tmp_path)
    meta, ids, w = tr.header(), tr.expert_ids, tr.weights
    assert w is not None
    out = ids.copy()
    out[1, 2, 0] = 16  # E = 16: id out of range (uint8 holds it)
    cases = [
        ({"expert_ids": out, "weights": w}, r"expert_ids holds id 16 outside \[0, num_experts=16\)"),
        ({"expert_ids": ids, "weights": w[:, :4]}, r"weights has shape \(2, 4, 4\), expert_ids \(2, 5, 4\)"),
        ({"expert_ids": ids.astype(np.uint16), "weights": w}, r"tensor 'expert_ids' is uint16, the header says uint8"),
        ({"expert_ids": ids[0], "weights": w}, r"tensor 'expert_ids' has shape \(5, 4\)"),
        ({"expert_ids": ids}, r"tensors \['expert_ids'\], expected \['expert_ids', 'weights'\]"),
        ({"expert_ids": ids, "weights": w, "extra": w}, r"tensors \['expert_ids', 'extra', 'weights'\]"),
    ]
    rep = ids.copy()
    rep[0, 3, 1] = rep[0, 3, 0]
    cases.append(({"expert_ids": rep, "weights": w}, r"expert_ids row \(layer row 0, token 3\) repeats an expert"))
    for tensors, msg in cases:
        bad = write(tmp_path, tensors, meta)
        with pytest.raises(TraceError, match=rf"bad\.safetensors: {msg}"):
            load_routing_trace(bad)
    with pytest.raises(TraceError, match=r"good\.safetensors: the trace is of num_experts=16, the model has 32"):
        load_routing_trace(path, num_experts=32)
    with pytest.raises(TraceError, match=r"good\.safetensors: the trace has top_k=4, the model routes top_k=8"):
        load_routing_trace(path, top_k=8)


def test_truncated_missing_and_foreign_files_are_named_errors(rng, tmp_path):
    path, _ = good_file(rng, tmp_path)
    data = path.read_bytes()
    for cut in (len(data) - 3, 20, 5):
        (tmp_path / "cut.safetensors").write_bytes(data[:cut])
        with pytest.raises(TraceError, match=r"cut\.safetensors: not a readable safetensors file"):
            load_routing_trace(tmp_path / "cut.safetensors")
    with pytest.raises(TraceError, match=r"routing trace .*nope\.safetensors not found"):
        load_routing_trace(tmp_path / "nope.safetensors")
    other = write(tmp_path, {"w": np.ones((2, 2), np.float32)}, {"format": "pt"}, name="model.safetensors")
    with pytest.raises(TraceError, match=r"model\.safetensors: the header lacks key"):
        load_routing_trace(other)
    nometa = write(tmp_path, {"w": np.ones((2, 2), np.float32)}, None, name="plain.safetensors")
    with pytest.raises(TraceError, match=r"plain\.safetensors: the header lacks key"):
        load_routing_trace(nometa)


def test_bad_traces_in_memory_and_recorder_errors(cfg, rng):
    ids = np.stack([rng.choice(16, size=4, replace=False) for _ in range(6)]).reshape(2, 3, 4)
    w = rng.random((2, 3, 4)).astype(np.float32)
    with pytest.raises(TraceError, match=r"expert_ids must be \[layers, tokens, k\]"):
        RoutingTrace(ids[0], w[0], 16)
    with pytest.raises(TraceError, match="id -1 outside"):
        RoutingTrace(np.where(ids == ids[0, 0, 0], -1, ids), w, 16)
    with pytest.raises(TraceError, match="weights must be float32 or bfloat16, got int32"):
        RoutingTrace(ids, ids.astype(np.int32), 16)
    with pytest.raises(TraceError, match="k=4, which must lie in"):
        RoutingTrace(ids, w, 3)
    tr = RoutingTrace(ids, w, 16, layers=(4, 9))
    with pytest.raises(TraceError, match=r"layer 5 is not in the trace \(layers \[4, 9\]\)"):
        tr.routing(5)
    with pytest.raises(TraceError, match="weights dtype must be one of"):
        tr.with_weights("float16")
    rec = TraceRecorder(16, 4)
    with pytest.raises(TraceError, match="nothing was recorded"):
        rec.trace()
    with pytest.raises(TraceError, match=r"record\(layer 0\): expert_ids \(3, 3\)"):
        rec.record(0, jaxmoe.Routing(jnp.asarray(ids[0, :, :3]), jnp.asarray(w[0, :, :3])))
    with pytest.raises(TraceError, match=r"record\(layer 0\): an id lies outside \[0, 16\)"):
        rec.record(0, jaxmoe.Routing(jnp.asarray(ids[0] + 16), jnp.asarray(w[0])))
    rec.record(0, jaxmoe.Routing(jnp.asarray(ids[0]), jnp.asarray(w[0])))
    rec.record(1, jaxmoe.Routing(jnp.asarray(ids[1, :2]), jnp.asarray(w[1, :2])))
    with pytest.raises(TraceError, match=r"different token counts \{0: 3, 1: 2\}"):
        rec.trace()
    with pytest.raises(TraceError, match="takes a RoutingTrace"):
        save_routing_trace("x.safetensors", {"expert_ids": ids})  # type: ignore[arg-type]
    assert json.loads(tr.header()["layers"]) == [4, 9]

"""Experts streamed from storage (jaxmoe.offload): stores, cache, prerouters, decode driver.

References: a float64 numpy loop of the whole layer stack, gguf-py's dequantizer, a
tiny pure-Python LRU / LFU cache, and the fully resident run (bitwise).
"""

import dataclasses
import json
import struct
from types import SimpleNamespace

import gguf
import jax
import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxmoe
from jaxmoe.evaluation.kinds import load_any
from jaxmoe.evaluation.offload import OffloadSweepConfig, SweepInput, prepare_input, run_sweep
from jaxmoe.evaluation.presets import shrink_config
from jaxmoe.evaluation.schema import ConfigError
from jaxmoe.offload import (
    ExpertCache,
    ExpertStoreError,
    GGUFStore,
    OffloadConfig,
    OffloadedModel,
    SafetensorsStore,
    load_trace,
    make_cache,
    make_predictor,
    random_layers,
    reuse_rate,
    save_trace,
    synthetic_trace,
    train_learned,
    write_gguf_store,
    write_safetensors_store,
)
from jaxmoe.offload.prerouter import PredictQuery
from jaxmoe.offload.store import ResidentLayer
from jaxmoe.offload.traces import load_hidden
from jaxmoe.traces import load_routing_trace

L, E, K, D, F = 3, 16, 4, 64, 32


def small_cfg():
    return shrink_config(
        jaxmoe.load_config("qwen3.6-35b-a3b"),
        d_model=D,
        expert_dim=F,
        shared_expert_dim=32,
        num_experts=E,
        top_k=K,
        num_layers=L,
    )


def fresh_layers(cfg, rng):
    """Random layers (fresh per test): jaxmoe init weights perturbed by the test's rng."""
    layers = random_layers(cfg, L, seed=int(rng.integers(1 << 20)))
    out = []
    for res, ew in layers:
        norm = (1.0 + 0.2 * rng.standard_normal(cfg.d_model)).astype(np.float32)
        out.append((ResidentLayer(norm, res.w_router, res.b_router, res.selection_bias, res.shared), ew))
    return out


# ------------------------------------------------------------------ float64 reference


def _silu(v):
    return v / (1.0 + np.exp(-v))


def reference_stack(layers, x, cfg, dequant=None):
    """float64 loop: h += moe(rmsnorm(h) * norm) per layer; softmax top-k renormalized routing.

    ``dequant(l, name) -> [E, in, out]`` gives expert weights (default: the float arrays).
    Returns outputs ``[N, d]`` and ids ``[N, L, k]`` (sorted per row).
    """
    n = x.shape[0]
    outs, ids_all = np.zeros((n, cfg.d_model)), np.zeros((n, len(layers), cfg.top_k), np.int64)
    for t in range(n):
        h = x[t].astype(np.float64)
        for l, (res, ew) in enumerate(layers):
            xn = h / np.sqrt(np.mean(h * h) + 1e-6) * np.asarray(res.norm, np.float64)
            z = xn @ np.asarray(res.w_router, np.float64)
            p = np.exp(z - z.max())
            p /= p.sum()
            top = np.argsort(-p, kind="stable")[: cfg.top_k]
            w = p[top] / p[top].sum()
            ids_all[t, l] = np.sort(top)
            ws = {
                nm: (dequant(l, nm) if dequant else np.asarray(getattr(ew, nm), np.float64))
                for nm in ("w_gate", "w_up", "w_down")
            }
            y = np.zeros(cfg.d_model)
            for e, we in zip(top, w):
                hmid = _silu(xn @ ws["w_gate"][e]) * (xn @ ws["w_up"][e])
                y += we * (hmid @ ws["w_down"][e])
            sh = res.shared
            if sh is not None:
                ys = (
                    _silu(xn @ np.asarray(sh.w_gate, np.float64)) * (xn @ np.asarray(sh.w_up, np.float64))
                ) @ np.asarray(sh.w_down, np.float64)
                if sh.gate is not None:
                    ys = ys / (1.0 + np.exp(-(xn @ np.asarray(sh.gate, np.float64))))
                y += ys
            h = h + y
        outs[t] = h
    return outs, ids_all


@pytest.fixture(scope="module")
def cfg():
    return small_cfg()


@pytest.fixture
def stack(cfg, rng, tmp_path):
    layers = fresh_layers(cfg, rng)
    store = write_safetensors_store(tmp_path / "store", cfg, layers, kind="float32")
    return layers, store


def test_resident_run_matches_float64_reference(cfg, stack, rng):
    layers, store = stack
    x = rng.standard_normal((5, D)).astype(np.float32)
    model = OffloadedModel(store)
    res = model.run_resident(x)
    ref, ref_ids = reference_stack(layers, x, cfg)
    np.testing.assert_array_equal(np.sort(res.ids, axis=-1), ref_ids)
    np.testing.assert_allclose(res.outputs, ref, rtol=2e-5, atol=2e-5)
    # the driver's full-stack layer is jaxmoe.moe_apply itself: same bits as the block's own path
    apply = jax.jit(lambda p, xn: jaxmoe.moe_apply(p, xn, cfg, impl="gather"))
    h = x[:1]
    for r, ew in layers:
        xn = np.asarray(jaxmoe.offload.driver.rms_norm(h, r.norm))
        h = h + np.asarray(apply(jaxmoe.MoEParams(r.w_router, ew, None, None, r.shared), xn))
    np.testing.assert_allclose(res.outputs[0], h[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("policy,scope", [("lru", "global"), ("lfu", "per_layer")])
def test_streamed_outputs_bit_identical_across_budgets_and_predictors(cfg, stack, rng, policy, scope):
    layers, store = stack
    x = rng.standard_normal((6, D)).astype(np.float32)
    model = OffloadedModel(store)
    ref = model.run_resident(x)
    nb = store.expert_nbytes()
    learned = train_learned(ref.ids, E, ref.hidden, steps=20)
    for slots in (0, 1, 7, L * E):
        budget = slots * nb
        for name in ("none", "prev_token", "next_router", "learned", "oracle"):
            pred = make_predictor(
                name, resident=model.resident, router_cfg=cfg.router, learned=learned, oracle_ids=ref.ids
            )
            seen = []

            def check(t, l, cache, budget=budget, seen=seen):
                assert cache.used_bytes <= budget, (t, l, cache.used_bytes, budget)
                seen.append((t, l))

            out, stats = model.run_offloaded(x, OffloadConfig(budget, policy, scope), pred, on_step=check)
            np.testing.assert_array_equal(out.outputs, ref.outputs, err_msg=f"{name} budget={slots} experts")
            np.testing.assert_array_equal(out.ids, ref.ids)
            assert len(seen) == x.shape[0] * L
            d = stats.to_dict()
            assert d["peak_cache_bytes"] <= budget
            tot = stats.total()
            assert tot.needed == x.shape[0] * L * K == tot.hits + tot.late + tot.misses
            assert d["peak_staged_bytes"] <= 2 * K * nb  # staged prefetches: at most two layers' predictions
            if slots == 0 and name == "none":
                assert tot.hits == 0
            if name == "oracle":
                assert d["recall"] == 1.0


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.slow
def test_quantized_store_streams_bit_identical(cfg, rng, tmp_path, kind):
    layers = fresh_layers(cfg, rng)
    store = write_safetensors_store(tmp_path / kind, cfg, layers, kind=kind, group_size=32)
    x = rng.standard_normal((4, D)).astype(np.float32)
    model = OffloadedModel(store)
    ref = model.run_resident(x)
    assert isinstance(store.load_expert(1, 2).w_up, jaxmoe.QuantizedTensor)  # quantized as stored

    def deq(l, name):  # independent numpy dequantization of the stored codes
        out = []
        for e in range(E):
            q = getattr(store.load_expert(l, e), name)
            codes = np.asarray(q.qdata).astype(np.float64)
            if kind == "int4":
                b = np.asarray(q.qdata)
                codes = np.stack([b & 15, b >> 4], -1).reshape(b.shape[0], -1).astype(np.float64)
            sc = np.repeat(np.asarray(q.scales, np.float64), 32, axis=-1)
            w = codes * sc + (np.repeat(np.asarray(q.biases, np.float64), 32, axis=-1) if kind == "int4" else 0)
            out.append(w.T)
        return np.stack(out)

    refo, _ = reference_stack(layers, x, cfg, dequant=deq)
    np.testing.assert_allclose(ref.outputs, refo, rtol=2e-5, atol=2e-5)
    for slots in (0, 3):
        out, _ = model.run_offloaded(
            x, OffloadConfig(slots * store.expert_nbytes(), "lfu"), make_predictor("prev_token")
        )
        np.testing.assert_array_equal(out.outputs, ref.outputs)


class AlwaysWrong:
    """Predicts k experts the step will NOT select (it peeks at the true routing)."""

    name = "always_wrong"

    def __init__(self, ids):
        self.ids = ids

    def predict(self, q: PredictQuery):
        return np.array([e for e in range(E) if e not in set(self.ids[q.step, q.layer].tolist())][: q.m])


def test_always_wrong_predictor_costs_time_not_correctness(cfg, stack, rng):
    layers, store = stack
    x = rng.standard_normal((6, D)).astype(np.float32)
    model = OffloadedModel(store)
    ref = model.run_resident(x)
    budget = 2 * K * store.expert_nbytes()
    for asynchronous in (True, False):
        ocfg = OffloadConfig(budget, asynchronous=asynchronous)
        base, sb = model.run_offloaded(x, ocfg, make_predictor("none"))
        out, sw = model.run_offloaded(x, ocfg, AlwaysWrong(ref.ids))
        np.testing.assert_array_equal(out.outputs, ref.outputs)
        np.testing.assert_array_equal(base.outputs, ref.outputs)
    # the counts of the inline run: with the prefetch thread, whether a wrong prefetch is still
    # cached when a later step needs it (a hit) depends on the thread's timing
    dw, db = sw.to_dict(), sb.to_dict()
    assert dw["recall"] == 0.0
    assert dw["bytes_prefetch_per_token"] > 0
    assert dw["bytes_loaded_per_token"] > db["bytes_loaded_per_token"]  # wasted loads
    assert dw["hit_rate"] <= db["hit_rate"]


def test_oracle_prefetch_overlaps_and_hides_every_load_after_the_first(cfg, stack, rng):
    layers, store = stack
    x = rng.standard_normal((5, D)).astype(np.float32)
    model = OffloadedModel(store)
    ref = model.run_resident(x)
    for slots in (L * E, 0):  # everything fits / nothing fits: staged prefetches are the double buffer
        out, s = model.run_offloaded(
            x,
            OffloadConfig(slots * store.expert_nbytes(), asynchronous=True),
            make_predictor("oracle", oracle_ids=ref.ids),
        )
        np.testing.assert_array_equal(out.outputs, ref.outputs)
        tot = s.total()
        assert tot.misses == K  # only layer 0 of token 0 was never predicted
        assert tot.hits + tot.late == tot.needed - K


def test_gguf_store_slices_match_gguf_dequantize_and_stream(cfg, rng, tmp_path):
    layers = fresh_layers(cfg, rng)
    for qtype in ("F16", "Q8_0", "Q4_0"):
        store = write_gguf_store(tmp_path / f"m_{qtype}.gguf", cfg, layers, qtype=qtype)
        reader = gguf.GGUFReader(str(tmp_path / f"m_{qtype}.gguf"))
        tens = {t.name: t for t in reader.tensors}

        def deq(l, name, tens=tens):
            t = tens[f"blk.{l}.ffn_{name[2:]}_exps.weight"]
            full = gguf.quants.dequantize(np.array(t.data), t.tensor_type).astype(np.float64)  # [E, out, in]
            return np.swapaxes(full, -1, -2)

        for l, e in ((0, 0), (2, int(rng.integers(E)))):
            ew = store.load_expert(l, e)
            for name in ("w_gate", "w_up", "w_down"):
                got = np.asarray(jaxmoe.quant.materialize(getattr(ew, name), np.float32))
                np.testing.assert_array_equal(got, deq(l, name)[e].astype(np.float32), err_msg=f"{qtype} {name}")
        if qtype != "Q4_0":
            continue  # the driver runs on one GGUF type (compiles are per storage type)
        x = rng.standard_normal((3, D)).astype(np.float32)
        model = OffloadedModel(store)
        ref = model.run_resident(x)
        refo, _ = reference_stack(layers, x, cfg, dequant=deq)
        np.testing.assert_allclose(ref.outputs, refo, rtol=1e-4, atol=1e-4)
        out, _ = model.run_offloaded(
            x,
            OffloadConfig(5 * store.expert_nbytes(), "lru", "per_layer"),
            make_predictor("next_router", resident=model.resident, router_cfg=cfg.router),
        )
        np.testing.assert_array_equal(out.outputs, ref.outputs)


def test_gguf_store_q4_0_extreme_scales_match_gguf_dequantize(cfg, rng, tmp_path):
    """Q4_0 blocks with |d| > 8188, whose bias -8 d would overflow float16 (the store once
    decoded it to -inf): the store reads with the loader's codec, so every expert keeps its
    Q4_0 block bytes (kind q4_0, the file's bytes) and stays bit-exact with gguf-py."""
    layers = fresh_layers(cfg, rng)
    res, ew = layers[1]
    w_up = np.array(ew.w_up, np.float32)  # [E, d, F]
    w_up[3, 5, 7] = -1.2e5  # expert 3, output 7: the block of inputs 0..31 gets d = 15000
    layers[1] = (res, dataclasses.replace(ew, w_up=w_up))
    path = tmp_path / "big.gguf"
    store = write_gguf_store(path, cfg, layers, qtype="Q4_0")
    t = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}["blk.1.ffn_up_exps.weight"]
    want = np.swapaxes(gguf.quants.dequantize(np.array(t.data), t.tensor_type), -1, -2)  # [E, in, out]
    assert np.isfinite(want).all() and np.abs(want[3]).max() > 1e5
    for e in (3, 4):
        w = store.load_expert(1, e).w_up
        assert isinstance(w, jaxmoe.QuantizedTensor) and w.kind == "q4_0" and w.scales is None
        np.testing.assert_array_equal(np.asarray(w.qdata), np.array(t.data)[e])
        got = np.asarray(jaxmoe.quant.materialize(w, np.float32))
        np.testing.assert_array_equal(got, want[e].astype(np.float32), err_msg=f"expert {e}")


# ------------------------------------------------------------------ corrupt / missing experts


def _tensor_span(path, name):
    raw = open(path, "rb").read(8)
    (n,) = struct.unpack("<Q", raw)
    with open(path, "rb") as f:
        f.seek(8)
        header = json.loads(f.read(n))
    a, b = header[name]["data_offsets"]
    return 8 + n + a, 8 + n + b


def test_corrupt_expert_is_a_clear_error_naming_layer_and_expert(cfg, stack, rng):
    layers, store = stack
    e = int(rng.integers(1, E))
    p = store.path / "layer_0001.safetensors"
    a, b = _tensor_span(p, f"experts.{e}.w_up")
    data = bytearray(p.read_bytes())
    data[a + 5] ^= 0xFF
    p.write_bytes(bytes(data))
    fresh = SafetensorsStore(store.path)
    fresh.load_expert(1, 0)
    with pytest.raises(ValueError, match=rf"layer 1, expert {e}: tensor experts\.{e}\.w_up .* corrupt"):
        fresh.load_expert(1, e)
    # the same error reaches the decode loop, whichever path (sync load or prefetch) hits it
    tr = np.stack([np.stack([(np.arange(K) + e) % E] * L)] * 3)  # expert e needed at layer 1, token 0
    x = rng.standard_normal((3, D)).astype(np.float32)
    model = OffloadedModel(fresh)
    for pred in (make_predictor("none"), make_predictor("oracle", oracle_ids=tr)):  # sync load, then prefetch
        with pytest.raises(ValueError, match=rf"layer 1, expert {e}: .* corrupt"):
            model.run_offloaded(x, OffloadConfig(0), pred, trace=tr)


def test_truncated_and_missing_store_files_name_layer_and_expert(cfg, stack):
    layers, store = stack
    p = store.path / "layer_0002.safetensors"
    p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2])
    with pytest.raises(ExpertStoreError, match=r"layer 2, expert 7: .*(unreadable|truncated)"):
        SafetensorsStore(store.path).load_expert(2, 7)
    p.unlink()
    with pytest.raises(ValueError, match=r"layer 2, expert 3: store file .*layer_0002.safetensors not found"):
        SafetensorsStore(store.path).load_expert(2, 3)
    with pytest.raises(ValueError, match=r"layer 0, expert 99: expert outside"):
        SafetensorsStore(store.path).load_expert(0, 99)


def test_missing_and_wrong_size_expert_tensors(cfg, rng, tmp_path):
    from safetensors.numpy import load_file, save_file

    layers = fresh_layers(cfg, rng)
    store = write_safetensors_store(tmp_path / "s", cfg, layers, kind="int8")
    p = store.path / "layer_0000.safetensors"
    from safetensors import safe_open

    meta = safe_open(str(p), "numpy").metadata()
    t = load_file(str(p))
    del t["experts.4.w_down.scales"]
    t["experts.6.w_gate.qdata"] = t["experts.6.w_gate.qdata"][:, :-2].copy()
    save_file(t, str(p), metadata=meta)
    s = SafetensorsStore(store.path)
    with pytest.raises(ValueError, match=r"layer 0, expert 4: tensor experts\.4\.w_down\.scales is missing"):
        s.load_expert(0, 4)
    with pytest.raises(ValueError, match=r"layer 0, expert 6: tensor experts\.6\.w_gate\.qdata .*wrong size"):
        s.load_expert(0, 6)
    # GGUF: a missing expert tensor, a wrong shape, non-finite scales
    g = write_gguf_store(tmp_path / "g.gguf", cfg, layers, qtype="Q8_0")
    del g._tensors["blk.1.ffn_up_exps.weight"]
    with pytest.raises(ValueError, match=r"layer 1, expert 2: tensor blk\.1\.ffn_up_exps\.weight is missing"):
        g.load_expert(1, 2)
    cfg_wrong = dataclasses.replace(cfg, expert_dim=2 * F)
    with pytest.raises(ValueError, match=r"layer 0, expert 5: tensor blk\.0\.ffn_gate_exps\.weight .*wrong size"):
        GGUFStore(tmp_path / "g.gguf", cfg_wrong).load_expert(0, 5)
    raw = bytearray((tmp_path / "g.gguf").read_bytes())
    t = {x.name: x for x in gguf.GGUFReader(str(tmp_path / "g.gguf")).tensors}["blk.2.ffn_down_exps.weight"]
    off = t.data_offset + 9 * (t.n_bytes // E)  # expert 9's first Q8_0 block: its f16 scale
    raw[off : off + 2] = np.float16(np.nan).tobytes()
    (tmp_path / "g2.gguf").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"layer 2, expert 9: .*non-finite"):
        GGUFStore(tmp_path / "g2.gguf").load_expert(2, 9)
    GGUFStore(tmp_path / "g2.gguf").load_expert(2, 8)


# ------------------------------------------------------------------ cache vs a tiny reference


class RefCache:
    """The spec of ExpertCache in a few lines of plain Python."""

    def __init__(self, budget, policy):
        self.budget, self.policy, self.tick = budget, policy, 0
        self.d = {}  # key -> [nbytes, freq, last]
        self.evicted = []

    def lookup(self, k):
        self.tick += 1
        if k not in self.d:
            return False
        self.d[k][1] += 1
        self.d[k][2] = self.tick
        return True

    def insert(self, k, nb, access, protect):
        self.tick += 1
        old = self.d.pop(k, None)
        used = sum(v[0] for v in self.d.values())
        free = sum(v[0] for kk, v in self.d.items() if kk not in protect)
        if nb > self.budget or (used + nb > self.budget and free < used + nb - self.budget):
            if old:
                self.d[k] = old
            return False
        while sum(v[0] for v in self.d.values()) + nb > self.budget:
            cands = [kk for kk in self.d if kk not in protect]
            order = {"lru": lambda kk: (self.d[kk][2], kk), "lfu": lambda kk: (self.d[kk][1], self.d[kk][2], kk)}
            v = min(cands, key=order[self.policy])
            del self.d[v]
            self.evicted.append(v)
        self.d[k] = [nb, (old[1] if old else 0) + int(access), self.tick]
        return True


ops = st.lists(
    st.tuples(
        st.sampled_from(["get", "put", "prefetch"]),
        st.integers(0, 9),
        st.integers(1, 5),
        st.lists(st.integers(0, 9), max_size=2),
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=40)
@given(ops=ops, budget=st.integers(0, 14), policy=st.sampled_from(["lru", "lfu"]))
def test_cache_eviction_order_matches_reference(ops, budget, policy):
    c, r = ExpertCache(budget, policy), RefCache(budget, policy)
    for op, k, nb, prot in ops:
        key = (0, k)
        protect = [(0, p) for p in prot]
        if op == "get":
            assert (c.lookup(key) is not None) == r.lookup(key)
        else:
            acc = op == "put"
            assert c.insert(key, f"v{k}", nb, access=acc, protect=protect) == r.insert(key, nb, acc, set(protect))
        assert c.used_bytes <= budget
        assert sorted(c.keys()) == sorted(r.d)
        assert c.evictions == r.evicted


def test_lru_and_lfu_pick_different_victims():
    lru, lfu = ExpertCache(30, "lru"), ExpertCache(30, "lfu")
    for c in (lru, lfu):
        for k in "abc":
            c.insert(k, k, 10)
        for _ in range(3):
            c.lookup("a")
        c.lookup("b")
        c.lookup("c")
        c.insert("d", "d", 10)
    assert lru.evictions == ["a"]  # least recently used
    assert lfu.evictions == ["b"]  # fewest uses (tie b/c broken by age)


def test_layered_cache_splits_budget_and_rejects_bad_options():
    c = make_cache(100, "lru", "per_layer", num_layers=4)
    assert c.insert((1, 0), "x", 25) and not c.insert((1, 1), "y", 26)
    assert c.insert((2, 0), "z", 25) and c.used_bytes == 50
    with pytest.raises(ValueError, match="scope"):
        make_cache(100, "lru", "everywhere")
    with pytest.raises(ValueError, match="policy"):
        ExpertCache(10, "fifo")
    with pytest.raises(ValueError, match="budget_bytes"):
        OffloadConfig(-1)


# ------------------------------------------------------------------ traces and predictors


def test_synthetic_trace_locality_is_tunable_and_roundtrips(tmp_path):
    lo = synthetic_trace(120, 3, 32, 4, locality=0.0, seed=1)
    hi = synthetic_trace(120, 3, 32, 4, locality=0.8, seed=1)
    for tr in (lo, hi):
        s = np.sort(tr, axis=-1)
        assert (s[..., 1:] != s[..., :-1]).all() and tr.min() >= 0 and tr.max() < 32
    # reuse by chance is about k / E = 0.125; locality p adds about p of the slots
    assert reuse_rate(lo) < 0.2 and 0.75 < reuse_rate(hi) < 0.95
    save_trace(tmp_path / "t.npy", hi)
    np.testing.assert_array_equal(load_trace(tmp_path / "t.npy", 3, 32, 4), hi)
    with pytest.raises(ValueError, match="top_k"):
        load_trace(tmp_path / "t.npy", 3, 32, 8)
    bad = hi.copy()
    bad[0, 0, 1] = bad[0, 0, 0]
    with pytest.raises(ValueError, match="repeats an expert"):
        save_trace(tmp_path / "b.npy", bad)
    with pytest.raises(ValueError, match="locality"):
        synthetic_trace(10, 2, 8, 2, locality=1.5)


def _recall(pred, ids):
    r = []
    for t in range(1, ids.shape[0]):
        for l in range(1, ids.shape[1]):
            p = pred.predict(PredictQuery(l, t, ids.shape[2], None, ids[t, l - 1], ids[t - 1, l]))
            r.append(len(set(p.tolist()) & set(ids[t, l].tolist())) / ids.shape[2])
    return float(np.mean(r))


def test_learned_predictor_learns_cross_layer_map_and_temporal_reuse():
    # layer_corr = 1: layer l's experts are a fixed permutation of layer l-1's: learnable exactly
    tr = synthetic_trace(300, 3, 16, 4, locality=0.0, layer_corr=1.0, seed=3)
    lp = train_learned(tr[:200], 16, steps=150)
    assert _recall(lp, tr[200:]) > 0.95
    assert _recall(make_predictor("prev_token"), tr[200:]) < 0.5
    # temporal locality only: the learned predictor does at least as well as reuse
    tr = synthetic_trace(300, 3, 16, 4, locality=0.7, seed=4)
    lp = train_learned(tr[:200], 16, steps=150)
    assert _recall(lp, tr[200:]) >= _recall(make_predictor("prev_token"), tr[200:]) - 0.03


def test_driver_replays_a_trace_and_reports_locality_benefit(cfg, stack, rng):
    layers, store = stack
    n = 12
    tr = synthetic_trace(n, L, E, K, locality=0.9, seed=int(rng.integers(100)))
    x = rng.standard_normal((n, D)).astype(np.float32)
    model = OffloadedModel(store)
    ref = model.run_resident(x, trace=tr)
    np.testing.assert_array_equal(ref.ids, tr)
    budget = L * K * store.expert_nbytes()
    out_p, sp = model.run_offloaded(
        x, OffloadConfig(budget, asynchronous=False), make_predictor("prev_token"), trace=tr
    )
    out_n, sn = model.run_offloaded(x, OffloadConfig(budget, asynchronous=False), make_predictor("none"), trace=tr)
    np.testing.assert_array_equal(out_p.outputs, ref.outputs)
    np.testing.assert_array_equal(out_n.outputs, ref.outputs)
    assert sp.to_dict()["recall"] > 0.8
    assert sp.to_dict()["hit_rate"] >= sn.to_dict()["hit_rate"]
    with pytest.raises(ValueError, match="trace has k="):
        model.run_resident(x, trace=tr[..., :2])


@pytest.mark.slow
def test_sweep_writes_results_and_plot(tmp_path):
    spec = {
        "kind": "offload",
        "name": "t",
        "model": {
            "preset": "qwen3.6-35b-a3b",
            "num_layers": L,
            "storage": "int8",  # = the `cfg` fixture
            "shrink": {"d_model": D, "expert_dim": F, "shared_expert_dim": 32, "num_experts": E, "top_k": K},
        },
        "tokens": 6,
        "train_tokens": 12,
        "learned": {"steps": 20},
        "budgets": [0.0, 0.5],
        "predictors": ["none", "learned"],
        "inputs": [{"kind": "random", "seed": 3}, {"kind": "trace", "locality": 0.7, "seed": 1}],
    }
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(spec))
    c = load_any(p)
    assert isinstance(c, OffloadSweepConfig) and c.learned.kwargs() == {"steps": 20}
    res = run_sweep(c, tmp_path / "out", log=lambda *a: None)
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert len(saved["configurations"]) == 2 * 2 * 2 and saved["all_identical"] and saved["gate"]["passed"]
    assert {r["input"] for r in saved["configurations"]} == {
        "random(seed=3)",
        "synthetic(locality=0.7, layer_corr=0.0, zipf=0.0)",
    }
    for r in saved["configurations"]:
        assert 0.0 <= r["hit_rate"] <= 1.0 and r["bytes_loaded_per_token"] > 0
        if r["budget_fraction"] == 0.0 and r["predictor"] == "none":
            assert r["hit_rate"] == 0.0
    assert (tmp_path / "out" / "offload.png").stat().st_size > 10_000 and res["plot"]
    saved_trace = load_trace(tmp_path / "out" / "input1_trace.safetensors", L, E, K)
    assert saved_trace.shape == (6, L, K)
    assert load_routing_trace(tmp_path / "out" / "input1_trace.safetensors").preset == "qwen3.6-35b-a3b"
    spec["budgets"] = [0.5, 2.0]
    p.write_text(yaml.safe_dump(spec))
    with pytest.raises(ConfigError, match=r"s\.yaml: key 'budgets\[1\]': must lie in \[0, 1\], got 2\.0"):
        load_any(p)
    spec["budgets"], spec["cache"] = [0.5], 1
    p.write_text(yaml.safe_dump(spec))
    with pytest.raises(ConfigError, match=r"s\.yaml: key 'cache': unknown key"):
        load_any(p)


def test_sweep_inputs_from_recorded_hidden_states_and_traces(cfg, rng, tmp_path):
    model = SimpleNamespace(cfg=cfg, num_layers=L)
    h = rng.standard_normal((20, D)).astype(np.float32)
    np.save(tmp_path / "h.npy", h)
    label, xtr, x, trtr, tr = prepare_input(SweepInput(kind="hidden", path=str(tmp_path / "h.npy")), model, 8, 100)
    assert label == "hidden:h.npy" and trtr is None and tr is None
    np.testing.assert_array_equal(np.concatenate([xtr, x]), h)  # train rows first, measured rows after
    ids = synthetic_trace(20, L, E, K, locality=0.5, seed=int(rng.integers(100)))
    save_trace(tmp_path / "t.npy", ids)
    label, xtr, x, trtr, tr = prepare_input(SweepInput(kind="trace", path=str(tmp_path / "t.npy")), model, 8, 100)
    assert label == "trace:t.npy" and x.shape == (8, D)
    np.testing.assert_array_equal(np.concatenate([trtr, tr]), ids)
    np.save(tmp_path / "bad.npy", h[:, :10])
    with pytest.raises(ValueError, match=r"hidden states must be float \[tokens, 64\]"):
        load_hidden(tmp_path / "bad.npy", D)


@pytest.mark.slow
def test_gguf_store_reads_a_file_written_by_jaxmoe_save_gguf(cfg, rng, tmp_path):
    from flax import nnx

    block = jaxmoe.MoEBlock(cfg, rngs=nnx.Rngs(int(rng.integers(1 << 20))))
    path = jaxmoe.save_gguf(block, tmp_path / "q.gguf", layer=2, dtype="q8_0")
    store = GGUFStore(path)  # config from the file's llama.cpp metadata (jaxmoe.io.gguf)
    assert store.blocks == [2] and store.num_layers == 1 and store.cfg.num_experts == E
    # the io loader's view of the same bytes, with the float activations the offload driver runs
    loaded = jaxmoe.from_pretrained(path, layer=2, ex=jaxmoe.ExecConfig())
    e = int(rng.integers(E))
    for name in ("w_gate", "w_up", "w_down"):
        ours = np.asarray(jaxmoe.quant.materialize(getattr(store.load_expert(0, e), name), np.float32))
        theirs = np.asarray(jaxmoe.quant.materialize(getattr(loaded.params().experts, name)[e], np.float32))
        np.testing.assert_array_equal(ours, theirs)
        ref = np.asarray(getattr(block.params().experts, name)[e])  # Q8_0 error of the original weights
        np.testing.assert_allclose(ours, ref, atol=np.abs(ref).max() / 100)
    x = rng.standard_normal((3, D)).astype(np.float32)
    model = OffloadedModel(store)
    ref = model.run_resident(x)
    xn = np.asarray(jaxmoe.offload.driver.rms_norm(x, np.ones(D, np.float32)))  # no ffn_norm in the file: ones
    np.testing.assert_allclose(ref.outputs, x + np.asarray(loaded(xn)), rtol=1e-5, atol=1e-5)
    out, _ = model.run_offloaded(
        x, OffloadConfig(0), make_predictor("next_router", resident=model.resident, router_cfg=store.cfg.router)
    )
    np.testing.assert_array_equal(out.outputs, ref.outputs)


def _kept_experts(ew, rng):
    """``ew``'s float experts as checkpoints hold them: w_gate MXFP4 and w_up Q4_0 (GGUF block
    bytes from gguf.quants.quantize), w_down block-scaled FP8 E4M3 (blocks of 16, random
    scales); with an independent float64 decode of each (gguf.quants / ml_dtypes)."""
    import ml_dtypes

    from jaxmoe.quant import fp8_block_tensor, gguf_block_tensor

    QT = gguf.GGMLQuantizationType
    kept, f64 = {}, {}
    for name, qt in (("w_gate", QT.MXFP4), ("w_up", QT.Q4_0)):
        wt = np.swapaxes(np.asarray(getattr(ew, name), np.float32), 1, 2)  # [E, out, in]
        raw = gguf.quants.quantize(wt, qt)
        kept[name] = gguf_block_tensor(raw, qt.name, wt.shape[-1])
        f64[name] = np.swapaxes(gguf.quants.dequantize(raw, qt).astype(np.float64), 1, 2)
    wt = np.swapaxes(np.asarray(ew.w_down, np.float32), 1, 2)  # [E, D, F]
    e, o, i = wt.shape
    scales = rng.uniform(0.5, 2.0, (e, o // 16, i // 16)).astype(np.float32) * np.abs(wt).max() / 448
    full = np.repeat(np.repeat(scales, 16, axis=1), 16, axis=2)
    codes = (wt / full).astype(ml_dtypes.float8_e4m3fn)
    kept["w_down"] = fp8_block_tensor(codes, scales, 16)
    f64["w_down"] = np.swapaxes(codes.astype(np.float64) * full, 1, 2)
    return dataclasses.replace(ew, **kept), f64


def test_keep_store_streams_checkpoint_kinds_in_their_bytes(cfg, rng, tmp_path):
    """``write_safetensors_store(kind="keep")``: experts held as MXFP4, Q4_0 block bytes and
    block-scaled FP8 are written part by part and read back byte for byte (FP8 codes stored
    as uint8 and viewed back), the streamed stack matches a float64 loop over an independent
    decode and the resident run bit for bit, and a flipped byte or a store.json that lies
    about a part's shape is a named error."""
    layers, f64 = [], []
    for res, ew in fresh_layers(cfg, rng):
        kept, dec = _kept_experts(ew, rng)
        layers.append((res, kept))
        f64.append(dec)
    store = write_safetensors_store(tmp_path / "keep", cfg, layers, kind="keep")
    assert store.kind == "keep"
    for l, e in ((0, 3), (2, 11)):
        got = store.load_expert(l, e)
        for name in ("w_gate", "w_up", "w_down"):
            w, want = getattr(got, name), getattr(layers[l][1], name)
            assert isinstance(w, jaxmoe.QuantizedTensor) and w.kind == want.kind and w.shape == want.shape[1:]
            assert w.qdata.dtype == want.qdata.dtype
            np.testing.assert_array_equal(np.asarray(w.qdata).view(np.uint8), np.asarray(want.qdata[e]).view(np.uint8))
            if want.scales is not None:
                np.testing.assert_array_equal(np.asarray(w.scales), np.asarray(want.scales[e]))
    x = rng.standard_normal((4, D)).astype(np.float32)
    model = OffloadedModel(store)
    ref = model.run_resident(x)
    want, _ = reference_stack(layers, x, cfg, dequant=lambda l, name: f64[l][name])
    np.testing.assert_allclose(ref.outputs, want, rtol=2e-5, atol=2e-5)
    out, _ = model.run_offloaded(x, OffloadConfig(2 * store.expert_nbytes(), "lru"), make_predictor("prev_token"))
    np.testing.assert_array_equal(out.outputs, ref.outputs)

    path = tmp_path / "keep" / "layer_0001.safetensors"
    blob = bytearray(path.read_bytes())
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as h:
        n = len(h.get_slice("experts.5.w_down.qdata")[:].tobytes())
    blob[-1 - n // 2 - 8] ^= 0x40  # somewhere in the last tensors' bytes
    path.write_bytes(bytes(blob))
    with pytest.raises(ExpertStoreError, match=r"layer 1, expert \d+: tensor experts\.\d+\.[\w.]+ in .* is corrupt"):
        s = SafetensorsStore(tmp_path / "keep")
        for e in range(E):
            s.load_expert(1, e)
    info = json.loads((tmp_path / "keep" / "store.json").read_text())
    info["projections"]["w_up"]["parts"]["qdata"][0][1] += 18
    (tmp_path / "keep" / "store.json").write_text(json.dumps(info))
    with pytest.raises(ExpertStoreError, match=r"layer 0, expert 2: tensor experts\.2\.w_up\.qdata .* has shape"):
        SafetensorsStore(tmp_path / "keep").load_expert(0, 2)
    with pytest.raises(ValueError, match="layer 1's experts .* differ from layer 0's"):
        bad = [layers[0], (layers[1][0], dataclasses.replace(layers[1][1], w_up=layers[1][1].w_gate))]
        write_safetensors_store(tmp_path / "bad", cfg, bad, kind="keep")
    with pytest.raises(ValueError, match=r"quantized 'mxfp4' but kind='int8' \(kind='keep'"):
        write_safetensors_store(tmp_path / "bad2", cfg, layers[:1], kind="int8")

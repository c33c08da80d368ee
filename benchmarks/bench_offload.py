"""Streaming experts from storage at the real expert size: load latency, hit rate, tokens/s.

    python benchmarks/bench_offload.py [--experts 64] [--layers 4] [--storage gguf:Q8_0]
        [--tokens 32] [--budgets 0,0.125,0.25,0.5,1] [--out bench_offload.json]

Builds a layer stack with Qwen3.6-35B-A3B's expert shape (d 2048, F 512, top-8, gated
shared expert of width 512) but ``--experts`` routed experts per layer (64 by default,
so four layers fit in under 1 GB of int8), seeded random weights generated one layer at
a time and written once to a temporary store (or ``--store PATH``). Then it measures:

1. the latency of one expert: store read (memory-mapped, page-cache hot: the file was
   just written, and the OS page cache is not dropped) and ``jax.device_put``;
2. the fully resident decode (``gather`` on the full stacks) in tokens/s;
3. streamed decodes over ``--budgets`` (fractions of all routed-expert bytes) with the
   ``none``, ``prev_token``, ``next_router`` and ``oracle`` predictors, on random inputs
   (no temporal locality) and on a synthetic routing trace of locality ``--locality``,
   each reporting hit rate, recall, MB loaded per token, seconds waiting on loads, and
   tokens/s; every streamed run is checked bit-identical to the resident run.

The input kind of every number is in its row (``random`` / ``synthetic(p)``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np

import jaxmoe
from jaxmoe.offload import (
    OffloadConfig,
    OffloadedModel,
    make_predictor,
    open_store,
    random_layers,
    synthetic_trace,
    write_gguf_store,
    write_safetensors_store,
)


def build(args, tmp: Path):
    if args.store:
        return open_store(args.store)
    cfg = jaxmoe.load_config("qwen3.6-35b-a3b")
    cfg = dataclasses.replace(
        cfg, num_layers=args.layers, router=dataclasses.replace(cfg.router, num_experts=args.experts)
    )
    t0 = time.perf_counter()

    class Lazy(Sequence):  # one layer of float32 weights in memory at a time
        def __len__(self):
            return args.layers

        def __getitem__(self, i):
            if not 0 <= i < args.layers:
                raise IndexError(i)
            return random_layers(cfg, 1, seed=100 + i)[0]

    layers = Lazy()
    if args.storage.startswith("gguf:"):
        st = write_gguf_store(tmp / "experts.gguf", cfg, layers, qtype=args.storage[5:])
    else:
        st = write_safetensors_store(tmp / "store", cfg, layers, kind=args.storage)
    print(f"wrote {args.layers} layers x {args.experts} experts ({args.storage}) in {time.perf_counter() - t0:.1f} s")
    return st


def load_latency(store, n: int = 32) -> dict:
    rng = np.random.default_rng(0)
    keys = [(int(rng.integers(store.num_layers)), int(rng.integers(store.cfg.num_experts))) for _ in range(n)]
    rd, put = [], []
    for k in keys:
        t0 = time.perf_counter()
        host = store.load_expert(*k)
        t1 = time.perf_counter()
        jax.block_until_ready(jax.device_put(host))
        t2 = time.perf_counter()
        rd.append(t1 - t0)
        put.append(t2 - t1)
    nb = store.expert_nbytes(0)
    return {
        "expert_bytes": nb,
        "read_ms_median": 1e3 * float(np.median(rd)),
        "device_put_ms_median": 1e3 * float(np.median(put)),
        "read_GB_per_s": nb / float(np.median(rd)) / 1e9,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--storage", default="int8", help="float32|float16|int8|int4 (safetensors) or gguf:<type>")
    ap.add_argument("--store", help="an existing store directory or .gguf instead of random weights")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--budgets", default="0,0.125,0.25,0.5,1")
    ap.add_argument("--predictors", default="none,prev_token,next_router,oracle")
    ap.add_argument("--locality", type=float, default=0.9)
    ap.add_argument("--policy", default="lru")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({jax.devices()[0].device_kind})")
    with tempfile.TemporaryDirectory() as td:
        store = build(args, Path(td))
        cfg = store.cfg
        lat = load_latency(store)
        print(
            f"one expert: {lat['expert_bytes'] / 1e6:.2f} MB, read {lat['read_ms_median']:.2f} ms "
            f"({lat['read_GB_per_s']:.2f} GB/s, page cache), device_put {lat['device_put_ms_median']:.2f} ms"
        )
        model = OffloadedModel(store, impl="gather")
        total = store.total_expert_bytes()
        rng = np.random.default_rng(1)
        x = rng.standard_normal((args.tokens, cfg.d_model)).astype(np.float32)
        inputs = [
            ("random", None),
            (
                f"synthetic(locality={args.locality})",
                synthetic_trace(
                    args.tokens, model.num_layers, cfg.num_experts, cfg.top_k, locality=args.locality, seed=2
                ),
            ),
        ]
        rows = []
        for label, tr in inputs:
            model.run_resident(x, trace=tr)  # compiles
            ref = model.run_resident(x, trace=tr)
            print(f"\n[{label}] resident: {ref.tokens_per_s:.1f} tok/s")
            print(
                f"{'budget':>7} {'predictor':>11} {'hit':>6} {'recall':>6} {'MB/tok':>7} {'wait s':>7} "
                f"{'tok/s':>7} identical"
            )
            for frac in [float(b) for b in args.budgets.split(",")]:
                for pname in args.predictors.split(","):
                    pred = make_predictor(pname, resident=model.resident, router_cfg=cfg.router, oracle_ids=ref.ids)
                    got, st = model.run_offloaded(x, OffloadConfig(int(frac * total), args.policy), pred, trace=tr)
                    d = st.to_dict()
                    same = bool(np.array_equal(got.outputs, ref.outputs))
                    rows.append(
                        {
                            "input": label,
                            "budget_fraction": frac,
                            "predictor": pname,
                            "identical": same,
                            "resident_tokens_per_s": ref.tokens_per_s,
                            **{k: v for k, v in d.items() if k != "per_layer"},
                        }
                    )
                    rc = d["recall"] if d["recall"] is not None else float("nan")
                    print(
                        f"{frac:7.3f} {pname:>11} {d['hit_rate']:6.3f} {rc:6.3f} "
                        f"{d['bytes_loaded_per_token'] / 1e6:7.2f} {d['wait_s']:7.3f} "
                        f"{d['tokens_per_s']:7.1f} {same}"
                    )
        res = {
            "device": str(jax.devices()[0]),
            "storage": store.kind,
            "layers": model.num_layers,
            "experts": cfg.num_experts,
            "top_k": cfg.top_k,
            "d_model": cfg.d_model,
            "expert_dim": cfg.expert_dim,
            "total_expert_bytes": total,
            "load": lat,
            "rows": rows,
        }
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1))
        ok = all(r["identical"] for r in rows)
        print(f"\nall streamed runs bit-identical to resident: {ok}")
        return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

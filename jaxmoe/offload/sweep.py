"""Offload sweep: cache budgets x policies x predictors x inputs -> results.json and a plot.

``python -m jaxmoe.offload.sweep configs/evals/offload.yaml [--out DIR] [--tokens N]``, or
``jaxmoe eval offload [--out DIR]`` (the eval CLI hands configs with ``runner:`` here).
Exit code 0 when every streamed run was bit-identical to the resident run, 1 if not, 2 on
a bad config.

The YAML (see ``configs/evals/offload.yaml``)::

    name: offload
    model:
      preset: qwen3.6-35b-a3b       # shrunk with `shrink`, `num_layers` layers, random weights
      num_layers: 4
      shrink: {d_model: 256, expert_dim: 128, shared_expert_dim: 128, num_experts: 64, top_k: 8}
      storage: int8                 # float32 | float16 | int8 | int4 (safetensors) | gguf:Q8_0 | gguf:Q4_0 ...
      store: null                   # an existing store directory or .gguf (then preset/shrink are unused)
      seed: 0
    impl: gather
    tokens: 48                      # decode tokens per configuration
    train_tokens: 192               # tokens that train the learned predictor (never the measured ones)
    inputs:                         # kinds: random | hidden (path: [N, d] .npy) | trace (synthetic or path:)
      - {kind: random, seed: 1}
      - {kind: trace, locality: 0.8, layer_corr: 0.1, zipf: 0.5, seed: 2}
    budgets: [0.0, 0.1, 0.25, 0.5, 1.0]   # fractions of all routed-expert bytes
    policies: [lru]
    scopes: [global]
    predictors: [none, prev_token, next_router, learned, oracle]
    prefetch_k: null
    learned: {steps: 400, hidden_dim: 0}   # train_learned options
    output_dir: runs/offload
    plots: true

Every configuration records which kind of input produced it (``input``: ``random``,
``hidden:<file>``, ``synthetic(locality=p, ...)``, ``trace:<file>``), the hit rate,
prediction recall, bytes loaded per token, time waiting on loads, tokens/s against the
fully resident run, and whether the outputs were bit-identical to it. The resident
run's routing (and, for hidden-state inputs, its hidden states) is saved as ``.npy``
next to ``results.json`` so it can be replayed or used to train a predictor.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from jaxmoe.offload.cache import POLICIES, SCOPES
from jaxmoe.offload.prerouter import PREDICTORS, make_predictor, train_learned
from jaxmoe.offload.store import STORE_KINDS, open_store, random_layers, write_gguf_store, write_safetensors_store
from jaxmoe.offload.traces import load_hidden, load_trace, reuse_rate, synthetic_trace

_TOP = {
    "runner",
    "name",
    "description",
    "model",
    "impl",
    "tokens",
    "train_tokens",
    "inputs",
    "budgets",
    "policies",
    "scopes",
    "predictors",
    "prefetch_k",
    "output_dir",
    "plots",
    "asynchronous",
    "learned",
}
_MODEL = {"preset", "num_layers", "shrink", "storage", "store", "seed"}
_SHRINK = {"d_model", "expert_dim", "shared_expert_dim", "num_experts", "top_k"}
_INPUT = {"kind", "seed", "path", "locality", "layer_corr", "zipf", "scale"}


def _fail(src: str, key: str, msg: str):
    raise ValueError(f"{src}: {key}: {msg}")


def load_sweep_config(path) -> dict[str, Any]:
    """Reads and checks a sweep YAML; unknown keys and bad values raise ValueError naming the key."""
    src = str(path)
    with open(path) as f:
        c = yaml.safe_load(f) or {}
    if not isinstance(c, dict):
        _fail(src, "<top>", "expected a mapping")
    for k in c:
        if k not in _TOP:
            _fail(src, k, f"unknown key; known: {sorted(_TOP)}")
    m = dict(c.get("model") or {})
    for k in m:
        if k not in _MODEL:
            _fail(src, f"model.{k}", f"unknown key; known: {sorted(_MODEL)}")
    for k in m.get("shrink") or {}:
        if k not in _SHRINK:
            _fail(src, f"model.shrink.{k}", f"unknown key; known: {sorted(_SHRINK)}")
    storage = m.setdefault("storage", "float32")
    if not (storage in STORE_KINDS or (isinstance(storage, str) and storage.startswith("gguf:"))):
        _fail(src, "model.storage", f"{storage!r}: expected one of {STORE_KINDS} or gguf:<F32|F16|Q8_0|Q4_0>")
    if not m.get("store") and not m.get("preset"):
        _fail(src, "model.preset", "a preset (random weights) or model.store (an existing store) is required")
    m.setdefault("num_layers", 4)
    m.setdefault("seed", 0)
    c["model"] = m
    c.setdefault("name", Path(path).stem)
    c.setdefault("impl", "gather")
    c.setdefault("tokens", 48)
    c.setdefault("train_tokens", 192)
    c.setdefault("budgets", [0.0, 0.1, 0.25, 0.5, 1.0])
    c.setdefault("policies", ["lru"])
    c.setdefault("scopes", ["global"])
    c.setdefault("predictors", ["none", "prev_token", "next_router", "learned", "oracle"])
    c.setdefault("prefetch_k", None)
    c.setdefault("output_dir", "runs/offload")
    c.setdefault("plots", True)
    c.setdefault("asynchronous", True)
    c["learned"] = dict(c.get("learned") or {})
    for k in c["learned"]:
        if k not in ("steps", "hidden_dim", "learning_rate", "weight_decay"):
            _fail(src, f"learned.{k}", "unknown key; known: steps, hidden_dim, learning_rate, weight_decay")
    c.setdefault("inputs", [{"kind": "random"}])
    for i, inp in enumerate(c["inputs"]):
        for k in inp:
            if k not in _INPUT:
                _fail(src, f"inputs[{i}].{k}", f"unknown key; known: {sorted(_INPUT)}")
        if inp.get("kind") not in ("random", "hidden", "trace"):
            _fail(src, f"inputs[{i}].kind", f"{inp.get('kind')!r}: expected random, hidden or trace")
        if inp["kind"] == "hidden" and not inp.get("path"):
            _fail(src, f"inputs[{i}].path", "is required with kind: hidden")
    for b in c["budgets"]:
        if not isinstance(b, (int, float)) or not 0 <= b <= 1:
            _fail(src, "budgets", f"{b!r}: each budget is a fraction of all routed-expert bytes in [0, 1]")
    for key, allowed in (("policies", POLICIES), ("scopes", SCOPES), ("predictors", PREDICTORS)):
        for v in c[key]:
            if v not in allowed:
                _fail(src, key, f"{v!r}: expected one of {allowed}")
    for key in ("tokens", "train_tokens"):
        if not isinstance(c[key], int) or c[key] < 2:
            _fail(src, key, f"must be an int >= 2, got {c[key]!r}")
    return c


def build_store(c: dict, out: Path):
    """Opens ``model.store`` or writes seeded random layers of the shrunk preset to ``out``."""
    import jaxmoe

    m = c["model"]
    if m.get("store"):
        return open_store(m["store"])
    cfg = jaxmoe.load_config(m["preset"])
    sh = dict(m.get("shrink") or {})
    rk = {k: sh.pop(k) for k in ("num_experts", "top_k") if k in sh}
    if rk:
        cfg = dataclasses.replace(cfg, router=dataclasses.replace(cfg.router, **rk))
    if cfg.router.n_group > 1 and cfg.num_experts % cfg.router.n_group:
        cfg = dataclasses.replace(cfg, router=dataclasses.replace(cfg.router, n_group=1, topk_group=1))
    cfg = dataclasses.replace(cfg, num_layers=m["num_layers"], dense_layers=(), **sh)
    layers = random_layers(cfg, m["num_layers"], seed=m["seed"])
    st = m["storage"]
    if st.startswith("gguf:"):
        return write_gguf_store(out / "experts.gguf", cfg, layers, qtype=st[5:])
    return write_safetensors_store(out / "store", cfg, layers, kind=st, group_size=32)


def _input_label(inp: dict) -> str:
    if inp["kind"] == "random":
        return f"random(seed={inp.get('seed', 0)})"
    if inp.get("path"):
        return f"{inp['kind']}:{Path(inp['path']).name}"
    return (
        f"synthetic(locality={inp.get('locality', 0.5)}, layer_corr={inp.get('layer_corr', 0.0)}, "
        f"zipf={inp.get('zipf', 0.0)})"
    )


def _prepare_input(inp: dict, model, n: int, n_train: int):
    """Returns (label, x_train, x_test, trace_train, trace_test) for one input spec."""
    cfg, L = model.cfg, model.num_layers
    rng = np.random.default_rng(inp.get("seed", 0))
    scale = float(inp.get("scale", 1.0))
    rand = lambda k: (scale * rng.standard_normal((k, cfg.d_model))).astype(np.float32)  # noqa: E731
    label = _input_label(inp)
    if inp["kind"] == "random":
        return label, rand(n_train), rand(n), None, None
    if inp["kind"] == "hidden":
        h = load_hidden(inp["path"], cfg.d_model)
        if h.shape[0] < n + 2:
            raise ValueError(f"inputs: {inp['path']} has {h.shape[0]} tokens, the sweep needs at least {n + 2}")
        k = min(n_train, h.shape[0] - n)
        return label, h[:k], h[k : k + n], None, None
    if inp.get("path"):
        tr = load_trace(inp["path"], L, cfg.num_experts, cfg.top_k)[:, :L]
        if tr.shape[0] < n + 2:
            raise ValueError(f"inputs: {inp['path']} has {tr.shape[0]} tokens, the sweep needs at least {n + 2}")
        k = min(n_train, tr.shape[0] - n)
        return label, rand(k), rand(n), tr[:k], tr[k : k + n]
    tr = synthetic_trace(
        n_train + n,
        L,
        cfg.num_experts,
        cfg.top_k,
        locality=float(inp.get("locality", 0.5)),
        layer_corr=float(inp.get("layer_corr", 0.0)),
        zipf=float(inp.get("zipf", 0.0)),
        seed=inp.get("seed", 0),
    )
    return label, rand(n_train), rand(n), tr[:n_train], tr[n_train:]


def run_sweep(c: dict, out: Path, log=print) -> dict:
    """Runs every configuration of the sweep config ``c``; writes ``results.json`` (and plots)."""
    from jaxmoe.offload.driver import OffloadConfig, OffloadedModel

    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    store = build_store(c, out)
    model = OffloadedModel(store, impl=c["impl"])
    cfg = model.cfg
    eb = store.expert_nbytes(0)
    total = store.total_expert_bytes()
    results: dict[str, Any] = {
        "name": c["name"],
        "description": c.get("description", ""),
        "config": c,
        "model": {
            "preset": c["model"].get("preset"),
            "store": str(store.path),
            "storage": store.kind,
            "num_layers": model.num_layers,
            "d_model": cfg.d_model,
            "expert_dim": cfg.expert_dim,
            "num_experts": cfg.num_experts,
            "top_k": cfg.top_k,
            "expert_bytes": eb,
            "total_expert_bytes": total,
            "impl": c["impl"],
        },
        "inputs": [],
        "configurations": [],
    }
    n, n_train = c["tokens"], c["train_tokens"]
    for ii, inp in enumerate(c["inputs"]):
        label, x_train, x, tr_train, tr = _prepare_input(inp, model, n, n_train)
        ref = model.run_resident(x, trace=tr)
        ref = model.run_resident(x, trace=tr)  # timed again after the first run's compiles
        np.save(out / f"input{ii}_trace.npy", ref.ids)
        if inp["kind"] != "trace":
            np.save(out / f"input{ii}_hidden.npy", ref.hidden[:, 0])
        learned = None
        if "learned" in c["predictors"]:
            if tr_train is not None:
                # replayed routes: the hidden states carry no routing signal, train on the ids
                learned = train_learned(tr_train, cfg.num_experts, **c["learned"])
            else:
                rtrain = model.run_resident(x_train)
                learned = train_learned(rtrain.ids, cfg.num_experts, rtrain.hidden, **c["learned"])
        info = {
            "input": label,
            "kind": inp["kind"],
            "tokens": n,
            "reuse_rate": reuse_rate(ref.ids),
            "resident_tokens_per_s": ref.tokens_per_s,
        }
        results["inputs"].append(info)
        log(f"[{label}] resident {ref.tokens_per_s:.1f} tok/s, reuse rate {info['reuse_rate']:.3f}")
        for frac in c["budgets"]:
            budget = int(round(frac * total))
            for policy in c["policies"]:
                for scope in c["scopes"]:
                    for pname in c["predictors"]:
                        pred = make_predictor(
                            pname, resident=model.resident, router_cfg=cfg.router, learned=learned, oracle_ids=ref.ids
                        )
                        ocfg = OffloadConfig(budget, policy, scope, c["prefetch_k"], c["asynchronous"])
                        got, st = model.run_offloaded(x, ocfg, pred, trace=tr)
                        d = st.to_dict()
                        row = {
                            "input": label,
                            "budget_fraction": frac,
                            "budget_experts": budget // eb,
                            "policy": policy,
                            "scope": scope,
                            "predictor": pname,
                            "identical_to_resident": bool(np.array_equal(got.outputs, ref.outputs)),
                            "resident_tokens_per_s": ref.tokens_per_s,
                            **d,
                        }
                        results["configurations"].append(row)
                        log(
                            f"  budget {frac:4.2f} {policy}/{scope} {pname:11s} hit {d['hit_rate']:.3f} "
                            f"recall {d['recall'] if d['recall'] is not None else float('nan'):.3f} "
                            f"{d['bytes_loaded_per_token'] / 1e3:9.1f} kB/tok wait {d['wait_s']:.3f}s "
                            f"{d['tokens_per_s']:.1f} tok/s identical={row['identical_to_resident']}"
                        )
    results["all_identical"] = all(r["identical_to_resident"] for r in results["configurations"])
    results["seconds"] = time.time() - t_start
    (out / "results.json").write_text(json.dumps(results, indent=1, default=float))
    if c["plots"]:
        results["plot"] = str(plot_results(results, out / "offload.png"))
    return results


def plot_results(results: dict, path: Path) -> Path:
    """Hit rate and tokens/s against budget, one line per predictor, one row per input."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["configurations"]
    inputs = [i["input"] for i in results["inputs"]]
    fig, axes = plt.subplots(len(inputs), 2, figsize=(11, 3.2 * len(inputs)), squeeze=False)
    for r, label in enumerate(inputs):
        sub = [x for x in rows if x["input"] == label]
        combos = sorted({(x["predictor"], x["policy"], x["scope"]) for x in sub})
        for combo in combos:
            pts = sorted(
                (x["budget_fraction"], x["hit_rate"], x["tokens_per_s"])
                for x in sub
                if (x["predictor"], x["policy"], x["scope"]) == combo
            )
            name = combo[0] if len(combos) == len({c[0] for c in combos}) else "/".join(combo)
            axes[r, 0].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
            axes[r, 1].plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=name)
        res_tps = next(i["resident_tokens_per_s"] for i in results["inputs"] if i["input"] == label)
        axes[r, 1].axhline(res_tps, color="k", ls="--", lw=1, label="resident")
        axes[r, 0].set_ylabel("hit rate")
        axes[r, 1].set_ylabel("tokens/s")
        axes[r, 0].set_title(label, fontsize=9)
        axes[r, 1].set_title(label, fontsize=9)
        for a in axes[r]:
            a.set_xlabel("cache budget (fraction of routed-expert bytes)")
            a.grid(alpha=0.3)
        axes[r, 1].legend(fontsize=7)
    m = results["model"]
    fig.suptitle(
        f"{results['name']}: {m['num_layers']} layers, E={m['num_experts']}, k={m['top_k']}, "
        f"{m['storage']} experts of {m['expert_bytes'] / 1e3:.1f} kB, impl {m['impl']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxmoe.offload.sweep", description=__doc__.split("\n")[0])
    ap.add_argument("config", help="sweep YAML (configs/evals/offload.yaml)")
    ap.add_argument("--out", help="output directory (default: <output_dir>/<name>)")
    ap.add_argument("--tokens", type=int, help="override tokens")
    args = ap.parse_args(argv)
    try:
        c = load_sweep_config(args.config)
    except (ValueError, OSError) as e:
        print(f"offload sweep: config error: {e}", file=sys.stderr)
        return 2
    if args.tokens:
        c["tokens"] = args.tokens
    out = Path(args.out) if args.out else Path(c["output_dir"]) / c["name"]
    res = run_sweep(c, out)
    print(
        f"wrote {out / 'results.json'} ({len(res['configurations'])} configurations, "
        f"all identical to resident: {res['all_identical']}, {res['seconds']:.0f} s)"
    )
    return 0 if res["all_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())

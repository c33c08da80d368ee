"""The expert-parallel evaluation run (``configs/evals/expert-parallel.yaml``).

``jaxmoe eval expert-parallel`` hands the file here (its ``runner:`` key), or run
``python -m jaxmoe.parallel_eval configs/evals/expert-parallel.yaml [--out DIR]``.

For every mesh (``{expert, data}``), token count, capacity factor and impl it runs
`jaxmoe.parallel.moe_apply_ep` and the single-device `jaxmoe.moe_apply` on the same
seeded weights and inputs and records: the max relative difference ``max|y_ep - y_1| /
max|y_1|`` (the gate: within ``tolerance`` whenever no pair was dropped), pairs dropped,
the capacity ``C``, all-to-all buffer bytes per token, and the median step time. It writes
``results.json`` and ``report.md`` to ``--out`` or ``<output_dir>/<name>-<UTC time>``.
Exit codes: 0 every case passed, 1 a case failed, 2 a bad config.

On CPU the meshes need forced host devices: this module asks JAX for
``max(expert * data)`` CPU devices (``jax_num_cpu_devices``) when the backend is not yet
up; otherwise set ``XLA_FLAGS=--xla_force_host_platform_device_count=8``. A mesh larger
than the devices present is recorded as skipped.

Schema (every key checked; unknown keys are errors naming the key)::

    runner: jaxmoe.parallel_eval
    name: expert-parallel
    description: ...
    model: {preset: qwen3.6-35b-a3b, shrink: {d_model, expert_dim, shared_expert_dim, num_experts, top_k}, seed: 0}
    inputs: {kind: random, seed: 0, scale: 1.0}
    impls: [auto]
    tokens: [16, 256]
    mesh: [{expert: 1, data: 1}, {expert: 2}, ...]
    capacity_factors: [null, 1.0]
    repeats: 3
    tolerance: 1.0e-5
    output_dir: runs
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time
from pathlib import Path

_TOP = {
    "runner",
    "name",
    "description",
    "model",
    "inputs",
    "impls",
    "tokens",
    "mesh",
    "capacity_factors",
    "repeats",
    "tolerance",
    "output_dir",
}
_MODEL = {"preset", "shrink", "seed"}
_SHRINK = {"d_model", "expert_dim", "shared_expert_dim", "num_experts", "top_k"}
_INPUTS = {"kind", "seed", "scale"}
_MESH = {"expert", "data"}


def _fail(src: str, key: str, msg: str):
    raise ValueError(f"{src}: key '{key}': {msg}")


def _keys(d, allowed, src, key):
    if not isinstance(d, dict):
        _fail(src, key, f"must be a mapping, got {type(d).__name__}")
    bad = sorted(set(d) - allowed)
    if bad:
        _fail(src, f"{key}.{bad[0]}" if key else bad[0], f"unknown key; known: {sorted(allowed)}")


def _pos_ints(v, src, key):
    if not isinstance(v, list) or not v or not all(isinstance(a, int) and not isinstance(a, bool) and a > 0 for a in v):
        _fail(src, key, f"must be a non-empty list of positive ints, got {v!r}")
    return [int(a) for a in v]


def load(path) -> dict:
    """The checked config as a plain dict (defaults filled in); ValueError names the key."""
    import yaml

    src = str(path)
    with open(path) as f:
        c = yaml.safe_load(f)
    _keys(c, _TOP, src, "")
    m = c.get("model") or {}
    _keys(m, _MODEL, src, "model")
    if not isinstance(m.get("preset"), str):
        _fail(src, "model.preset", f"must be a preset name, got {m.get('preset')!r}")
    shrink = m.get("shrink") or {}
    _keys(shrink, _SHRINK, src, "model.shrink")
    for k, v in shrink.items():
        if not (k == "shared_expert_dim" and v == 0):
            _pos_ints([v], src, f"model.shrink.{k}")
    inp = c.get("inputs") or {}
    _keys(inp, _INPUTS, src, "inputs")
    if inp.get("kind", "random") != "random":
        _fail(src, "inputs.kind", f"only 'random' is supported here, got {inp.get('kind')!r}")
    meshes = c.get("mesh")
    if not isinstance(meshes, list) or not meshes:
        _fail(src, "mesh", "must be a non-empty list of {expert: n, data: m}")
    out_mesh = []
    for i, ms in enumerate(meshes):
        _keys(ms, _MESH, src, f"mesh[{i}]")
        e, d = ms.get("expert"), ms.get("data", 1)
        _pos_ints([e, d], src, f"mesh[{i}]")
        out_mesh.append((e, d))
    cfs = c.get("capacity_factors", [None])
    if (
        not isinstance(cfs, list)
        or not cfs
        or not all(a is None or (isinstance(a, (int, float)) and not isinstance(a, bool) and a > 0) for a in cfs)
    ):
        _fail(src, "capacity_factors", f"must be a list of null or positive numbers, got {cfs!r}")
    impls = c.get("impls", ["auto"])
    if not isinstance(impls, list) or not impls or not all(isinstance(a, str) for a in impls):
        _fail(src, "impls", f"must be a non-empty list of impl names, got {impls!r}")
    tol = c.get("tolerance", 1e-5)
    if not isinstance(tol, (int, float)) or isinstance(tol, bool) or tol <= 0:
        _fail(src, "tolerance", f"must be a positive number, got {tol!r}")
    repeats = c.get("repeats", 3)
    _pos_ints([repeats], src, "repeats")
    return dict(
        name=c.get("name") or Path(path).stem,
        description=c.get("description", ""),
        preset=m["preset"],
        shrink=shrink,
        seed=int(m.get("seed", 0)),
        input_seed=int(inp.get("seed", 0)),
        scale=float(inp.get("scale", 1.0)),
        impls=impls,
        tokens=_pos_ints(c.get("tokens", [16]), src, "tokens"),
        mesh=out_mesh,
        capacity_factors=cfs,
        repeats=int(repeats),
        tolerance=float(tol),
        output_dir=c.get("output_dir", "runs"),
    )


def _ensure_cpu_devices(n: int) -> None:
    """Asks for ``n`` CPU devices if the JAX backend is not up yet (else keeps what is there)."""
    import jax

    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return
    try:
        if jax.config.jax_num_cpu_devices < n:
            jax.config.update("jax_num_cpu_devices", n)
    except Exception:  # backend already initialized: use the devices it has
        pass


def run(c: dict) -> dict:
    """Runs every case of the checked config ``c``; returns the results dict."""
    _ensure_cpu_devices(max(e * d for e, d in c["mesh"]))
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxmoe
    from jaxmoe import parallel

    base = jaxmoe.load_config(c["preset"])
    s = c["shrink"]
    router = dataclasses.replace(base.router, **{k: s[k] for k in ("num_experts", "top_k") if k in s})
    cfg = dataclasses.replace(
        base, router=router, **{k: s[k] for k in ("d_model", "expert_dim", "shared_expert_dim") if k in s}
    )
    params = jaxmoe.init_params(cfg, jax.random.key(c["seed"]))
    single = jax.jit(jaxmoe.moe_apply, static_argnames=("cfg", "impl"))
    ndev = len(jax.devices())
    cases = []
    for t in c["tokens"]:
        x = jax.random.normal(jax.random.key(c["input_seed"] + t), (t, cfg.d_model), jnp.float32) * c["scale"]
        for impl in c["impls"]:
            y1 = np.asarray(single(params, x, cfg=cfg, impl=impl))
            for e, d in c["mesh"]:
                for cf in c["capacity_factors"]:
                    case = dict(tokens=t, impl=impl, expert=e, data=d, capacity_factor=cf)
                    if e * d > ndev:
                        cases.append({**case, "status": "skipped", "reason": f"needs {e * d} devices, {ndev} present"})
                        continue
                    mesh = parallel.make_mesh(e, d)
                    ps = parallel.shard_params(params, mesh)
                    step = jax.jit(
                        lambda p, x, mesh=mesh, cf=cf, impl=impl: parallel.moe_apply_ep(
                            p, x, cfg, mesh, impl=impl, capacity_factor=cf, return_stats=True
                        )
                    )
                    y, st = step(ps, x)
                    ts = []
                    for _ in range(c["repeats"]):
                        t0 = time.perf_counter()
                        jax.block_until_ready(step(ps, x))
                        ts.append(time.perf_counter() - t0)
                    err = float(np.abs(np.asarray(y) - y1).max() / max(np.abs(y1).max(), 1e-30))
                    dropped = int(st.dropped_pairs)
                    rows = e * st.capacity  # per device, each direction
                    buf = e * d * rows * (cfg.d_model * x.dtype.itemsize + 8 + cfg.d_model * 4)
                    ok = dropped > 0 or err <= c["tolerance"]
                    ok = ok and (cf is not None or dropped == 0)
                    cases.append(
                        {
                            **case,
                            "status": "pass" if ok else "fail",
                            "max_rel_err": err,
                            "dropped_pairs": dropped,
                            "pairs": t * cfg.top_k,
                            "capacity": st.capacity,
                            "exchange": st.exchange,
                            "buffer_bytes_per_token": buf / t,
                            "step_ms": 1e3 * float(np.median(ts)),
                        }
                    )
    passed = all(k["status"] != "fail" for k in cases)
    return dict(
        name=c["name"],
        description=c["description"],
        config=c,
        model=cfg.to_dict(),
        platform=jax.devices()[0].platform,
        devices=ndev,
        cases=cases,
        gate=dict(passed=passed),
    )


def report_md(res: dict) -> str:
    lines = [
        f"# {res['name']}",
        "",
        res["description"],
        "",
        f"platform {res['platform']}, {res['devices']} devices, tolerance {res['config']['tolerance']:g} "
        "(max relative difference from the single-device layer, when no pair is dropped)",
        "",
        "| tokens | impl | expert x data | capacity factor | C | dropped / pairs | max rel err | "
        "buffer B/token | step ms | status |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for k in res["cases"]:
        if k["status"] == "skipped":
            lines.append(
                f"| {k['tokens']} | {k['impl']} | {k['expert']}x{k['data']} | {k['capacity_factor']} | "
                f"| | | | | skipped: {k['reason']} |"
            )
            continue
        lines.append(
            f"| {k['tokens']} | {k['impl']} | {k['expert']}x{k['data']} | {k['capacity_factor']} | "
            f"{k['capacity']} | {k['dropped_pairs']} / {k['pairs']} | {k['max_rel_err']:.2e} | "
            f"{k['buffer_bytes_per_token']:.0f} | {k['step_ms']:.2f} | {k['status']} |"
        )
    lines += ["", f"gate: {'passed' if res['gate']['passed'] else 'FAILED'}", ""]
    return "\n".join(lines)


def cli_main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m jaxmoe.parallel_eval",
        description="Expert-parallel eval: mesh sizes vs the single-device layer.",
    )
    ap.add_argument("config", help="configs/evals/expert-parallel.yaml")
    ap.add_argument("--out", help="output directory (default: <output_dir>/<name>-<UTC time>)")
    a = ap.parse_args(argv)
    try:
        c = load(a.config)
    except (ValueError, OSError) as e:
        print(f"jaxmoe eval: config error: {e}", file=sys.stderr)
        return 2
    res = run(c)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    out = Path(a.out) if a.out else Path(c["output_dir"]) / f"{c['name']}-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=2))
    (out / "report.md").write_text(report_md(res))
    print(report_md(res))
    print(f"wrote {out / 'results.json'}")
    return 0 if res["gate"]["passed"] else 1


main = cli_main

if __name__ == "__main__":
    raise SystemExit(cli_main())

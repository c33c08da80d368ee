"""Redundant experts on the mesh (jaxmoe.placement): device load balance and layer time.

Run (CPU, 8 forced host devices; the flag is set here if absent):

    python benchmarks/bench_eplb.py [--tokens 512] [--reps 5] [--json out.json]

Models: qwen3.6-35b-a3b and deepseek-v3 shrunk as ``jaxmoe eval expert-parallel`` does
(`jaxmoe.evaluation.presets.shrink_config`: d_model 256, expert width 128, shared 128,
64 experts; DeepSeek keeps its 8 groups, top-4 groups). Routings, each drawn twice (a
calibration batch whose per-expert pair counts feed the placement, and a fresh batch of
the same distribution that the placement is measured on):

- ``zipf1.0``, ``zipf1.2``: each token's top-k distinct experts sampled with probability
  ``1 / rank^s`` over a fixed random expert order (given as ``routing=``);
- ``bias``: the layer's own router with a fixed per-expert bias on its logits
  (``router_bias``, ``1.5 x`` the logits' standard deviation times N(0, 1)).

For each, on the mesh ``expert=8``: the static layout (expert ``e`` on device ``e //
(E/8)``), jaxmoe's `jaxmoe.placement.rebalance` and deepseek-ai/EPLB's own
``rebalance_experts`` (run from a fetched copy when torch imports, ``--eplb PATH``) with
``R = 0, E/8, E/4`` replicas. Columns: max / mean device load expected from the
calibration loads (``load[e] / replica_count[e]`` per slot), measured (pairs each device
computed, from `jaxmoe.parallel.EPStats`) on the calibration batch itself (what the
replica rule realizes of the expected spread) and on the fresh batch (what a placement
from past statistics gives), the median step time of the expert-parallel layer on the
fresh batch (all placements of one routing timed in interleaved rounds), and its max
relative difference from the one-device layer. The Zipf routings are given, so their
loads are the same for both models; only the bias routing and the times depend on the
model.
A second table compares the hierarchical form (2 nodes of 4 devices, 8 expert groups).

Host "devices" share the machine's cores, so the step time is the sum of the devices'
work, not the busiest device's; it shows that replicas cost no extra time, not the
speedup a real mesh would see (the max / mean load bounds that speedup).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import jaxmoe  # noqa: E402
from jaxmoe import parallel  # noqa: E402
from jaxmoe import placement as pm  # noqa: E402
from jaxmoe.evaluation.expert_parallel import zipf_routing  # noqa: E402
from jaxmoe.evaluation.presets import shrink_config  # noqa: E402

MODELS = ("qwen3.6-35b-a3b", "deepseek-v3")
SHRINK = dict(d_model=256, expert_dim=128, shared_expert_dim=128, num_experts=64)
DEVICES = 8
EPLB_DEFAULT = "/work/.mirror/deepseek-ai+EPLB/repo"


def load_eplb(path: str):
    """deepseek-ai/EPLB's ``rebalance_experts`` from a fetched copy (a git directory or a
    checkout holding eplb.py), or None when torch or the copy is missing."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return None
    src = Path(path)
    if (src / "eplb.py").exists():
        text = (src / "eplb.py").read_text()
    else:
        import subprocess

        try:
            text = subprocess.run(
                ["git", "-C", str(src), "show", "HEAD:eplb.py"], check=True, capture_output=True, text=True
            ).stdout
        except (OSError, subprocess.CalledProcessError):
            return None
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"jaxmoe-eplb-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "eplb.py").write_text(text)
    spec = importlib.util.spec_from_file_location("deepseek_eplb", tmp / "eplb.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.rebalance_experts


def eplb_placement(rebalance_experts, load, num_slots, num_devices, num_nodes=1, num_groups=1) -> pm.Placement:
    """EPLB's placement of ``load`` as a jaxmoe `Placement` (its physical -> logical map)."""
    import torch

    phy2log, _, _ = rebalance_experts(
        torch.tensor(np.asarray(load, np.float64)[None]), num_slots, num_groups, num_nodes, num_devices
    )
    return pm.Placement.from_phy2log(phy2log[0].numpy(), len(load), num_devices)


def interleaved(calls, reps: int) -> list[float]:
    """Median wall time in ms of each of ``calls`` (no arguments), timed in ``reps`` rounds
    that call each once in turn (after one warm-up round), so load changes hit all alike."""
    ts = [[] for _ in calls]
    for i in range(reps + 1):
        for f, t in zip(calls, ts):
            t0 = time.perf_counter()
            jax.block_until_ready(f())
            if i:
                t.append(time.perf_counter() - t0)
    return [1e3 * float(np.median(t)) for t in ts]


def batches(cfg, params, skew: str, tokens: int, seed: int):
    """(params, [(x, routing or None)] * 2): calibration and fresh batch of one skew."""
    rng = np.random.default_rng(seed)
    xs = [jnp.asarray(rng.standard_normal((tokens, cfg.d_model)), jnp.float32) for _ in range(2)]
    if skew.startswith("zipf"):
        s, order = float(skew[4:]), rng.permutation(cfg.num_experts)
        return params, [(x, zipf_routing(rng, tokens, cfg.num_experts, cfg.top_k, s, order)) for x in xs]
    z = np.asarray(xs[0] @ params.w_router)
    bias = 1.5 * z.std() * rng.standard_normal(cfg.num_experts)
    return dataclasses.replace(params, b_router=jnp.asarray(bias, jnp.float32)), [(x, None) for x in xs]


def max_over_mean(loads) -> float:
    loads = np.asarray(loads, np.float64)
    return float(loads.max() / loads.mean())


def run(tokens: int, reps: int, eplb_path: str, seed: int = 0) -> dict:
    rebalance_experts = load_eplb(eplb_path)
    mesh = parallel.make_mesh(DEVICES)
    rows, hier = [], []
    for name in MODELS:
        base = shrink_config(jaxmoe.load_config(name), **SHRINK)
        cfg = dataclasses.replace(base, router=dataclasses.replace(base.router, router_bias=True))
        e = cfg.num_experts
        params = jaxmoe.init_params(cfg, jax.random.key(seed))
        single = jax.jit(lambda p, x, r, cfg=cfg: jaxmoe.moe_apply(p, x, cfg, routing=r, return_routing=True))
        step = jax.jit(
            lambda ps, x, r, pl, cfg=cfg: parallel.moe_apply_ep(
                ps, x, cfg, mesh, routing=r, placement=pl, return_stats=True
            )
        )
        for skew in ("zipf1.0", "zipf1.2", "bias"):
            p, ((xc, rc), (xf, rf)) = batches(cfg, params, skew, tokens, seed)
            _, r_cal = single(p, xc, rc)
            y1, r_fresh = single(p, xf, rf)
            load = np.bincount(np.asarray(r_cal.expert_ids).reshape(-1), minlength=e).astype(np.float64)
            fresh = np.bincount(np.asarray(r_fresh.expert_ids).reshape(-1), minlength=e).astype(np.float64)
            cands: list[tuple[str, int, pm.Placement | None]] = [("static", 0, None)]
            for r in (0, e // 8, e // 4):
                cands.append(("jaxmoe", r, pm.rebalance(load, e + r, DEVICES)))
                if rebalance_experts is not None:
                    cands.append(("EPLB", r, eplb_placement(rebalance_experts, load, e + r, DEVICES)))
            runs = []
            for who, r, pl in cands:
                ps = p if pl is None else dataclasses.replace(p, experts=pm.physical_experts(p.experts, pl))
                ps = parallel.shard_params(ps, mesh)
                y, st = step(ps, xf, rf, pl)
                dev = np.asarray(st.expert_load).reshape(DEVICES, -1).sum(1)
                _, st_cal = step(ps, xc, rc, pl)
                dev_cal = np.asarray(st_cal.expert_load).reshape(DEVICES, -1).sum(1)
                if pl is None:
                    expect = load.reshape(DEVICES, -1).sum(1)
                else:
                    expect = pm.device_loads(load, pl)
                err = float(np.abs(np.asarray(y) - np.asarray(y1)).max() / np.abs(np.asarray(y1)).max())
                runs.append((ps, pl))
                rows.append(
                    dict(
                        model=name,
                        skew=skew,
                        placement=who,
                        replicas=r,
                        expected_max_over_mean=max_over_mean(expect),
                        calibration_max_over_mean=max_over_mean(dev_cal),
                        measured_max_over_mean=max_over_mean(dev),
                        measured_device_loads=dev.tolist(),
                        hottest_expert_over_mean_device=float(fresh.max() / (fresh.sum() / DEVICES)),
                        max_rel_err=err,
                    )
                )
            times = interleaved([functools.partial(step, ps, xf, rf, pl) for ps, pl in runs], reps)
            for row, t in zip(rows[-len(runs) :], times):
                row["step_ms"] = t
            for r in (0, e // 8, e // 4):
                h: dict[str, Any] = dict(model=name, skew=skew, replicas=r)
                h["jaxmoe"] = max_over_mean(
                    pm.device_loads(load, pm.rebalance(load, e + r, DEVICES, num_nodes=2, num_groups=8))
                )
                if rebalance_experts is not None:
                    h["EPLB"] = max_over_mean(
                        pm.device_loads(load, eplb_placement(rebalance_experts, load, e + r, DEVICES, 2, 8))
                    )
                hier.append(h)
    return dict(
        tokens=tokens,
        devices=DEVICES,
        shrink=SHRINK,
        eplb="deepseek-ai/EPLB rebalance_experts" if rebalance_experts is not None else None,
        rows=rows,
        hierarchical=hier,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--eplb", default=EPLB_DEFAULT, help="deepseek-ai/EPLB: a git directory or a checkout")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    res = run(args.tokens, args.reps, args.eplb)
    con = Console(width=160)
    if res["eplb"] is None:
        con.print("deepseek-ai/EPLB not run (torch or the fetched copy missing)")
    tab = Table(title=f"{res['tokens']} tokens, mesh expert={DEVICES}, E={SHRINK['num_experts']}: device load max/mean")
    for c in (
        "model",
        "skew",
        "placement",
        "R",
        "expected",
        "calibration",
        "fresh",
        "hottest/mean dev",
        "step ms",
        "rel err",
    ):
        tab.add_column(c, justify="left" if c in ("model", "skew", "placement") else "right")
    for r in res["rows"]:
        tab.add_row(
            r["model"],
            r["skew"],
            r["placement"],
            str(r["replicas"]),
            f"{r['expected_max_over_mean']:.3f}",
            f"{r['calibration_max_over_mean']:.3f}",
            f"{r['measured_max_over_mean']:.3f}",
            f"{r['hottest_expert_over_mean_device']:.2f}",
            f"{r['step_ms']:.1f}",
            f"{r['max_rel_err']:.1e}",
        )
    con.print(tab)
    tab = Table(title="hierarchical (2 nodes x 4 devices, 8 groups): expected max/mean device load")
    for c in ("model", "skew", "R", "jaxmoe", "EPLB"):
        tab.add_column(c, justify="left" if c in ("model", "skew") else "right")
    for h in res["hierarchical"]:
        tab.add_row(
            h["model"], h["skew"], str(h["replicas"]), f"{h['jaxmoe']:.3f}", f"{h.get('EPLB', float('nan')):.3f}"
        )
    con.print(tab)
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()

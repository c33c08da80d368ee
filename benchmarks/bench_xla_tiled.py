"""``xla_tiled`` (loop-free, for GPUs without Pallas) against today's ``xla`` on this CPU,
side by side in one run, plus kernel launches counted from each compiled program.

The routed experts of one layer (default: the Qwen3.6-35B-A3B shape, 256 experts top-8,
d 2048, width 512; ``--experts`` fewer for a quick run), random routing, fresh tokens
per call. Prints per T: ms of each (best of ``--repeats``, round robin), the ratio
tiled / xla (target <= 1.5), and launches per call from the XLA:CPU program
(`hlo_kernels.count_kernels`; a loop with a data-dependent trip count shows ``?``, its
launches grow with the touched experts; on a GPU backend the counts come from
benchmarks/intel_compile_check.py).

    python benchmarks/bench_xla_tiled.py --tokens 1,16,256 --dtype bf16
    python benchmarks/bench_xla_tiled.py --experts 32 --tokens 1,16 --repeats 2   # quick
    python benchmarks/bench_xla_tiled.py --tokens 1,16,256 --dtype f32 --keep-freed  # freed memory reused
    python benchmarks/bench_xla_tiled.py --tokens 64,256 --dtype f32 --keep-freed --layouts tiles
        # also each named layout of xla_tiled (jaxmoe.impls.xla_tiled.LAYOUTS), in the same run
    python benchmarks/bench_xla_tiled.py --tokens 1,16,32,64 --dtype f32 --keep-freed --floors
        # also two floors, timed in the same rounds: what any loop-free layout pays at least

``--floors`` times two programs that do part of a layout's memory traffic and none of its
arithmetic, as ratios to ``xla``:

- ``copy floor`` (only while ``P = T k <= E``): the weights of every (token, slot) pair's
  expert gathered (`ExpertWeights.take`, the three matrices, one copy per pair as the pairs
  layout makes), kept in memory (an optimization barrier) and read back once by a sum. A layout
  that copies the selected experts' weights pays at least this, less the few repeated
  experts (random routing at ``T = 16`` touches about 100 distinct of the 128 pairs).
- ``read floor``: every expert's weights read once by a float32 sum. A layout that reads
  all ``E`` experts in place (capacity) pays at least this.

``xla`` reads each touched expert once, in place, inside its loop; a formulation without
a loop over experts can only copy them or read them all, unless the backend fuses the
gather into the dot (XLA:CPU does not; docs/intel.md, "xla_tiled on the CPU").
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hlo_kernels import count_kernels  # noqa: E402
from interleave import interleaved_ms  # noqa: E402

import jaxmoe  # noqa: E402
from jaxmoe.execution import ExecConfig  # noqa: E402
from jaxmoe.impls.xla import experts_xla  # noqa: E402
from jaxmoe.impls.xla_tiled import LAYOUTS, experts_xla_tiled  # noqa: E402


def copy_floor(x: jax.Array, routing: jaxmoe.Routing, ew: jaxmoe.ExpertWeights, cfg) -> jax.Array:
    """The pairs' experts gathered as the pairs layout gathers them (`ExpertWeights.take`, one
    copy per pair), materialized, each array read back once."""
    copies = jax.lax.optimization_barrier(ew.take(routing.expert_ids.reshape(-1)))
    return sum(jnp.sum(c, dtype=jnp.float32) for c in jax.tree.leaves(copies))


def read_floor(x: jax.Array, routing: jaxmoe.Routing, ew: jaxmoe.ExpertWeights, cfg) -> jax.Array:
    """Every expert's weights read once (a float32 sum of each array)."""
    return sum(jnp.sum(w, dtype=jnp.float32) for w in jax.tree.leaves(ew))


FLOORS = {"copy floor": copy_floor, "read floor": read_floor}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3.6-35b-a3b")
    ap.add_argument("--tokens", default="1,16,256")
    ap.add_argument("--experts", type=int, default=None)
    ap.add_argument("--dtype", default="bf16", choices=["f32", "bf16"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layouts", default="", help=f"also xla_tiled with these layouts, comma separated: {LAYOUTS}")
    ap.add_argument("--floors", action="store_true", help="also the copy and read floors (module docstring)")
    ap.add_argument(
        "--keep-freed",
        action="store_true",
        help="jaxmoe.keep_freed_host_memory() first: XLA reuses freed result memory (README, Training)",
    )
    a = ap.parse_args(argv)
    if a.keep_freed and not jaxmoe.keep_freed_host_memory():
        print("--keep-freed: not glibc, nothing changed")
    layouts = [s for s in a.layouts.split(",") if s]
    if bad := [s for s in layouts if s not in LAYOUTS]:
        ap.error(f"--layouts: unknown {bad}, choose from {LAYOUTS}")
    impls = {"xla": experts_xla, "xla_tiled": experts_xla_tiled}
    for lay in layouts:
        impls[f"xla_tiled[{lay}]"] = functools.partial(experts_xla_tiled, ex=ExecConfig(layout=lay))
    cfg = jaxmoe.load_config(a.preset)
    if a.experts:
        cfg = dataclasses.replace(cfg, router=dataclasses.replace(cfg.router, num_experts=a.experts))
    dt = jnp.bfloat16 if a.dtype == "bf16" else jnp.float32
    e, d, f, k = cfg.num_experts, cfg.d_model, cfg.expert_dim, cfg.top_k
    rng = np.random.default_rng(0)
    ew = jaxmoe.ExpertWeights(
        *(jnp.asarray(rng.standard_normal(s, np.float32) / 16, dt) for s in ((e, d, f), (e, d, f), (e, f, d)))
    )
    print(f"{a.preset}: E={e} k={k} d={d} F={f} {a.dtype}, backend {jax.default_backend()}")
    tiled = [n for n in impls if n != "xla"]
    floors = FLOORS if a.floors else {}
    head = ["T", "xla ms", *(c for n in [*tiled, *floors] for c in (f"{n} ms", f"{n}/xla")), "xla launches"]
    head += [f"{n} launches" for n in tiled]
    print("| " + " | ".join(head) + " |")
    print("|---" * len(head) + "|")
    for t in (int(s) for s in a.tokens.split(",")):

        def inputs(t=t):
            x = jnp.asarray(rng.standard_normal((t, d), np.float32), dt)
            ids = np.stack([rng.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32)
            w = rng.uniform(0.1, 1, (t, k)).astype(np.float32)
            return x, jaxmoe.Routing(jnp.asarray(ids), jnp.asarray(w))

        # past E pairs a copy of all P would outgrow the read floor many times over (GBs)
        now = {n: fn for n, fn in floors.items() if n != "copy floor" or t * k <= e}
        # the weights are an argument (a closure would make them a 3 GB compile-time constant)
        fns = {n: jax.jit(lambda x, r, w, fn=fn: fn(x, r, w, cfg)) for n, fn in {**impls, **now}.items()}
        x0, r0 = inputs()
        launches, outs = {}, {}
        for n in impls:
            fn = fns[n]
            launches[n] = count_kernels(fn.lower(x0, r0, ew).compile().as_text() or "").row()
            outs[n] = np.asarray(fn(x0, r0, ew), np.float32)
        scale = float(np.abs(outs["xla"]).max())
        for n in tiled:
            err = float(np.abs(outs["xla"] - outs[n]).max())
            if err > 1e-2 * max(scale, 1.0):
                print(f"T={t}: {n} differs from xla by {err} (scale {scale})", file=sys.stderr)
                return 1
        # new tokens and routing for every call (one input shared by both left its experts hot
        # in the caches for the second call of a repeat, before 1 Dec 2026 22:00 UTC)
        ms = interleaved_ms({n: (lambda x, r, f=f: f(x, r, ew)) for n, f in fns.items()}, inputs, a.repeats)
        best = {n: min(v) / 1e3 for n, v in ms.items()}

        def fmt(row):
            return f"{row['launches'] if row['launches'] is not None else '?'} (top {row['kernels_top']}, loops {row['loops'] or '-'})"

        cells = [
            f"{best[n] * 1e3:.1f} | {best[n] / best['xla']:.2f}" if n in best else "- | -" for n in [*tiled, *floors]
        ]
        counts = [fmt(launches[n]) for n in ["xla", *tiled]]
        print(f"| {t} | {best['xla'] * 1e3:.1f} | " + " | ".join(cells + counts) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

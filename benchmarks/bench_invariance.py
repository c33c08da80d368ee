"""What batch invariance costs (`jaxmoe.invariance`): one full MoE layer with
``ExecConfig(batch_invariant=True)`` against ``False``, per strategy, side by side in one run.

The Qwen3.6-35B-A3B layer (router, 256 experts top-8 of width 512, gated shared expert,
d 2048; ``--experts`` fewer for a quick run) in float32 or bfloat16, T in ``--tokens``.
Every timed call gets new tokens (cold: other experts, read from DRAM as in decode);
within a repeat each (strategy, mode) runs once in a rotating order, so load from other
processes hits them alike. Prints the best ms of each mode and the ratio invariant /
fast (the cost; 1.00 = free), and checks before timing that the two modes agree within
float32 rounding.

    python benchmarks/bench_invariance.py                          # cpu, xla at T in {1, 8, 64, 256}
    python benchmarks/bench_invariance.py --impls cpu,xla,gather --tokens 1,8 --repeats 5
    python benchmarks/bench_invariance.py --experts 32 --tokens 1,16 --repeats 2   # quick
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxmoe
from jaxmoe.execution import ExecConfig


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3.6-35b-a3b")
    ap.add_argument("--tokens", default="1,8,64,256")
    ap.add_argument("--impls", default="cpu,xla")
    ap.add_argument("--experts", type=int, default=None)
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args(argv)
    cfg = jaxmoe.load_config(a.preset)
    if a.experts:
        cfg = dataclasses.replace(cfg, router=dataclasses.replace(cfg.router, num_experts=a.experts))
    dt = jnp.bfloat16 if a.dtype == "bf16" else jnp.float32
    p = jaxmoe.init_params(cfg, jax.random.key(0), dtype=dt)
    modes = {
        "fast": False,
        "invariant": True,
    }
    impls = a.impls.split(",")
    rng = np.random.default_rng(0)
    print(
        f"{a.preset}: E={cfg.num_experts} k={cfg.top_k} d={cfg.d_model} F={cfg.expert_dim} {a.dtype}, cold, best of {a.repeats}"
    )
    print("| impl | T | fast ms | invariant ms | invariant / fast |")
    print("|---|---|---|---|---|")
    for t in (int(s) for s in a.tokens.split(",")):

        def fresh(t=t):
            return jnp.asarray(rng.standard_normal((t, cfg.d_model), np.float32), dt)

        fns = {
            (impl, m): jax.jit(
                lambda p, x, ex=ExecConfig(impl=impl, batch_invariant=inv): jaxmoe.moe_apply(p, x, cfg, ex)
            )
            for impl in impls
            for m, inv in modes.items()
        }
        x0 = fresh()
        for impl in impls:
            ya, yb = (np.asarray(fns[(impl, m)](p, x0), np.float32) for m in modes)
            scale = float(np.abs(ya).max())
            if float(np.abs(ya - yb).max()) > 1e-2 * max(scale, 1e-6):
                print(f"{impl} T={t}: invariant and fast outputs differ beyond rounding")
                return 1
        best = dict.fromkeys(fns, float("inf"))
        keys = list(fns)
        for i in range(a.repeats):
            for key in keys[i % len(keys) :] + keys[: i % len(keys)]:
                x = fresh()
                t0 = time.perf_counter()
                fns[key](p, x).block_until_ready()
                best[key] = min(best[key], time.perf_counter() - t0)
        for impl in impls:
            f_ms, i_ms = best[(impl, "fast")] * 1e3, best[(impl, "invariant")] * 1e3
            print(f"| {impl} | {t} | {f_ms:.2f} | {i_ms:.2f} | {i_ms / f_ms:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What routing statistics cost (`jaxmoe.stats`): one full MoE layer with and without the
per-expert token counts, side by side in one run.

The Qwen3.6-35B-A3B layer (router, 256 experts top-8 of width 512, gated shared expert,
d 2048; ``--experts`` fewer for a quick run), ``impl="auto"``, T in ``--tokens``. Two pairs:

- ``fn``: ``jax.jit(moe_apply)`` against the same layer that also returns
  ``stats + expert_counts(routing, E)`` (the caller's pure accumulation, in one program);
- ``block``: an eager ``MoEBlock`` call against ``MoEBlock(track_load=True)`` (the
  counter updated inside the block's jitted call).

Every timed call gets new tokens (cold: other experts, read from DRAM as in decode); each
repeat runs every variant once in a rotating order (`interleave.interleaved_ms`). Prints
best and median ms of each variant, the ratio with / without statistics (1.00 = free),
the median of the per-repeat differences with - without (the two calls of a repeat share
the machine's load, so this is the steadiest figure on a busy machine) as a fraction of
the median without, and the time of ``expert_counts`` alone. Before timing it checks that the outputs are the
same bits and the counts equal numpy's.

    python benchmarks/bench_stats.py                                  # T in {1, 256}, 40 repeats
    python benchmarks/bench_stats.py --experts 32 --repeats 5         # quick
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from interleave import interleaved_ms  # noqa: E402

import jaxmoe  # noqa: E402
from jaxmoe.stats import expert_counts  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3.6-35b-a3b")
    ap.add_argument("--tokens", default="1,256")
    ap.add_argument("--experts", type=int, default=None)
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    ap.add_argument("--repeats", type=int, default=40)
    a = ap.parse_args(argv)
    cfg = jaxmoe.load_config(a.preset)
    if a.experts:
        cfg = dataclasses.replace(cfg, router=dataclasses.replace(cfg.router, num_experts=a.experts))
    e = cfg.num_experts
    dt = jnp.bfloat16 if a.dtype == "bf16" else jnp.float32
    p = jaxmoe.init_params(cfg, jax.random.key(0), dtype=dt)
    rng = np.random.default_rng(0)

    plain = jax.jit(lambda p, x: jaxmoe.moe_apply(p, x, cfg))

    @jax.jit
    def counted(p, x, stats):
        y, r = jaxmoe.moe_apply(p, x, cfg, return_routing=True)
        return y, stats + expert_counts(r, e)

    stats = jnp.zeros((e,), jnp.int32)
    block = jaxmoe.MoEBlock(cfg, params=p, dtype=dt)
    tracked = jaxmoe.MoEBlock(cfg, params=p, dtype=dt, track_load=True)
    count_alone = jax.jit(lambda ids: expert_counts(ids, e))
    print(
        f"{a.preset}: E={e} k={cfg.top_k} d={cfg.d_model} F={cfg.expert_dim} {a.dtype}, impl auto "
        f"({jaxmoe.resolve_impl('auto', cfg.top_k, experts=p.experts, dtype=dt)} at T=1), cold, {a.repeats} repeats"
    )
    print(
        "| T | pair | without: best / median ms | with: best / median ms | with / without (best, median) "
        "| median paired difference |"
    )
    print("|---|---|---|---|---|---|")
    counts_us = {}
    for t in (int(s) for s in a.tokens.split(",")):

        def fresh(t=t):
            return (jnp.asarray(rng.standard_normal((t, cfg.d_model), np.float32), dt),)

        (x0,) = fresh()
        y0, r0 = jaxmoe.moe_apply(p, x0, cfg, return_routing=True)
        y1, s1 = counted(p, x0, stats)
        want = np.bincount(np.asarray(r0.expert_ids).reshape(-1), minlength=e)
        if not np.array_equal(np.asarray(plain(p, x0)), np.asarray(y1)) or not np.array_equal(np.asarray(s1), want):
            print(f"T={t}: the counted layer differs from the plain one, or its counts from numpy's")
            return 1
        tracked.reset_expert_load()
        if not np.array_equal(np.asarray(tracked(x0)), np.asarray(block(x0))):
            print(f"T={t}: MoEBlock(track_load=True) output differs")
            return 1
        assert tracked.expert_load is not None
        if not np.array_equal(np.asarray(tracked.expert_load.get_value()), want):
            print(f"T={t}: MoEBlock(track_load=True) counts differ from numpy's")
            return 1
        fns = {
            "fn": lambda x: plain(p, x),
            "fn+stats": lambda x: counted(p, x, stats),
            "block": lambda x: block(x),
            "block+track_load": lambda x: tracked(x),
        }
        ms = interleaved_ms(fns, fresh, a.repeats)
        for pair, (off, on) in {"fn": ("fn", "fn+stats"), "block": ("block", "block+track_load")}.items():
            b0, b1 = min(ms[off]), min(ms[on])
            m0, m1 = float(np.median(ms[off])), float(np.median(ms[on]))
            diff = float(np.median(np.asarray(ms[on]) - np.asarray(ms[off])))
            print(
                f"| {t} | {pair} | {b0:.3f} / {m0:.3f} | {b1:.3f} / {m1:.3f} | {b1 / b0:.3f}, {m1 / m0:.3f} "
                f"| {diff * 1e3:+.0f} us ({diff / m0:+.2%}) |"
            )
        ids = r0.expert_ids
        jax.block_until_ready(count_alone(ids))
        best = float("inf")
        for _ in range(200):
            t0 = time.perf_counter()
            jax.block_until_ready(count_alone(ids))
            best = min(best, time.perf_counter() - t0)
        counts_us[t] = best * 1e6
    print()
    for t, us in counts_us.items():
        print(f"expert_counts alone (jitted call, dispatch included) at T={t}: {us:.1f} us best of 200")
    return 0


if __name__ == "__main__":
    sys.exit(main())

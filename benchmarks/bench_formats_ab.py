"""Two expert formats of the same layer against each other, alternating in one process: the
whole Qwen3.6-35B-A3B layer (``moe_apply``, every routed expert and the shared expert in the
format, as `bench_block.expert_weights` makes them), one `ExecConfig`, new tokens every
call (`interleave.interleaved_ms`). Prints best / median ms of each and A / B (> 1: B is
faster).

    python benchmarks/bench_formats_ab.py --a q4_0_int4 --b q4_0 --impl cpu --activations ggml --tokens 1,8,64
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_block  # noqa: E402
from interleave import ab_cells, interleaved_ms  # noqa: E402

import jaxmoe  # noqa: E402
from jaxmoe.execution import ExecConfig  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", default="q4_0_int4", help="format A (bench_block.py's --dtype names)")
    ap.add_argument("--b", default="q4_0", help="format B")
    ap.add_argument("--impl", default="cpu")
    ap.add_argument("--activations", choices=["float", "int8", "ggml"], default="ggml")
    ap.add_argument("--tokens", default="1,8,64")
    ap.add_argument("--repeats", type=int, default=15)
    a = ap.parse_args(argv)
    for f in (a.a, a.b):
        if f not in bench_block.DTYPES:
            ap.error(f"unknown format {f!r}; choose from {','.join(bench_block.DTYPES)}")
    cfg = jaxmoe.load_config("qwen3.6-35b-a3b")
    p0 = jaxmoe.init_params(cfg, jax.random.key(0))
    ws = {f: bench_block.expert_weights(p0, f, jax.random.key(1)) for f in (a.a, a.b)}
    del p0
    ex = ExecConfig(impl=a.impl, activations=a.activations)
    rng = np.random.default_rng(0)
    new_x = lambda t: (jnp.asarray(rng.standard_normal((t, cfg.d_model), np.float32)),)  # noqa: E731
    print(f"E={cfg.num_experts}, impl={a.impl}, {a.activations} activations, new tokens every call, A B alternating")
    print(f"| T | {a.a} (A) best / median ms | {a.b} (B) best / median ms | A / B (best, median) |")
    print("|---|---|---|---|")
    for t in (int(s) for s in a.tokens.split(",")):
        fns = {}
        for f, p in ws.items():
            fn = jax.jit(lambda p, x: jaxmoe.moe_apply(p, x, cfg, ex))
            jax.block_until_ready(fn(p, *new_x(t)))
            fns[f] = functools.partial(fn, p)
        ms = interleaved_ms(fns, functools.partial(new_x, t), a.repeats)
        print(f"| {t} | {ab_cells(ms[a.a], ms[a.b])} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

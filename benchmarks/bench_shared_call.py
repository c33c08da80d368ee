"""The shared expert in the routed experts' kernel call against a second call of its own.

``moe_apply(..., impl="cpu")`` on the CPU runs a layer's routed experts and its shared
expert (when the kernel takes it: quantized or bfloat16-stored, or batch invariance on)
in one C++ custom call (`jaxmoe.impls.cpu.experts_shared_cpu`). Before 4 Dec 2026 the
shared expert was a second call (`jaxmoe.impls.cpu.shared_expert_cpu`, its gate in an
XLA row-block loop). Both are timed here on the Qwen3.6 layer in one run, interleaved,
new tokens every call (``interleave.interleaved_ms``), router and combine included:

- ``one call``: ``moe_apply(p, x, cfg, impl="cpu")``;
- ``two calls``: the router, ``experts_cpu`` and then ``shared_expert_cpu`` (the layer as
  it was).

    python benchmarks/bench_shared_call.py --dtype q4_k,q4_k_m,q8_0,bf16 --tokens 1,8,64 --repeats 31

Prints best / median ms of each and their ratio (> 1: one call faster) as a Markdown table.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxmoe
from jaxmoe.impls.cpu import experts_cpu, shared_expert_cpu
from jaxmoe.layer import compute_routing

sys.path.insert(0, os.path.dirname(__file__))
from bench_block import expert_weights  # noqa: E402
from interleave import interleaved_ms  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="q4_k,q4_k_m,q8_0,bf16", help="comma list, as bench_block.py --dtype")
    ap.add_argument("--tokens", default="1,8,64")
    ap.add_argument("--repeats", type=int, default=31)
    a = ap.parse_args(argv)
    cfg = jaxmoe.load_config("qwen3.6-35b-a3b")
    p32 = jaxmoe.init_params(cfg, jax.random.key(0))
    print(f"jax {jax.__version__}; Qwen3.6 layer; {a.repeats} calls each, new tokens every call")
    print("| experts | T | one call best / median ms | two calls best / median ms | two / one (best, median) |")
    print("|---|---|---|---|---|")
    for fmt in a.dtype.split(","):
        p = expert_weights(p32, fmt, jax.random.key(1))

        def two_calls(p, x):
            routing = compute_routing(p, x, cfg)
            return experts_cpu(x, routing, p.experts, cfg) + shared_expert_cpu(x, p.shared, cfg)

        fns = {
            "one": jax.jit(lambda p, x: jaxmoe.moe_apply(p, x, cfg, impl="cpu")),
            "two": jax.jit(two_calls),
        }
        for t in (int(v) for v in a.tokens.split(",")):
            key = iter(jax.random.split(jax.random.key(7 + t), 2 * a.repeats + 2))
            x0 = jax.random.normal(next(key), (t, cfg.d_model))
            y1, y2 = (np.asarray(f(p, x0)) for f in fns.values())
            err = float(np.abs(y1 - y2).max() / np.abs(y2).max())
            if err > 1e-4:
                print(f"{fmt} T={t}: the two forms disagree ({err:.2e} of the largest output)", file=sys.stderr)
                return 1
            ms = interleaved_ms(
                {n: functools.partial(f, p) for n, f in fns.items()},
                functools.partial(_new_tokens, key, t, cfg.d_model),
                a.repeats,
            )
            print(f"| {fmt} | {t} | {_cells(ms)} |", flush=True)
    return 0


def _new_tokens(keys, t: int, d: int) -> tuple[jax.Array]:
    return (jax.random.normal(next(keys), (t, d), jnp.float32),)


def _cells(ms) -> str:
    """one call's cells, then two calls', then two / one."""
    one, two = ms["one"], ms["two"]
    return (
        f"{min(one):.2f} / {np.median(one):.2f} | {min(two):.2f} / {np.median(two):.2f} | "
        f"{min(two) / min(one):.2f}, {np.median(two) / np.median(one):.2f}"
    )


if __name__ == "__main__":
    sys.exit(main())

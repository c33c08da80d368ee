"""The ``cpu`` backward with and without the forward's gate/up residual, side by side in
one process (issue 13): a training step through one Qwen3.6-35B-A3B routed-expert layer
(router + 256 experts of width 512, top-8, d 2048, float32), jitted
``jax.value_and_grad`` of ``<experts(x, route(x)), ct>`` w.r.t. the experts, the router and
``x``, new tokens every call, the two variants interleaved (order alternating per repeat).

- ``saved``: what ``impl="cpu"`` runs: the forward returns each pair's gate | up products
  (``[T k, 2F]`` float32) and the backward reads them;
- ``recompute``: the same custom call with no residual: the backward recomputes gate / up
  (two more matmul-sized products; what ``impl="cpu"`` did before 1 Dec 2026, 18:00 UTC).

Prints best and median ms per T and the ratio recompute / saved (> 1: saving is faster).

    python benchmarks/bench_backward_residual.py --tokens 64,256,1024 --repeats 8
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from interleave import ab_cells, interleaved_ms  # noqa: E402

import jaxmoe  # noqa: E402
from jaxmoe.impls.cpu import kernel
from jaxmoe.impls.cpu.backward import cpu_vjp
from jaxmoe.routing import route, router_logits


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="64,256,1024")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--experts", type=int, default=None, help="override the number of experts (default 256)")
    a = ap.parse_args(argv)
    cfg = jaxmoe.load_config("qwen3.6-35b-a3b")
    if a.experts:
        cfg = dataclasses.replace(cfg, router=dataclasses.replace(cfg.router, num_experts=a.experts))
    ok, msg = kernel.cpu_kernel_status()
    if not ok:
        raise SystemExit(f"the C++ kernel did not build: {msg}")
    p = jaxmoe.init_params(cfg, jax.random.key(0))

    @functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
    def recompute(x, r, ew, cfg):  # the same forward, no residual: cpu_vjp recomputes gate / up
        return kernel.experts_cpu(x, r, ew, cfg)

    recompute.defvjp(lambda x, r, ew, cfg: (kernel.experts_cpu(x, r, ew, cfg), (x, r, ew)), cpu_vjp)
    variants = {"saved": kernel.experts_cpu, "recompute": recompute}

    def step(fn):
        def loss(ew, w_router, x, ct):
            r = route(router_logits(x, w_router), cfg.router)
            return jnp.vdot(fn(x, r, ew, cfg), ct)

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

    steps = {n: step(fn) for n, fn in variants.items()}
    print(f"jax {jax.__version__}; E={cfg.num_experts} d={cfg.d_model} F={cfg.expert_dim} k={cfg.top_k}; float32")
    print("| T | recompute best / median ms | saved best / median ms | recompute / saved (best, median) |")
    print("|---|---|---|---|")
    for t in (int(s) for s in a.tokens.split(",")):
        keys = iter(jax.random.split(jax.random.key(t), 4 * a.repeats + 4))
        xs = [jax.random.normal(next(keys), (t, cfg.d_model), jnp.float32) for _ in range(4 * a.repeats + 2)]
        for f in steps.values():  # compile, untimed
            jax.block_until_ready(f(p.experts, p.w_router, xs[0], xs[1]))
        pairs = iter(zip(xs[2::2], xs[3::2]))
        ms = interleaved_ms(
            {n: functools.partial(f, p.experts, p.w_router) for n, f in steps.items()}, pairs.__next__, a.repeats
        )
        print(f"| {t} | {ab_cells(ms['recompute'], ms['saved'], digits=0)} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

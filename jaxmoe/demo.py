"""``jaxmoe demo``: one preset layer with random weights, routing statistics and timings."""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from rich.console import Console
from rich.table import Table

from jaxmoe.block import MoEBlock
from jaxmoe.config import load_config
from jaxmoe.impls.policy import resolve_impl
from jaxmoe.routing import expert_load


def cli_main(argv: list[str] | None = None) -> int:
    """``jaxmoe demo`` entry point; returns the exit code (1 if an output is not finite)."""
    ap = argparse.ArgumentParser(prog="jaxmoe demo", description=__doc__)
    ap.add_argument("--preset", default="qwen3.6-35b-a3b")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128])
    ap.add_argument("--impl", default="auto")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    cfg = load_config(a.preset)
    con = Console()
    con.print(
        f"[bold]{cfg.name}[/] d={cfg.d_model} E={cfg.num_experts} k={cfg.top_k} F={cfg.expert_dim} "
        f"shared={cfg.shared_expert_dim} on {jax.devices()[0].platform}"
    )
    block = MoEBlock(cfg, rngs=nnx.Rngs(a.seed), impl=a.impl)
    tab = Table("tokens", "impl", "median ms", "tok/s", "experts hit", "max/mean load", "mean top-1 w")
    for t in a.tokens:
        x = jax.random.normal(jax.random.key(a.seed + t), (t, cfg.d_model), jnp.float32)
        y, r = block(x, return_routing=True)
        jax.block_until_ready(y)
        ts = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(block(x, return_routing=True)[0])
            ts.append(time.perf_counter() - t0)
        load = np.asarray(expert_load(r.expert_ids, cfg.num_experts))
        ms = float(np.median(ts) * 1e3)
        tab.add_row(
            str(t),
            resolve_impl(a.impl, t * cfg.top_k, experts=block.params().experts),
            f"{ms:.2f}",
            f"{t / ms * 1e3:.0f}",
            f"{int((load > 0).sum())}/{cfg.num_experts}",
            f"{load.max() / load.mean():.2f}",
            f"{float(r.weights[:, 0].mean()):.3f}",
        )
        if not np.isfinite(np.asarray(y)).all():
            con.print("[red]non-finite output[/]")
            return 1
    con.print(tab)
    return 0

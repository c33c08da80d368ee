"""Expert parallelism per device count: bytes exchanged per token, exchange vs compute time.

Run (CPU, 8 forced host devices; the flag is set here if absent):

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/bench_parallel.py

For each expert-axis size n in 1, 2, 4, 8 (mesh ``(expert=n, data=1)``, tokens split
over the n devices) it reports:

- ``C``: rows per (sender, receiver) buffer (the no-drop worst case unless
  ``--capacity-factor``),
- ``buf B/tok``: bytes of all all-to-all buffers (x rows, expert ids and weights out,
  float32 results back), summed over devices, per token; ``cross B/tok`` the part that
  leaves its device (``(n-1)/n`` of it); ``ragged B/tok`` what ``ragged_all_to_all``
  would move (only the filled rows that leave their device, measured from the routing),
- ``exchange ms``: the four all-to-alls alone on buffers of the same shapes
  (``jaxmoe.parallel.exchange_rows`` in its own shard_map), ``step ms``: the full
  expert-parallel layer, ``exch/step``: their ratio; ``step/step(n=1)``.

Host "devices" share the same CPU cores and memory, so the exchange here is a memory
copy and compute does not speed up with n; the numbers show the protocol's costs, not
a cluster's.
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
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import jaxmoe  # noqa: E402
from jaxmoe import parallel  # noqa: E402


def timed(f, *args, reps: int) -> float:
    """Median wall time of ``f(*args)`` in ms (after one warm-up call)."""
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(ts))


def exchange_only(mesh, n: int, c: int, d: int, dtype):
    """A jitted function doing just the layer's exchanges on ``[n*C, ...]`` buffers per device."""

    def body(x, ids, w):
        sizes = jnp.full((n,), c, jnp.int32)
        rs = jax.lax.all_to_all(sizes, parallel.EXPERT_AXIS, 0, 0, tiled=True)
        rx = parallel.exchange_rows(x, sizes, rs, n, c, "padded")
        ri = parallel.exchange_rows(ids, sizes, rs, n, c, "padded")
        rw = parallel.exchange_rows(w, sizes, rs, n, c, "padded")
        back = parallel.exchange_rows(rx.astype(jnp.float32), rs, sizes, n, c, "padded")
        return back, ri, rw

    spec = P(parallel.EXPERT_AXIS)
    f = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec), out_specs=(spec, spec, spec), check_vma=False)
    )
    key = jax.random.key(0)
    args = (
        jax.random.normal(key, (n * n * c, d), dtype),
        jnp.zeros((n * n * c,), jnp.int32),
        jax.random.uniform(key, (n * n * c,), jnp.float32),
    )
    return f, args


def ragged_bytes(ids: np.ndarray, kept: np.ndarray, n: int, el: int, d: int, itemsize: int) -> int:
    """Bytes ``ragged_all_to_all`` would move across devices: kept pairs whose expert
    lives on another device than their token (x row + id + weight out, f32 row back)."""
    t = ids.shape[0]
    per = -(-t // n)
    src = (np.arange(t) // per)[:, None]
    cross = kept & (ids // el != src)
    return int(cross.sum()) * (d * itemsize + 8 + d * 4)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3.6-35b-a3b")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--expert-dim", type=int, default=128)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--impl", default="auto")
    ap.add_argument("--capacity-factor", type=float, default=None)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--devices", default="1,2,4,8")
    a = ap.parse_args(argv)

    base = jaxmoe.load_config(a.preset)
    cfg = dataclasses.replace(
        base,
        d_model=a.d_model,
        expert_dim=a.expert_dim,
        shared_expert_dim=a.expert_dim if base.shared_expert_dim else 0,
        router=dataclasses.replace(base.router, num_experts=a.experts),
    )
    params = jaxmoe.init_params(cfg, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (a.tokens, cfg.d_model), jnp.float32)
    itemsize = x.dtype.itemsize
    rows = []
    for n in (int(s) for s in a.devices.split(",")):
        if n > len(jax.devices()):
            break
        mesh = parallel.make_mesh(n)
        ps = parallel.shard_params(params, mesh)
        step = jax.jit(
            functools.partial(
                parallel.moe_apply_ep,
                cfg=cfg,
                mesh=mesh,
                impl=a.impl,
                capacity_factor=a.capacity_factor,
                return_routing=True,
                return_stats=True,
            )
        )
        _, r, stats = step(ps, x)
        c = stats.capacity
        t_step = timed(step, ps, x, reps=a.reps)
        f, args = exchange_only(mesh, n, c, cfg.d_model, x.dtype)
        t_ex = timed(f, *args, reps=a.reps)
        per_dev = n * c * (cfg.d_model * itemsize + 4 + 4) + n * c * cfg.d_model * 4 + 4 * n
        buf = n * per_dev
        rb = ragged_bytes(
            np.asarray(r.expert_ids), np.asarray(stats.kept), n, cfg.num_experts // n, cfg.d_model, itemsize
        )
        rows.append(
            dict(
                n=n,
                c=c,
                buf=buf / a.tokens,
                cross=buf * (n - 1) / n / a.tokens,
                ragged=rb / a.tokens,
                ex=t_ex,
                step=t_step,
                dropped=int(stats.dropped_pairs),
            )
        )

    t = Table(
        title=f"expert parallel, {cfg.name} shrunk: d={cfg.d_model} F={cfg.expert_dim} E={cfg.num_experts} "
        f"k={cfg.top_k} T={a.tokens} impl={a.impl} capacity_factor={a.capacity_factor} "
        f"({jax.devices()[0].platform})"
    )
    for h in (
        "devices",
        "C",
        "buf B/tok",
        "cross B/tok",
        "ragged B/tok",
        "exchange ms",
        "step ms",
        "exch/step",
        "step/step(n=1)",
        "dropped",
    ):
        t.add_column(h, justify="right")
    t1 = rows[0]["step"] if rows else 1.0
    for r_ in rows:
        t.add_row(
            str(r_["n"]),
            str(r_["c"]),
            f"{r_['buf']:.0f}",
            f"{r_['cross']:.0f}",
            f"{r_['ragged']:.0f}",
            f"{r_['ex']:.2f}",
            f"{r_['step']:.2f}",
            f"{r_['ex'] / r_['step']:.2f}",
            f"{r_['step'] / t1:.2f}",
            str(r_["dropped"]),
        )
    Console(width=160).print(t)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

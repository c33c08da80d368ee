"""Timing phase of benchmarks/gpu_check.sh: routed experts on the GPU, one row at a time.

For the Qwen3.6-35B-A3B layer (d 2048, 256 experts top-8, F 512) and the Mixtral-8x7B
layer (d 4096, 8 experts top-2, F 14336), bf16 and Q8_0 experts, ``T`` in
`gpu_common.TOKENS`, it times ``xla``, ``pallas``, ``ragged_dot`` and tokamax's
``ragged_dot`` (bf16; Mosaic GPU, else Triton) and appends one JSON line per row to
``bench.jsonl`` as soon as the row exists. The first lines are the plan (every row it
means to write, so the summary can name the ones a timeout cut off) and the ceilings:
a measured copy bandwidth (read + write bytes of an in-place scale of 2 GiB) and bf16
matmul rate (a chain of 8192^3 products).

Device-side timing: each row is one jitted ``fori_loop`` of ``N`` iterations (a static
trip count: XLA runs it with no host round trip per iteration), iteration ``i`` on input
set ``i % R`` of ``R`` rotating sets (tokens and routings), so a decode call reads
experts the previous call did not (cold, as in decoding; ``reuse_prev`` says how many it
shared) and the working set is far above L2. The row's time is the loop's wall time over
``N`` (median of up to three calls after a warm-up call), with ``N`` sized to ~50 ms per
call; ``loop_us`` is the same loop around a trivial body (the harness's own cost,
included in every row). Compiling dominates the phase: the loops of one (layer, weights,
T) compile in parallel threads, then run one at a time. Floors: HBM = bytes of the distinct selected experts (stored
format) + x read + y written, over the copy bandwidth; matmul = the routed FLOPs over
the matmul rate. Every output is compared with ``xla``'s for the same inputs.

``--dry-run``: the same code on the CPU, tiny shapes, the kernels in interpret mode,
``N = R = 2``; tokamax, when not installed, is stood in for by `jax.lax.ragged_dot`
(marked in the row).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import gc
import json
import math
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_common as common  # noqa: E402
from gpu_common import log  # noqa: E402

import jaxmoe  # noqa: E402
from pallas_kernels import tuning  # noqa: E402

# ------------------------------------------------------------------ device-side timing


def loop_fn(fn, n: int, r: int):
    """``jit(run)(xs [R, T, d], ids [R, T, k], ws [R, T, k], ew) -> y [T, d]``: ``n`` calls of
    ``fn(x, routing, ew)`` on input set ``i % r`` in one ``fori_loop``; ``y`` is the last
    call's output (input set ``r - 1`` when ``r`` divides ``n``)."""

    def run(xs, ids, ws, ew):
        def body(i, y):
            j = jax.lax.rem(i, r)
            pick = functools.partial(jax.lax.dynamic_index_in_dim, index=j, keepdims=False)
            return fn(pick(xs), jaxmoe.Routing(pick(ids), pick(ws)), ew).astype(jnp.float32)

        return jax.lax.fori_loop(0, n, body, jnp.zeros(xs.shape[1:], jnp.float32))

    return jax.jit(run)


def trivial_body(x, routing, ew):
    """The harness alone: reads the picked tokens and routing, writes a ``[T, d]`` f32."""
    del ew
    return x.astype(jnp.float32) * routing.weights[:, :1] + routing.expert_ids[:, :1].astype(jnp.float32)


def compile_loop(run, args) -> tuple:
    """``(compiled executable, compile seconds)``: lowering and XLA's compile (Triton's too)."""
    t0 = time.perf_counter()
    compiled = run.lower(*args).compile()
    return compiled, time.perf_counter() - t0


def time_calls(compiled, args, n: int, dry_run: bool) -> dict:
    """Call ``compiled`` once (warm-up), then time up to 3 calls (fewer when one is long).
    Returns seconds per iteration (median call / ``n``), the spread (max / min of the timed
    calls) and the warm-up call's output."""
    t0 = time.perf_counter()
    y = jax.block_until_ready(compiled(*args))
    warm = time.perf_counter() - t0
    reps = 1 if dry_run else 3 if warm < 1.0 else 1 if warm < 10.0 else 0
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    times = times or [warm]
    return dict(sec=float(np.median(times)) / n, spread=float(max(times) / min(times)), calls=len(times), y=y)


def time_compiled(run, args, n: int, dry_run: bool) -> dict:
    compiled, compile_s = compile_loop(run, args)
    return dict(time_calls(compiled, args, n, dry_run), compile_s=compile_s)


def measure_ceilings(dry_run: bool) -> dict:
    """Copy bandwidth (bytes read + written per second) and bf16 matmul rate, each timed
    the same way as the rows (one jitted loop)."""
    nbytes = 2**20 if dry_run else 2**31
    n_iter = 2 if dry_run else 100  # the carry starts as a copy of x: ~1% of the time
    x = jax.random.normal(jax.random.key(7), (nbytes // 2,), jnp.bfloat16)
    s = jnp.asarray([1.5, 1 / 1.5], jnp.bfloat16)  # an argument, so no iteration folds away

    @jax.jit
    def copy_loop(x, s):
        return jax.lax.fori_loop(0, n_iter, lambda i, a: a * s[jax.lax.rem(i, 2)], x)

    copy = time_compiled(copy_loop, (x, s), n_iter, dry_run)
    del x
    m = 128 if dry_run else 8192
    mm_iter = 2 if dry_run else 30
    a = jax.random.normal(jax.random.key(8), (m, m), jnp.bfloat16)
    b = (jax.random.normal(jax.random.key(9), (m, m), jnp.float32) / m**0.5).astype(jnp.bfloat16)

    @jax.jit
    def mm_loop(a, b):
        def body(i, c):
            return jnp.dot(c, b)  # bf16 in and out, float32 accumulation (as cuBLAS runs it)

        return jax.lax.fori_loop(0, mm_iter, body, a)

    mm = time_compiled(mm_loop, (a, b), mm_iter, dry_run)
    return dict(
        type="ceilings",
        copy_bytes=2 * nbytes,
        copy_gbps=2 * nbytes / copy["sec"] / 1e9,
        matmul_n=m,
        matmul_tflops=2 * m**3 / mm["sec"] / 1e12,
        copy_spread=copy["spread"],
        matmul_spread=mm["spread"],
    )


# ------------------------------------------------------------------ rows


def iterations(est_s: float, r: int, dry_run: bool) -> int:
    """Loop length: ~50 ms per call at the estimated time, a multiple of ``r``, in [r, 2000]."""
    if dry_run:
        return r
    n = math.ceil(0.05 / max(est_s, 1e-6) / r) * r
    return int(min(max(n, r), 2000 // r * r))


@dataclasses.dataclass
class Layer:
    """One (layer, weights) pair being timed: its experts and what earlier rows taught."""

    shape: str
    kind: str
    cfg: jaxmoe.MoEConfig
    ew: jaxmoe.ExpertWeights
    w_gate_up: jax.Array | None  # [E, d, 2F] bf16 for tokamax, concatenated once
    ratio: dict = dataclasses.field(default_factory=dict)  # impl -> (T, time / larger floor)
    dead: dict = dataclasses.field(default_factory=dict)  # impl -> why it is not run again
    tk_impl: str | None = None  # the tokamax implementation that compiled


@dataclasses.dataclass
class Run:
    """What every row of the phase shares."""

    rows: common.Rows
    dl: common.Deadline
    dry_run: bool
    interpret: bool
    impls: list
    copy_bw: float
    mm_rate: float
    tokamax: object
    tk_note: str
    reserve: float  # seconds a row may take: none is started with less left
    row_cap: float  # a row expected to take longer is skipped
    workers: int = 4  # compile threads
    harness: dict = dataclasses.field(default_factory=dict)  # input shapes -> loop_us
    n_err: int = 0


def skip_reason(run: Run, layer: Layer, impl: str, est: float, n: int, t: int) -> str | None:
    if run.dl.left() < run.reserve:
        return "phase deadline"
    if impl == "pallas_fma" and t * layer.cfg.top_k > tuning.DECODE_MAX_PAIRS:
        return "decode path only (T k <= 64): the grouped kernels are the same as pallas's"
    if impl in layer.dead:
        return layer.dead[impl]
    if impl == "tokamax" and layer.kind != "bf16":
        return "bf16 only (tokamax's qwix operands not wired)"
    if impl == "tokamax" and run.tokamax is None and not run.dry_run:
        return run.tk_note
    if est * n * 2 > run.row_cap:
        return f"~{est:.2f} s per call expected from T={layer.ratio[impl][0]}: too slow to time"
    return None


def time_group(run: Run, layer: Layer, t: int) -> None:
    """Every impl's row at ``T = t``: rotating inputs; the harness loop and every impl's
    loop compiled at once in threads (compiling dominates the phase; XLA and Triton
    compile outside the GIL); then each timed alone, in order, its row written."""
    cfg = layer.cfg
    r = common.rotation(t, run.dry_run)
    xs, rts = common.rotating_inputs(cfg, t, r, jax.random.key(t))
    tr = common.traffic(cfg, layer.kind, np.asarray(rts.expert_ids))
    floor_hbm, floor_mm = tr["bytes"] / run.copy_bw, tr["flops"] / run.mm_rate
    floor = max(floor_hbm, floor_mm)
    base = dict(type="row", shape=layer.shape, kind=layer.kind, T=t, R=r, **tr)
    base.update(floor_hbm_ms=floor_hbm * 1e3, floor_mm_ms=floor_mm * 1e3)
    args = (xs, rts.expert_ids, rts.weights, layer.ew)
    n0 = iterations(50e-6, r, run.dry_run)  # the harness alone: a few us per iteration
    hkey = (xs.shape, rts.expert_ids.shape)  # shared by both weight kinds of a layer
    rows, jobs = {}, {}
    if hkey not in run.harness:
        hargs = (xs, rts.expert_ids, rts.weights, None)
        jobs["harness"] = functools.partial(compile_loop, loop_fn(trivial_body, n0, r), hargs)
    for impl in run.impls:
        row = rows[impl] = dict(base, impl=impl)
        est = floor * (layer.ratio[impl][1] if impl in layer.ratio else 4.0)
        row["n_iter"] = n = iterations(est, r, run.dry_run)
        if why := skip_reason(run, layer, impl, est, n, t):
            row["skipped"] = why
        elif impl == "tokamax":
            jobs[impl] = functools.partial(compile_tokamax, run, layer, args, n, r)
        else:
            fn = functools.partial(common.impl_fn(impl, run.interpret), cfg=cfg)
            jobs[impl] = functools.partial(compile_loop, loop_fn(fn, n, r), args)
    with concurrent.futures.ThreadPoolExecutor(max_workers=run.workers) as pool:
        futures = {k: pool.submit(job) for k, job in jobs.items()}
    done = {k: f.exception() or f.result() for k, f in futures.items()}
    if isinstance(done.get("harness"), tuple):
        run.harness[hkey] = time_calls(done["harness"][0], hargs, n0, run.dry_run)["sec"] * 1e6
    ref = None
    for impl, row in rows.items():
        row["loop_us"] = run.harness.get(hkey)
        if "skipped" not in row and run.dl.left() < run.reserve:
            row["skipped"] = "phase deadline"
        if "skipped" in row:
            row.pop("n_iter")
            run.rows.write(row)
            log(fmt_row(row))
            continue
        try:
            job = done[impl]
            if isinstance(job, BaseException):
                raise job
            compiled, row["compile_s"], *note = job
            if note:
                layer.tk_impl, row["note"] = note
            res = time_calls(compiled, args, row["n_iter"], run.dry_run)
            sec = res["sec"]
            row.update(
                calls=res["calls"],
                ms=sec * 1e3,
                spread=res["spread"],
                gbps=tr["bytes"] / sec / 1e9,
                tflops=tr["flops"] / sec / 1e12,
                x_hbm_floor=sec / floor_hbm,
                frac_mm=floor_mm / sec,
            )
            layer.ratio[impl] = (t, sec / floor)
            if impl == "xla":
                ref = res["y"]
            elif ref is not None:
                err = common.rel_err(res["y"], ref)
                row.update(rel_err_vs_xla=err, ok=bool(err <= common.BF16_TOL))
                run.n_err += not row["ok"]
            del res, compiled
        except Exception as ex:  # one broken row must not hide the rest
            msg = f"{type(ex).__name__}: {ex}"
            row["error"] = msg[:1500]
            run.n_err += 1
            if "RESOURCE_EXHAUSTED" in msg or "out of memory" in msg.lower():
                layer.dead[impl] = f"out of memory at T={t}"
        done.pop(impl, None)
        run.rows.write(row)
        log(fmt_row(row))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder of bench.jsonl (and env.json, read for L2)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, interpret-mode kernels, DRY_GROUPS")
    ap.add_argument("--deadline", type=float, default=250.0, help="seconds this phase plans to use")
    ap.add_argument(
        "--no-deadline", action="store_true", help="time every row whatever the time: no deadline, no row cap (tests)"
    )
    ap.add_argument("--shapes", default=",".join(common.SHAPES))
    ap.add_argument("--kinds", default=",".join(common.KINDS))
    ap.add_argument("--tokens", default=",".join(map(str, common.TOKENS)))
    ap.add_argument("--impls", default=",".join(common.IMPLS))
    a = ap.parse_args(argv)
    dl = common.Deadline(math.inf if a.no_deadline else a.deadline)
    interpret = common.check_backend(a.dry_run)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    shapes, kinds, impls = a.shapes.split(","), a.kinds.split(","), a.impls.split(",")
    for name, got, allowed in (("--shapes", shapes, common.SHAPES), ("--kinds", kinds, common.KINDS)):
        if bad := [g for g in got if g not in allowed]:
            ap.error(f"{name}: unknown {bad}; choose from {list(allowed)}")
    if bad := [i for i in impls if i not in common.IMPLS]:
        ap.error(f"--impls: unknown {bad}; choose from {list(common.IMPLS)}")
    # bf16 of every layer first, then Q8_0: what a deadline cuts off is the least needed
    groups = [(s, k, int(t)) for k in kinds for s in shapes for t in a.tokens.split(",")]
    targets = dict(common.TARGETS)
    if a.dry_run:  # its own groups and token counts, which exercise both target rules
        groups = list(common.DRY_GROUPS)
        targets.update(hbm_max_t=min(g[2] for g in groups), mm_min_t=max(g[2] for g in groups))
    env = json.loads((out / "env.json").read_text()) if (out / "env.json").exists() else {}
    rows = common.Rows(out / "bench.jsonl")
    rows.write(
        dict(
            type="meta",
            dry_run=a.dry_run,
            device=str(jax.devices()[0].device_kind),
            jax=jax.__version__,
            planned=[[*g, i] for g in groups for i in impls],
            targets=targets,
            l2_bytes=env.get("l2_bytes") or common.L2_BYTES_DEFAULT,
            deadline_s=None if a.no_deadline else a.deadline,
        )
    )
    ceil = measure_ceilings(a.dry_run)
    rows.write(ceil)
    log(f"ceilings: copy {ceil['copy_gbps']:.1f} GB/s, bf16 matmul {ceil['matmul_tflops']:.2f} TFLOP/s")
    tokamax, tk_note = common.import_tokamax() if "tokamax" in impls else (None, "")
    log(f"note: {tk_note}")
    run = Run(
        rows=rows,
        dl=dl,
        dry_run=a.dry_run,
        interpret=interpret,
        impls=impls,
        copy_bw=ceil["copy_gbps"] * 1e9,
        mm_rate=ceil["matmul_tflops"] * 1e12,
        tokamax=tokamax,
        tk_note=tk_note,
        reserve=0.0 if a.dry_run else 20.0,
        row_cap=math.inf if a.no_deadline else 60.0 if a.dry_run else 25.0,
        workers=min(len(impls) + 1, os.cpu_count() or 1),
    )
    layer = None
    for shape, kind, t in groups:
        if layer is None or (layer.shape, layer.kind) != (shape, kind):
            layer = None
            gc.collect()
            cfg = common.layer_config(shape, a.dry_run)
            ew = common.random_experts(cfg, kind, jax.random.key(1))
            w_gu = jnp.concatenate([ew.w_gate, ew.w_up], axis=-1) if "tokamax" in impls and kind == "bf16" else None
            layer = Layer(shape, kind, cfg, ew, w_gu)
        if dl.left() < run.reserve:
            for impl in impls:
                rows.write(dict(type="row", shape=shape, kind=kind, T=t, impl=impl, skipped="phase deadline"))
            continue
        time_group(run, layer, t)
        gc.collect()
    log(f"timing phase done in {time.monotonic() - dl.start:.0f} s, {run.n_err} rows with errors or mismatches")
    return 1 if run.n_err else 0


def compile_tokamax(run: Run, layer: Layer, args, n: int, r: int):
    """``(compiled, compile seconds, implementation, note)`` of tokamax's ``ragged_dot``
    experts with the first implementation that compiles (Mosaic GPU, then Triton; the one
    that compiled is kept for the layer); a dry run without tokamax uses
    `jax.lax.ragged_dot` in its place."""
    cfg = layer.cfg
    if run.tokamax is None:
        rd = common.tokamax_rd(None, None)
        fn = functools.partial(common.tokamax_experts, cfg=cfg, rd=rd, w_gate_up=layer.w_gate_up)
        return (*compile_loop(loop_fn(fn, n, r), args), None, f"stand-in: jax.lax.ragged_dot ({run.tk_note})")
    order = (layer.tk_impl,) if layer.tk_impl else ("xla",) if run.dry_run else ("mosaic_gpu", "triton")
    errors = []
    for impl in order:
        rd = common.tokamax_rd(run.tokamax, impl)
        fn = functools.partial(common.tokamax_experts, cfg=cfg, rd=rd, w_gate_up=layer.w_gate_up)
        try:
            return (*compile_loop(loop_fn(fn, n, r), args), impl, f"{run.tk_note}, implementation={impl}")
        except Exception as ex:
            errors.append(f"{impl}: {type(ex).__name__}: {str(ex)[:300]}")
    raise RuntimeError("tokamax: no implementation compiled: " + " | ".join(errors))


def fmt_row(r: dict) -> str:
    head = f"{r['shape']:8s} {r['kind']:5s} T={r['T']:<6d} {r['impl']:10s}"
    if "ms" in r:
        err = f"  err {r['rel_err_vs_xla']:.1e}" if "rel_err_vs_xla" in r else ""
        return (
            f"{head} {r['ms']:9.4f} ms  {r['gbps']:7.1f} GB/s  {r['tflops']:7.2f} TFLOP/s  "
            f"x{r['x_hbm_floor']:.2f} HBM floor  {100 * r['frac_mm']:5.1f}% mm  N={r['n_iter']}{err}"
        )
    return f"{head} {r.get('skipped') or r.get('error')}"


if __name__ == "__main__":
    sys.exit(main())

"""GPU check and benchmark of the routed-expert paths (run by benchmarks/gpu_check.sh).

Two phases, one process:

1. ``check``: the Pallas kernels compiled for the GPU against their pure-jnp references
   and the full ``pallas`` impl against ``experts_dense`` / ``experts_gather`` (bf16,
   Q8_0, 4-bit; decode and grouped paths; biases and gpt-oss's activation).
2. ``bench``: at the Qwen3.6-35B-A3B layer (d 2048, 256 experts, top-8, F 512) and the
   Mixtral-8x7B layer (d 4096, 8 experts, top-2, F 14336), for T in {1, 16, 128, 2048,
   16384}, bf16 and Q8_0 weights: ``pallas``, ``xla``, ``ragged_dot`` and, if importable,
   ``tokamax.ragged_dot(implementation="triton")`` (bf16 only). Each row prints the time,
   the achieved weight bandwidth against a measured copy bandwidth (the HBM floor: bytes
   of the experts actually selected / copy bandwidth), and TFLOP/s against a measured
   bf16 matmul rate.

Results go to ``--out`` (default ``$OUT`` or ``./gpu_results``): ``check.json``,
``bench.json`` and ``bench.md``. ``--dry-run`` runs the same plumbing on CPU with tiny
shapes and the kernels in interpret mode (what the CPU test suite exercises).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import jaxmoe  # noqa: E402
from jaxmoe.dispatch import plan_dispatch  # noqa: E402
from jaxmoe.impls.pallas import experts_pallas, kernel_weight  # noqa: E402
from jaxmoe.impls.registry import available_impls, get_impl  # noqa: E402
from jaxmoe.quant import QuantizedTensor, materialize, quantize_int4_affine, quantize_int8  # noqa: E402
from pallas_kernels import decode, down, swiglu  # noqa: E402

SHAPES = {"qwen3.6": "qwen3.6-35b-a3b", "mixtral": "mixtral-8x7b"}
TOKENS = (1, 16, 128, 2048, 16384)
KINDS = ("bf16", "q8_0")
TOL = {"bf16": 4e-2, "q8_0": 4e-2, "int4": 4e-2, "f32": 1e-4}


# ------------------------------------------------------------------ utilities


def log(*a):
    print(*a, flush=True)


def timeit(fn, *args, min_time: float = 0.2, max_iters: int = 100, warmup: int = 1) -> float:
    """Median seconds of ``fn(*args)`` (already jitted), after ``warmup`` calls."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    t_start = time.perf_counter()
    while len(times) < max_iters and (time.perf_counter() - t_start < min_time or len(times) < 3):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def measure_copy_bandwidth(nbytes: int, **kw) -> float:
    """Bytes/s of a read+write elementwise pass over ``nbytes`` (bf16)."""
    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    f = jax.jit(lambda a: a * jnp.bfloat16(1.5))
    return 2 * nbytes / timeit(f, x, **kw)


def measure_matmul(n: int, dtype=jnp.bfloat16, **kw) -> float:
    """FLOP/s of an ``n x n x n`` matmul in ``dtype`` with float32 accumulation."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32).astype(dtype))
    return 2 * n**3 / timeit(f, a, b, **kw)


def random_experts(cfg, kind: str, key) -> jaxmoe.ExpertWeights:
    """Random expert weights made on device: bf16 arrays, or Q8_0 codes and scales."""
    e, d, f = cfg.num_experts, cfg.d_model, cfg.expert_dim
    ks = jax.random.split(key, 6)
    if kind == "bf16":
        return jaxmoe.ExpertWeights(
            *(
                jax.random.normal(k_, s, jnp.bfloat16) * (1 / s[1] ** 0.5)
                for k_, s in zip(ks, ((e, d, f), (e, d, f), (e, f, d)))
            )
        )

    def q8(k1, k2, n_in, n_out):  # logical [E, n_in, n_out], stored [E, n_out, n_in]
        q = jax.random.randint(k1, (e, n_out, n_in), -127, 128, jnp.int32).astype(jnp.int8)
        s = jax.random.uniform(k2, (e, n_out, n_in // 32), jnp.float32, 0.5, 1.5) / (127 * n_in**0.5)
        return QuantizedTensor(q, s.astype(jnp.float16), None, "int8", 32)

    return jaxmoe.ExpertWeights(q8(ks[0], ks[1], d, f), q8(ks[2], ks[3], d, f), q8(ks[4], ks[5], f, d))


def random_routing(cfg, t: int, key) -> jaxmoe.Routing:
    logits = jax.random.normal(key, (t, cfg.num_experts), jnp.float32)
    return jaxmoe.route(logits, cfg.router)


def weight_bytes_per_expert(cfg, kind: str) -> float:
    per = 3 * cfg.d_model * cfg.expert_dim
    return per * (2.0 if kind == "bf16" else 34 / 32)


# ------------------------------------------------------------------ implementations


def _ragged_dot_path(x, routing, ew, cfg):
    """``jax.lax.ragged_dot`` over the sorted pairs (comparison only)."""
    dt = x.dtype
    plan = plan_dispatch(routing.expert_ids, cfg.num_experts, 16)
    xs = x[plan.token_idx]
    gs = plan.group_sizes
    wg, wu, wd = (materialize(w, dt) for w in (ew.w_gate, ew.w_up, ew.w_down))
    g = jax.lax.ragged_dot(xs, wg, gs, preferred_element_type=jnp.float32)
    u = jax.lax.ragged_dot(xs, wu, gs, preferred_element_type=jnp.float32)
    h = (jax.nn.silu(g) * u).astype(dt)
    y = jax.lax.ragged_dot(h, wd, gs, preferred_element_type=jnp.float32)
    y = y * routing.weights.reshape(-1)[plan.sort_idx][:, None]
    return down.combine(y, plan.inv, cfg.top_k)


def _tokamax_path(x, routing, ew, cfg):
    import tokamax

    dt = x.dtype
    plan = plan_dispatch(routing.expert_ids, cfg.num_experts, 16)
    xs = x[plan.token_idx]
    gs = plan.group_sizes
    rd = functools.partial(tokamax.ragged_dot, preferred_element_type=jnp.float32, implementation="triton")
    g = rd(xs, ew.w_gate, gs)
    u = rd(xs, ew.w_up, gs)
    h = (jax.nn.silu(g) * u).astype(dt)
    y = rd(h, ew.w_down, gs) * routing.weights.reshape(-1)[plan.sort_idx][:, None]
    return down.combine(y, plan.inv, cfg.top_k)


def implementations(interpret: bool) -> dict:
    impls = {"pallas": functools.partial(experts_pallas, interpret=interpret)}
    if "xla" in available_impls():
        impls["xla"] = get_impl("xla")
    impls["ragged_dot"] = get_impl("ragged_dot") if "ragged_dot" in available_impls() else _ragged_dot_path
    try:
        import tokamax  # noqa: F401

        impls["tokamax"] = _tokamax_path
    except Exception as e:  # not installed (no wheel carried) or broken on this jax
        log(f"note: tokamax not importable ({type(e).__name__}: {e}); its column is skipped")
    return impls


# ------------------------------------------------------------------ phase 1: check


def _err(a, b) -> float:
    a = np.asarray(jnp.asarray(a, jnp.float32))
    b = np.asarray(jnp.asarray(b, jnp.float32))
    if np.isnan(a).any():
        return float("nan")
    return float(np.abs(a - b).max() / max(1e-6, np.abs(b).max()))


def check(interpret: bool, small: bool, limit: int | None = None) -> list[dict]:
    """Kernels and the full pallas impl vs references; returns one record per case."""
    rows = []
    d, f, e = (512, 256, 16) if not small else (64, 32, 8)
    cases = []
    for preset in ("qwen3.6-35b-a3b", "gpt-oss-20b", "mixtral-8x7b"):
        c = jaxmoe.load_config(preset)
        c = dataclasses.replace(
            c,
            d_model=d,
            expert_dim=f,
            shared_expert_dim=0,
            num_shared_experts=0,
            shared_expert_gate=False,
            router=dataclasses.replace(c.router, num_experts=e, top_k=min(c.top_k, 4)),
        )
        for kind in ("bf16", "q8_0", "int4"):
            for t in (1, 5, 300):
                cases.append((preset, c, kind, t))
    if small:  # plumbing only: one case per preset, both paths, every weight kind
        keep = {("qwen3.6-35b-a3b", "bf16", 1), ("gpt-oss-20b", "q8_0", 300), ("mixtral-8x7b", "int4", 5)}
        cases = [c for c in cases if (c[0], c[2], c[3]) in keep]
    cases = cases[:limit]
    key = jax.random.key(0)
    for preset, cfg, kind, t in cases:
        key, k1, k2, k3 = jax.random.split(key, 4)
        p = jaxmoe.init_params(cfg, k1, dtype=jnp.float32)
        ew = p.experts
        dt = jnp.bfloat16
        if kind == "q8_0":
            ew = dataclasses.replace(
                ew, **{n: quantize_int8(np.asarray(getattr(ew, n))) for n in ("w_gate", "w_up", "w_down")}
            )
        elif kind == "int4":
            ew = dataclasses.replace(
                ew, **{n: quantize_int4_affine(np.asarray(getattr(ew, n)), 32) for n in ("w_gate", "w_up", "w_down")}
            )
        else:
            ew = jax.tree.map(lambda a, dt=dt: a.astype(dt), ew)
        x = jax.random.normal(k2, (t, cfg.d_model), dt)
        r = random_routing(cfg, t, k3)
        rec = dict(preset=preset, kind=kind, T=t)
        try:
            y = jax.jit(functools.partial(experts_pallas, cfg=cfg, interpret=interpret))(x, r, ew)
            ref = jaxmoe.experts_dense(x, r, ew, cfg)
            rec["rel_err_vs_dense"] = _err(y, ref)
            # the kernels one by one against their references (grouped or decode path)
            wg, wu = kernel_weight(ew.w_gate), kernel_weight(ew.w_up)
            if t * cfg.top_k <= 64:
                h = decode.decode_gate_up(
                    x,
                    r.expert_ids,
                    wg,
                    wu,
                    ew.b_gate,
                    ew.b_up,
                    interpret=interpret,
                    activation=cfg.activation,
                )
                rec["rel_err_kernel"] = _err(
                    h,
                    decode.decode_gate_up_reference(
                        x, r.expert_ids, wg, wu, ew.b_gate, ew.b_up, activation=cfg.activation
                    ),
                )
            else:
                plan = plan_dispatch(r.expert_ids, cfg.num_experts, 32)
                meta = (plan.group_offsets, plan.tile_group, plan.tile_row, plan.num_tiles)
                h = swiglu.gate_up_swiglu(
                    x,
                    plan.token_idx,
                    *meta,
                    wg,
                    wu,
                    ew.b_gate,
                    ew.b_up,
                    block_m=32,
                    interpret=interpret,
                    activation=cfg.activation,
                )
                rec["rel_err_kernel"] = _err(
                    h,
                    swiglu.gate_up_swiglu_reference(
                        x,
                        plan.token_idx,
                        plan.group_offsets,
                        wg,
                        wu,
                        ew.b_gate,
                        ew.b_up,
                        activation=cfg.activation,
                    ),
                )
            rec["ok"] = bool(rec["rel_err_vs_dense"] <= TOL[kind] and rec["rel_err_kernel"] <= TOL[kind])
        except Exception as ex:  # record and continue: one broken case must not hide the rest
            rec.update(ok=False, error=f"{type(ex).__name__}: {ex}"[:2000])
            traceback.print_exc()
        log(
            f"check {preset:16s} {kind:5s} T={t:<4d} "
            + " ".join(
                f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}"
                for k, v in rec.items()
                if k not in ("preset", "kind", "T")
            )
        )
        rows.append(rec)
    return rows


# ------------------------------------------------------------------ phase 2: bench


def bench(shapes, tokens, kinds, interpret: bool, small: bool, slow_cutoff: float, only=None) -> dict:
    tk = dict(min_time=0.05, max_iters=3) if small else dict(min_time=0.3, max_iters=200)
    copy_bw = measure_copy_bandwidth(2**20 if small else 2**31, **tk)
    mm_rate = measure_matmul(256 if small else 8192, **tk)
    log(f"measured copy bandwidth {copy_bw / 1e9:.1f} GB/s, bf16 matmul {mm_rate / 1e12:.1f} TFLOP/s")
    impls = implementations(interpret)
    if only:
        impls = {k: v for k, v in impls.items() if k in only}
    rows = []
    for shape in shapes:
        cfg = jaxmoe.load_config(SHAPES[shape])
        cfg = dataclasses.replace(cfg, shared_expert_dim=0, num_shared_experts=0, shared_expert_gate=False)
        if small:
            cfg = dataclasses.replace(
                cfg,
                d_model=64,
                expert_dim=32,
                router=dataclasses.replace(cfg.router, num_experts=8, top_k=min(2, cfg.top_k)),
            )
        for kind in kinds:
            ew = random_experts(cfg, kind, jax.random.key(1))
            too_slow: set[str] = set()
            for t in tokens:
                x = jax.random.normal(jax.random.key(2), (t, cfg.d_model), jnp.bfloat16)
                r = random_routing(cfg, t, jax.random.key(3))
                n_used = int(np.unique(np.asarray(r.expert_ids)).size)
                wbytes = n_used * weight_bytes_per_expert(cfg, kind) + 2 * t * cfg.d_model * 2
                flops = 2 * 3 * t * cfg.top_k * cfg.d_model * cfg.expert_dim
                floor_mem = wbytes / copy_bw
                floor_mm = flops / mm_rate
                for name, fn in impls.items():
                    rec = dict(
                        shape=shape,
                        kind=kind,
                        T=t,
                        impl=name,
                        experts_used=n_used,
                        bytes=wbytes,
                        flops=flops,
                        floor_hbm_ms=floor_mem * 1e3,
                        floor_mm_ms=floor_mm * 1e3,
                    )
                    if name == "tokamax" and kind != "bf16":
                        rec["skipped"] = "tokamax takes bf16 weights here (its own QuantizedArray not wired)"
                    elif name in too_slow:
                        rec["skipped"] = f"over {slow_cutoff}s at a smaller T"
                    else:
                        try:
                            f = jax.jit(functools.partial(fn, cfg=cfg))
                            sec = timeit(f, x, r, ew, **tk)
                            rec.update(
                                ms=sec * 1e3,
                                gbps=wbytes / sec / 1e9,
                                tflops=flops / sec / 1e12,
                                x_hbm_floor=sec / floor_mem,
                                frac_mm_rate=floor_mm / sec,
                            )
                            if sec > slow_cutoff:
                                too_slow.add(name)
                        except Exception as ex:
                            rec["error"] = f"{type(ex).__name__}: {ex}"[:1000]
                            too_slow.add(name)
                    rows.append(rec)
                    log(fmt_row(rec))
    return dict(copy_bw=copy_bw, matmul_rate=mm_rate, rows=rows)


def fmt_row(r: dict) -> str:
    head = f"{r['shape']:8s} {r['kind']:5s} T={r['T']:<6d} {r['impl']:10s}"
    if "ms" in r:
        return (
            f"{head} {r['ms']:9.3f} ms  {r['gbps']:7.1f} GB/s  {r['tflops']:7.2f} TFLOP/s  "
            f"x{r['x_hbm_floor']:.2f} of HBM floor  {100 * r['frac_mm_rate']:.0f}% of matmul rate"
        )
    return f"{head} {r.get('skipped') or r.get('error')}"


def markdown(res: dict, env: dict) -> str:
    lines = [
        f"# jaxmoe GPU bench ({env['device']}, jax {env['jax']})",
        "",
        f"copy bandwidth {res['copy_bw'] / 1e9:.1f} GB/s, bf16 matmul {res['matmul_rate'] / 1e12:.1f} TFLOP/s",
        "",
        "| shape | weights | T | impl | ms | GB/s | TFLOP/s | x HBM floor | % matmul rate |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        if "ms" in r:
            lines.append(
                f"| {r['shape']} | {r['kind']} | {r['T']} | {r['impl']} | {r['ms']:.3f} | {r['gbps']:.1f} | "
                f"{r['tflops']:.2f} | {r['x_hbm_floor']:.2f} | {100 * r['frac_mm_rate']:.0f} |"
            )
        else:
            lines.append(
                f"| {r['shape']} | {r['kind']} | {r['T']} | {r['impl']} | "
                f"{r.get('skipped') or r.get('error')} | | | | |"
            )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes, kernels in interpret mode (CPU)")
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu_results")
    ap.add_argument("--phase", choices=("all", "check", "bench"), default="all")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--tokens", default=None, help="comma list (default 1,16,128,2048,16384; dry run 1,16,40)")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--impls", default=None, help="comma list to time (default: pallas,xla,ragged_dot,tokamax)")
    ap.add_argument("--check-limit", type=int, default=None, help="run only the first N check cases")
    ap.add_argument("--slow-cutoff", type=float, default=2.0, help="skip larger T for an impl slower than this (s)")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    interpret = a.dry_run or jax.default_backend() not in ("gpu", "cuda", "rocm")
    if interpret and not a.dry_run:
        log(f"warning: no GPU backend ({jax.default_backend()}); running the kernels in interpret mode")
    dev = jax.devices()[0]
    env = dict(
        device=getattr(dev, "device_kind", str(dev)),
        platform=dev.platform,
        jax=jax.__version__,
        python=platform.python_version(),
        interpret=interpret,
        impls=available_impls(),
    )
    (out / "env.json").write_text(json.dumps(env, indent=1))
    log(json.dumps(env))
    ok = True
    if a.phase in ("all", "check"):
        rows = check(interpret, small=a.dry_run, limit=a.check_limit)
        (out / "check.json").write_text(json.dumps(rows, indent=1))
        bad = [r for r in rows if not r.get("ok")]
        log(f"check: {len(rows) - len(bad)}/{len(rows)} cases within tolerance")
        ok = not bad
    if a.phase in ("all", "bench"):
        tokens = [int(s) for s in (a.tokens or ("1,16,40" if a.dry_run else ",".join(map(str, TOKENS)))).split(",")]
        res = bench(
            a.shapes.split(","),
            tokens,
            a.kinds.split(","),
            interpret,
            a.dry_run,
            a.slow_cutoff,
            a.impls.split(",") if a.impls else None,
        )
        res["env"] = env
        (out / "bench.json").write_text(json.dumps(res, indent=1))
        (out / "bench.md").write_text(markdown(res, env))
        log(markdown(res, env))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Summary phase of benchmarks/gpu_check.sh: ``bench.md`` from the rows the phases wrote.

Reads ``env.json``, ``check.jsonl`` and ``bench.jsonl`` (whatever exists: a phase cut off
by its timeout leaves the rows it finished), writes ``bench.md`` and prints it: the
phases' exit codes and times, the kernel checks, the ceilings, every timing row, the
targets of issue 12 item 5 per (layer, weights, T) and the planned rows that never
came. Plain Python (no JAX), so it runs whatever state the device is in.

Targets (notes, not failures): ``pallas`` within 1.3x of the HBM floor (cold) for
T <= 16; at least 60% of the measured bf16 matmul rate for T >= 2048; faster than
``ragged_dot`` and tokamax at every T. Exit code 1 when a kernel check failed, a row
errored, two implementations disagreed, a phase failed or a planned row is missing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def read_rows(path: Path) -> list[dict]:
    """Rows of a JSON-lines file; a torn last line (a killed writer) is skipped."""
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def _speedup(pallas: dict, other: dict | None) -> str:
    if other is None:
        return "n/a"
    if "ms" not in other:
        return f"n/a ({(other.get('skipped') or other.get('error') or '')[:40]})"
    s = other["ms"] / pallas["ms"]
    return f"{s:.2f}x faster" if s > 1 else f"**{s:.2f}x: slower**"


def targets(rows: list[dict], tg: dict) -> list[dict]:
    """One verdict per (shape, kind, T) that has a timed ``pallas`` row."""
    by = {}
    for r in rows:
        by.setdefault((r["shape"], r["kind"], r["T"]), {})[r["impl"]] = r
    out = []
    for (shape, kind, t), impls in by.items():
        p = impls.get("pallas")
        if p is None or "ms" not in p:
            continue
        v = dict(shape=shape, kind=kind, T=t, ms=p["ms"])
        if t <= tg["hbm_max_t"]:
            ok = p["x_hbm_floor"] <= tg["hbm_factor"]
            v["hbm"] = f"{'met' if ok else '**NOT met**'} (x{p['x_hbm_floor']:.2f}, target <= {tg['hbm_factor']})"
        else:
            v["hbm"] = "-"
        if t >= tg["mm_min_t"]:
            ok = p["frac_mm"] >= tg["mm_fraction"]
            v["mm"] = (
                f"{'met' if ok else '**NOT met**'} ({100 * p['frac_mm']:.0f}%, target >= {100 * tg['mm_fraction']:.0f}%)"
            )
        else:
            v["mm"] = "-"
        v["vs_fma_decode"] = _speedup(p, impls.get("pallas_fma"))
        v["vs_ragged_dot"] = _speedup(p, impls.get("ragged_dot"))
        v["vs_tokamax"] = _speedup(p, impls.get("tokamax"))
        out.append(v)
    return out


def _f(v, fmt: str) -> str:
    return "" if v is None else format(v, fmt)


def markdown(out: Path, phases: list[str]) -> tuple[str, int]:
    """``(bench.md text, number of problems)``."""
    env = json.loads((out / "env.json").read_text()) if (out / "env.json").exists() else {}
    checks = read_rows(out / "check.jsonl")
    bench = read_rows(out / "bench.jsonl")
    meta = next((r for r in bench if r.get("type") == "meta"), {})
    ceil = next((r for r in bench if r.get("type") == "ceilings"), None)
    rows = [r for r in bench if r.get("type") == "row"]
    problems = 0
    mode = "dry run (CPU, interpret mode)" if meta.get("dry_run", env.get("dry_run")) else "GPU"
    lines = [
        f"# jaxmoe GPU check: {env.get('device', meta.get('device', '?'))}, jax {env.get('jax', meta.get('jax', '?'))}, {mode}",
        "",
    ]
    if phases:
        lines += ["| phase | exit code | seconds | timeout |", "|---|---|---|---|"]
        for p in phases:
            name, rc, sec, lim = (p.split(":") + ["", "", ""])[:4]
            lines.append(f"| {name} | {rc}{' (timed out)' if rc in ('124', '137') else ''} | {sec} | {lim} |")
            problems += rc != "0"
        lines.append("")
    if env.get("nvidia_smi"):
        lines += ["```", env["nvidia_smi"], "```", ""]
    bad = [c for c in checks if not c.get("ok")]
    problems += len(bad)
    lines.append(f"## Kernel checks: {len(checks) - len(bad)}/{len(checks)} within tolerance")
    lines.append("")
    if checks:
        lines += ["| case | path | rel. error | tolerance | ok |", "|---|---|---|---|---|"]
        for c in checks:
            err = _f(c.get("rel_err"), ".2e") or c.get("error", c.get("skipped", ""))[:120]
            extra = (
                f" (gate/up kernel alone: {c['rel_err_gate_up_kernel']:.2e})" if "rel_err_gate_up_kernel" in c else ""
            )
            lines.append(f"| {c['case']} | {c.get('path', '')} | {err}{extra} | {c.get('tol', '')} | {c.get('ok')} |")
        lines.append("")
    if ceil:
        lines.append(
            f"Ceilings measured in this run: copy {ceil['copy_gbps']:.1f} GB/s (read + write), "
            f"bf16 matmul {ceil['matmul_tflops']:.2f} TFLOP/s ({ceil['matmul_n']}^3); "
            f"L2 {meta.get('l2_bytes', 0) / 2**20:.0f} MiB."
        )
        lines.append("")
    lines += [
        "## Timings (device-side: one jitted loop per row, rotating inputs)",
        "",
        "| layer | weights | T | impl | ms | GB/s | TFLOP/s | x HBM floor | % matmul | experts/call | reuse | N | loop us | err vs xla | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = f"| {r['shape']} | {r['kind']} | {r['T']} | {r['impl']} |"
        if "ms" in r:
            err = _f(r.get("rel_err_vs_xla"), ".1e")
            if r.get("ok") is False:
                err = f"**{err} MISMATCH**"
                problems += 1
            lines.append(
                f"{head} {r['ms']:.4f} | {r['gbps']:.1f} | {r['tflops']:.2f} | {r['x_hbm_floor']:.2f} | "
                f"{100 * r['frac_mm']:.1f} | {r['experts_used']:.1f} | {r['reuse_prev']:.2f} | {r['n_iter']} | "
                f"{_f(r.get('loop_us'), '.1f')} | {err} | {r.get('note', '')} |"
            )
        else:
            if "error" in r:
                problems += 1
            why = r.get("skipped") or f"**error**: {r.get('error', '')[:200]}"
            lines.append(f"{head} | | | | | | | | | | {why} |")
    lines.append("")
    tg = meta.get("targets")
    if tg:
        lines += [
            f"## Targets (pallas; HBM floor for T <= {tg['hbm_max_t']}, matmul rate for T >= {tg['mm_min_t']})",
            "",
            "Times include the harness's own per-iteration cost (`loop us` above); notes, not failures.",
            "",
            "| layer | weights | T | pallas ms | HBM floor | matmul rate | vs decode matvec (pallas_fma) "
            "| vs ragged_dot | vs tokamax |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for v in targets(rows, tg):
            lines.append(
                f"| {v['shape']} | {v['kind']} | {v['T']} | {v['ms']:.4f} | {v['hbm']} | {v['mm']} | "
                f"{v['vs_fma_decode']} | {v['vs_ragged_dot']} | {v['vs_tokamax']} |"
            )
        lines.append("")
    present = {(r["shape"], r["kind"], r["T"], r["impl"]) for r in rows}
    missing = [p for p in meta.get("planned", []) if tuple(p) not in present]
    if missing or not meta:
        problems += max(1, len(missing))
        lines.append(
            f"**{len(missing)} planned rows never written** (the timing phase stopped early): "
            + ", ".join("/".join(map(str, m)) for m in missing[:20])
            if meta
            else "**no timing rows**: the timing phase wrote nothing"
        )
        lines.append("")
    lines.append(f"Problems: {problems}")
    return "\n".join(lines) + "\n", problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--phase", action="append", default=[], help="NAME:RC:SECONDS:TIMEOUT, one per phase")
    a = ap.parse_args(argv)
    out = Path(a.out)
    text, problems = markdown(out, a.phase)
    (out / "bench.md").write_text(text)
    print(text, flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

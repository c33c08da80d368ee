"""benchmarks/gpu_check.sh: its dry run end to end on the CPU (same phases, processes and
files as on the GPU; kernels in interpret mode), and the summary's verdicts.

The dry run is ``--untimed`` (no phase timeout, deadline or row cap), so which rows it
writes does not depend on how loaded the machine is; the deadline's own behaviour is
tested with ``--deadline 0`` (test_timing_phase_deadline_skips_rows_in_plan_order)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
FILES = {"env.json", "check.jsonl", "bench.jsonl", "bench.md", "log.txt"}


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """One untimed dry run for the module: ``(out folder, completed process)``."""
    out = tmp_path_factory.mktemp("gpu_check")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env.update(OUT=str(out), WHEELS=str(out / "no-wheels"), PYTHON=sys.executable)
    proc = subprocess.run(
        ["bash", str(BENCH / "gpu_check.sh"), "--dry-run", "--untimed"],
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,  # a hang guard only: the rows checked below never depend on time
    )
    return out, proc


@pytest.mark.slow
def test_dry_run_phases_files_and_timeouts(dry_run):
    out, proc = dry_run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    files = {p.name for p in out.iterdir() if p.is_file()}
    assert files == FILES and len(files) <= 6, files
    log = (out / "log.txt").read_text()
    sums = re.findall(r"sum=(\d+) s", log)
    assert sums and int(sums[0]) < 480, sums  # the GPU run's timeouts (this run: none)
    assert re.findall(r"== phase (\w+) \(timeout (\d+) s\)", log) == [("check", "0"), ("bench", "0")], log[:2000]
    # separate processes, in order, each exiting 0
    ends = re.findall(r"== phase (\w+): exit (\d+) after", log)
    assert ends == [("check", "0"), ("bench", "0")], ends
    assert log.index("kernel checks:") < log.index("ceilings:") < log.index("# jaxmoe GPU check")


@pytest.mark.slow
def test_dry_run_kernel_checks(dry_run):
    out, _ = dry_run
    check = _module("gpu_kernels_check")
    rows = _rows(out / "check.jsonl")
    assert [r["case"] for r in rows] == [c.name for c in check.DRY_CASES]
    assert all(r["ok"] and r["rel_err"] <= r["tol"] for r in rows), rows
    assert {r["path"] for r in rows} == {"decode", "grouped"}
    assert {r["kind"] for r in rows} == {"f32", "q8_0", "int4", "q5_0", "bf16"}
    env = json.loads((out / "env.json").read_text())
    assert env["dry_run"] and env["backend"] == "cpu"


@pytest.mark.slow
def test_dry_run_timing_rows(dry_run):
    out, _ = dry_run
    rows = _rows(out / "bench.jsonl")
    meta, ceil, body = rows[0], rows[1], rows[2:]
    assert meta["type"] == "meta" and ceil["type"] == "ceilings"
    assert ceil["copy_gbps"] > 0 and ceil["matmul_tflops"] > 0
    assert [[r["shape"], r["kind"], r["T"], r["impl"]] for r in body] == meta["planned"]
    d, f, k = 64, 32, 4  # the dry-run Qwen3.6 layer (gpu_common.layer_config)
    timed = [r for r in body if "ms" in r]
    assert {r["impl"] for r in timed} == {"xla", "pallas", "pallas_fma", "ragged_dot", "tokamax"}
    for r in timed:
        assert r["ms"] > 0 and r["n_iter"] % r["R"] == 0 and r["loop_us"] > 0, r
        assert r["flops"] == 2 * 3 * r["T"] * k * d * f, r
        assert r["bytes"] > r["experts_used"] * 3 * d * f, r  # stored bytes >= 1 per weight
        if r["impl"] != "xla":  # every other output compared with xla's, same inputs
            assert r["ok"] and r["rel_err_vs_xla"] < 1e-3, r
    skipped = [r for r in body if "ms" not in r]
    want = [("bf16", 40, "pallas_fma"), ("q8_0", 40, "pallas_fma"), ("q8_0", 40, "tokamax")]  # fma: decode only
    assert [(r["kind"], r["T"], r["impl"]) for r in skipped] == want, skipped
    assert [r["T"] for r in timed if r["impl"] == "pallas_fma"] == [1]
    pallas = {r["T"]: r for r in timed if r["impl"] == "pallas" and r["kind"] == "bf16"}
    assert pallas[1]["R"] == 2 and 0 <= pallas[1]["reuse_prev"] <= 1


@pytest.mark.slow
def test_dry_run_summary(dry_run):
    out, proc = dry_run
    md = (out / "bench.md").read_text()
    assert md.rstrip().endswith("Problems: 0"), md[-2000:]
    assert "# jaxmoe GPU check" in proc.stdout  # printed last, for the device tool's output tail
    targets = md[md.index("## Targets") :]
    assert re.search(r"\| qwen3\.6 \| bf16 \| 1 \| [\d.]+ \| (met|\*\*NOT met\*\*) \(x[\d.]+", targets), targets
    assert re.search(r"\| qwen3\.6 \| bf16 \| 40 \| [\d.]+ \| - \| (met|\*\*NOT met\*\*) \(\d+%", targets), targets


def _row(impl, t, ms, **kw):
    return dict(type="row", shape="s", kind="bf16", T=t, impl=impl, ms=ms, **kw)


def test_summary_verdicts(tmp_path):
    summary = _module("gpu_summary")
    tg = dict(hbm_max_t=16, hbm_factor=1.3, mm_min_t=2048, mm_fraction=0.6)
    rows = [
        _row("pallas", 1, 1.0, x_hbm_floor=1.2, frac_mm=0.01),
        _row("ragged_dot", 1, 3.0),
        _row("pallas", 16, 1.0, x_hbm_floor=1.5, frac_mm=0.05),
        _row("tokamax", 16, 0.5),
        _row("pallas", 2048, 2.0, x_hbm_floor=9.0, frac_mm=0.5),
        dict(type="row", shape="s", kind="bf16", T=2048, impl="tokamax", skipped="phase deadline"),
        _row("pallas", 4096, 2.0, x_hbm_floor=9.0, frac_mm=0.7),
    ]
    v = {x["T"]: x for x in summary.targets(rows, tg)}
    assert v[1]["hbm"].startswith("met (x1.20") and v[1]["mm"] == "-"
    assert v[1]["vs_ragged_dot"] == "3.00x faster" and v[1]["vs_tokamax"] == "n/a"
    assert v[16]["hbm"].startswith("**NOT met** (x1.50") and v[16]["vs_tokamax"] == "**0.50x: slower**"
    assert v[2048]["hbm"] == "-" and v[2048]["mm"].startswith("**NOT met** (50%")
    assert v[2048]["vs_tokamax"].startswith("n/a (phase deadline")
    assert v[4096]["mm"].startswith("met (70%")


def test_summary_counts_missing_and_torn_rows(tmp_path):
    """A timing phase killed mid-row: its finished rows are kept, the rest named missing."""
    summary = _module("gpu_summary")
    meta = dict(type="meta", planned=[["s", "bf16", 1, "xla"], ["s", "bf16", 1, "pallas"]], targets=None)
    done = dict(type="row", shape="s", kind="bf16", T=1, impl="xla", skipped="phase deadline")
    (tmp_path / "bench.jsonl").write_text(json.dumps(meta) + "\n" + json.dumps(done) + '\n{"type": "ro')
    text, problems = summary.markdown(tmp_path, ["check:0:10:135", "bench:124:270:270"])
    assert "1 planned rows never written" in text and "s/bf16/1/pallas" in text
    assert "| bench | 124 (timed out) |" in text
    assert problems == 2  # the timed-out phase and the missing row


@pytest.mark.slow
def test_timing_phase_deadline_skips_rows_in_plan_order(tmp_path):
    """Past its deadline the timing phase still writes every planned row, as skipped."""
    bench = _module("gpu_bench")
    assert bench.main(["--out", str(tmp_path), "--dry-run", "--deadline", "0"]) == 0
    rows = _rows(tmp_path / "bench.jsonl")
    body = [r for r in rows if r["type"] == "row"]
    assert [[r["shape"], r["kind"], r["T"], r["impl"]] for r in body] == rows[0]["planned"]
    assert {r.get("skipped") for r in body} == {"phase deadline"}

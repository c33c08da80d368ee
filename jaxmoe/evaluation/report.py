"""What an eval run leaves behind: its run directory, ``report.md`` (tables a person
reads) and the terminal summary, from a results mapping."""

from __future__ import annotations

import datetime as _dt
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


def make_run_dir(output_dir: str | os.PathLike, name: str, out: str | os.PathLike | None = None) -> Path:
    """``out`` if given, else ``<output_dir>/<name>-<UTC timestamp>`` (a fresh directory)."""
    if out is not None:
        d = Path(out)
    else:
        stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%SZ")
        d = Path(output_dir) / f"{name}-{stamp}"
        n = 1
        while d.exists():
            n += 1
            d = Path(output_dir) / f"{name}-{stamp}-{n}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def write_run(cfg, opts, res: dict[str, Any], report: Callable[[dict], str]) -> Path:
    """Writes a run of ``cfg`` (any kind's config) into its run directory (`make_run_dir`):
    ``res`` (with ``opts``' source and overrides, and the directory, recorded in it) as
    ``results.json`` and ``report(res)`` as ``report.md``, printed to ``opts.console``.
    Returns the run directory."""
    console = opts.console or Console()
    res["config_file"] = opts.source
    res["overrides"] = list(opts.overrides)
    run_dir = make_run_dir(cfg.output_dir, cfg.name, opts.out)
    res["run_dir"] = str(run_dir)
    text = report(res)
    (run_dir / "results.json").write_text(json.dumps(res, indent=2))
    (run_dir / "report.md").write_text(text)
    console.print(text, markup=False, highlight=False, soft_wrap=True)
    console.print(f"results: {run_dir}/ (results.json, report.md)", soft_wrap=True)
    return run_dir


def _v(q: dict | None):
    return None if q is None else q.get("value")


def _fmt(x, spec: str = ".3g") -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return format(x, spec)
    return str(x)


def _ms(q) -> str:
    v = _v(q)
    return "-" if v is None else f"{v * 1e3:.4g}"


def _status(r: dict) -> str:
    if r["status"] == "ok":
        return "pass" if r["passed"] else "FAIL"
    return r["status"]


CASE_COLUMNS = (
    "layer",
    "case",
    "ran as",
    "T",
    "rel err",
    "max abs err",
    "routing agree",
    "median ms",
    "IQR ms",
    "min-max ms",
    "tok/s",
    "GB/s",
    "status",
)


def case_rows(res: dict[str, Any]) -> list[list[str]]:
    rows = []
    for lay in res["layers"]:
        for r in lay["results"]:
            if r["status"] != "ok":
                rows.append(
                    [
                        lay["label"],
                        r["case"],
                        r["resolved_impl"],
                        str(r["tokens"]),
                        *["-"] * 8,
                        f"{_status(r)}: {r.get('reason', '')}",
                    ]
                )
                continue
            ran = r["resolved_impl"] + (f" (row {r['measured_as']})" if r.get("measured_as") else "")
            rows.append(
                [
                    lay["label"],
                    r["case"],
                    ran,
                    str(r["tokens"]),
                    _fmt(_v(r["rel_error"])),
                    _fmt(_v(r["max_abs_error"])),
                    _fmt(_v(r["routing_agreement"]), ".3f"),
                    _ms(r["time_median"]),
                    _ms(r["time_iqr"]),
                    f"{_ms(r['time_min'])}-{_ms(r['time_max'])}",
                    _fmt(_v(r["tokens_per_s"]), ".4g"),
                    _fmt(_v(r["bandwidth"]), ".3g"),
                    _status(r)
                    + ("" if r["passed"] else f": {r.get('reason', '')}")
                    + (
                        f" (quantization error {_fmt(_v(r['quantization_error']))} vs float weights, not gated)"
                        if "quantization_error" in r
                        else ""
                    ),
                ]
            )
    return rows


def _md_table(header, rows) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(out)


def render_markdown(res: dict[str, Any], plots: list[str]) -> str:
    """The text of ``report.md``."""
    env = res["environment"]
    cfg = res["config"]
    gate = res["gate"]
    lines = [
        f"# jaxmoe eval: {res['name']}",
        "",
        *([res["description"], ""] if res["description"] else []),
        f"- config: `{res['config_file']}`"
        + (f" with `--set {' '.join(res['overrides'])}`" if res["overrides"] else ""),
        f"- started {res['started_utc']}, wall time {_v(res['wall_time']):.1f} s",
        f"- device: {env['platform']} ({env['device_kind']}, {env['device_count']} device(s)), "
        f"{env['host_cpus']} host CPUs, jax {env['jax']}, jaxmoe {env['jaxmoe']}, "
        f"host memory: {env.get('host_memory', 'default')}",
        f"- reference: `{cfg['reference']['impl']}` on the first {cfg['reference']['max_tokens']} tokens; "
        f"error = max abs error / max abs reference output",
        f"- timing: median of up to {cfg['repeats']} calls"
        + (f" (fewer once they exceed {cfg['time_budget_s']} s, at least 3)" if cfg.get("time_budget_s") else "")
        + f" after the compile call and {cfg['warmup']} warm-up call(s); "
        "bandwidth = weight bytes that must be read (distinct experts touched + shared + router) / median time",
        "- `auto` rows that resolve to an impl measured in the same run reuse that row's measurement "
        "(`ran as ... (row ...)`): the same jitted function",
        f"- **gate: {'PASSED' if gate['passed'] else 'FAILED'}** ({gate['checked']} cases checked, "
        f"{gate['skipped']} skipped by impl_max_tokens)",
        "",
    ]
    if gate["failures"]:
        lines += ["## Failures", ""] + [f"- {f}" for f in gate["failures"]] + [""]
    lines += ["## Accuracy and speed", "", _md_table(CASE_COLUMNS, case_rows(res)), ""]
    lines += ["## Routing statistics per layer", ""]
    hdr = (
        "layer",
        "E",
        "k",
        "tokens",
        "max/mean load",
        "CV",
        "idle experts",
        "load entropy (bits)",
        "routing entropy (nats)",
        "mean top-1 weight",
        "shared gate mean",
        "weights MB",
        "ref s",
    )
    rows = []
    for lay in res["layers"]:
        s = lay["stats"]
        mc = lay["moe_config"]
        rows.append(
            [
                lay["label"],
                str(mc["router"]["num_experts"]),
                str(mc["router"]["top_k"]),
                str(_v(s["tokens"])),
                _fmt(_v(s["load_max_over_mean"])),
                _fmt(_v(s["load_cv"])),
                str(_v(s["idle_experts"])),
                f"{_v(s['load_entropy']):.2f} / {_v(s['load_entropy_max']):.2f}",
                f"{_v(s['routing_entropy']):.3f} / {_v(s['routing_entropy_max']):.3f}",
                _fmt(_v(s["mean_top1_weight"])),
                _fmt(_v(s["shared_gate_mean"])),
                f"{sum(_v(lay['weight_bytes'][k]) for k in ('experts', 'shared', 'router')) / 1e6:.1f}",
                f"{_v(lay['reference']['time']):.2f}",
            ]
        )
    lines += [_md_table(hdr, rows), ""]
    if plots:
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    return "\n".join(lines)


def summary_table(res: dict[str, Any]) -> Table:
    """The short table printed at the end of a run (one section per layer)."""
    gate = res["gate"]
    tab = Table(
        title=f"jaxmoe eval {res['name']}: gate {'passed' if gate['passed'] else 'FAILED'} "
        f"({_v(res['wall_time']):.1f} s)",
        box=None,
        padding=(0, 1),
        pad_edge=False,
        header_style="bold underline",
    )
    tab.add_column("case (ran as)", no_wrap=True, overflow="fold")
    for c, w in (("T", 4), ("rel err", 7), ("agree", 5), ("median ms", 9), ("tok/s", 7), ("GB/s", 5)):
        tab.add_column(c, justify="right", no_wrap=True, min_width=w)
    tab.add_column("status", no_wrap=True, min_width=5)
    for lay in res["layers"]:
        tab.add_row(f"[bold]{lay['label']}[/]")
        for r in lay["results"]:
            case = r["case"]
            if r["resolved_impl"] != r["impl"].split(",")[0]:  # the label: impl[,field=value...]
                impl, _, rest = case.partition("/")
                case = f"{impl}({r['resolved_impl']})/{rest}"
            if r["status"] != "ok":
                tab.add_row(
                    case, str(r["tokens"]), *["-"] * 5, r["status"], style="dim" if r["status"] == "skipped" else "red"
                )
                continue
            tab.add_row(
                case,
                str(r["tokens"]),
                _fmt(_v(r["rel_error"]), ".2g"),
                _fmt(_v(r["routing_agreement"]), ".2f"),
                _ms(r["time_median"]),
                _fmt(_v(r["tokens_per_s"]), ".0f" if _v(r["tokens_per_s"]) >= 10 else ".2g"),
                _fmt(_v(r["bandwidth"]), ".2g"),
                "pass" if r["passed"] else "FAIL",
                style=None if r["passed"] else "red",
            )
        tab.add_section()
    return tab

"""Runs a ``default``-kind `EvalConfig`: every layer, case (impl x dtype x quantize) and token count.

For each layer: build the weights, draw the activations, compute the reference (the
float64 numpy forward on the first ``reference.max_tokens`` tokens, or a named impl),
the routing statistics (float64 routing of ``inputs.stats_tokens`` tokens), then per
case and token count run the jitted `jaxmoe.layer.moe_apply` (first call = compile, then
``warmup`` untimed calls, then ``repeats`` timed calls) and compare its output and
routing with the reference. `run_eval` returns the ``results.json`` mapping; the
``gate`` entry says whether every case met its tolerance. `run` also writes the run
directory: ``results.json``, ``report.md``, ``config.yaml`` (the resolved config) and
the PNG plots.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import importlib.metadata
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import jaxmoe.evaluation.metrics as M
import jaxmoe.evaluation.plots as P
import jaxmoe.evaluation.report as R
from jaxmoe.evaluation.config import FLOAT64_REFERENCE, EvalConfig, case_label, case_tolerance
from jaxmoe.evaluation.reference import reference_forward, route_f64, router_logits_f64, to_f64
from jaxmoe.evaluation.schema import RunOptions
from jaxmoe.evaluation.sources import LayerSpec, case_params, layer_specs, load_inputs, load_params
from jaxmoe.execution import ExecConfig
from jaxmoe.host_memory import host_memory_mode
from jaxmoe.impls.policy import ggml_table, resolve_impl
from jaxmoe.impls.registry import available_impls
from jaxmoe.layer import moe_apply

SCHEMA = "jaxmoe.eval/1"

#: `jaxmoe.layer.moe_apply` jitted with ``cfg``, ``ex``, ``impl`` and ``return_routing``
#: static: the function every case times.
moe_apply_jit = jax.jit(moe_apply, static_argnames=("cfg", "ex", "impl", "return_routing"))


def _call(params, x, cfg, ex: ExecConfig):
    y, r = moe_apply_jit(params, x, cfg=cfg, ex=ex, return_routing=True)
    return jax.block_until_ready((y, r))


def _resolved(ex: ExecConfig, t: int, cfg, params, dtype) -> str:
    """The impl the entry ``ex`` runs for ``t`` tokens of ``params`` in ``dtype`` (under
    ``auto`` with ``activations: ggml``, auto's XLA fallback where its choice lacks the mode)."""
    name = resolve_impl(ex.impl, t * cfg.top_k, experts=params.experts, dtype=dtype)
    if ex.impl == "auto" and ex.activations == "ggml":
        name = ggml_table({"host": name}, ex, t * cfg.top_k, params.experts)["host"]
    return name


def package_version() -> str:
    """The installed jaxmoe version (``unknown`` when run from a checkout that is not installed)."""
    try:
        return importlib.metadata.version("jaxmoe")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _environment() -> dict[str, Any]:
    dev = jax.devices()[0]
    return {
        "jax": jax.__version__,
        "jaxmoe": package_version(),
        "python": platform.python_version(),
        "platform": dev.platform,
        "device_kind": dev.device_kind,
        "device_count": jax.device_count(),
        "host_cpus": os.cpu_count(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "host_memory": host_memory_mode(),
        "impls_available": available_impls(),
    }


class _NullProgress:
    def advance(self, msg: str = "") -> None:
        pass


def _layer_stats(spec: LayerSpec, params, xs: np.ndarray, heat_tokens: int) -> dict[str, Any]:
    """Routing statistics of ``xs [N, d]`` under the float64 routing."""
    cfg = spec.cfg
    sb = None if params.selection_bias is None else to_f64(params.selection_bias)
    r = route_f64(router_logits_f64(params, xs), cfg.router, sb)
    ld = M.load_stats(r.expert_ids, cfg.num_experts)
    gate_mean = None
    if params.shared is not None and params.shared.gate is not None:
        g = 1.0 / (1.0 + np.exp(-(np.asarray(xs, np.float64) @ to_f64(params.shared.gate))))
        gate_mean = float(g.mean())
    h = min(heat_tokens, xs.shape[0])
    return {
        "tokens": M.quantity(int(xs.shape[0]), "tokens"),
        "expert_load": M.quantity(ld["counts"], "(token, slot) pairs"),
        "load_max_over_mean": M.quantity(ld["max_over_mean"], "ratio"),
        "load_cv": M.quantity(ld["cv"], "ratio (std/mean)"),
        "idle_experts": M.quantity(ld["idle"], "experts"),
        "load_entropy": M.quantity(ld["load_entropy_bits"], "bits"),
        "load_entropy_max": M.quantity(ld["max_entropy_bits"], "bits"),
        "routing_entropy": M.quantity(M.routing_entropy(r.scores), "nats (mean per token)"),
        "routing_entropy_max": M.quantity(float(np.log(cfg.num_experts)), "nats"),
        "mean_top1_weight": M.quantity(M.mean_top1_weight(r.weights), "weight"),
        "shared_gate_mean": M.quantity(
            gate_mean, "sigmoid gate" if gate_mean is not None else "none (no gated shared expert)"
        ),
        "sample": {"tokens": h, "expert_ids": r.expert_ids[:h].tolist(), "weights": r.weights[:h].tolist()},
    }


def _reference(spec: LayerSpec, ecfg: EvalConfig, params, x_route: np.ndarray, n_out: int):
    """The configured reference: (``y [n_out, d]`` float64, ``ids [N, k]``, seconds).

    The float64 reference routes all ``N`` tokens of ``x_route`` (cheap) and computes the
    output of the first ``n_out`` (each touched expert converted to float64); an impl
    reference runs on the first ``n_out`` tokens only.
    """
    t0 = time.perf_counter()
    impl = ecfg.ref.impl
    if impl == FLOAT64_REFERENCE:
        sb = None if params.selection_bias is None else to_f64(params.selection_bias)
        r_all = route_f64(router_logits_f64(params, x_route), spec.cfg.router, sb)
        y, r = reference_forward(params, x_route[:n_out], spec.cfg)
        if not np.array_equal(r.expert_ids, r_all.expert_ids[:n_out]):  # same math, same rows
            raise AssertionError("float64 reference routing is not deterministic")
        ids = r_all.expert_ids
    else:
        y, r = _call(params, jnp.asarray(x_route[:n_out], ecfg.model.dtype), spec.cfg, ExecConfig(impl=impl))
        y, ids = np.asarray(y, np.float64), np.asarray(r.expert_ids)
    return y, ids, time.perf_counter() - t0


def _run_case(spec, ecfg, params, wb, x_in, y_ref, ids_ref, ex, dtype, quant, t, y_float=None) -> dict[str, Any]:
    """One measured case of the ``impls:`` entry ``ex``. ``y_ref`` is the gate's reference:
    for a quantized case the float64 forward of the DEQUANTIZED case weights (kernel
    correctness), for an entry with ``activations: ggml`` that forward with ggml's
    activation conversions. ``y_float``, when given, is the float64 forward of the float
    (base) weights with float activations: the case's error against it is reported
    (``quantization_error``), never gated."""
    cfg = spec.cfg
    resolved = _resolved(ex, t, cfg, params, dtype)
    row: dict[str, Any] = {
        "case": case_label(ex, dtype, quant),
        "impl": ex.label,
        "resolved_impl": resolved,
        "dtype": dtype,
        "quantize": quant,
        "tokens": t,
    }
    caps = [ecfg.impl_max_tokens[n] for n in {ex.label, ex.impl, resolved} if n in ecfg.impl_max_tokens]
    if caps and t > min(caps):
        row.update(status="skipped", reason=f"tokens {t} > impl_max_tokens {min(caps)} for {resolved}")
        return row
    x = jnp.asarray(x_in[:t], dtype)
    try:
        t0 = time.perf_counter()
        y, r = _call(params, x, cfg, ex)
        first = time.perf_counter() - t0
        for _ in range(ecfg.warmup):
            _call(params, x, cfg, ex)
        samples: list[float] = []
        budget = ecfg.time_budget_s
        while len(samples) < ecfg.repeats:
            if budget is not None and sum(samples) > budget and len(samples) >= min(3, ecfg.repeats):
                break
            t0 = time.perf_counter()
            _call(params, x, cfg, ex)
            samples.append(time.perf_counter() - t0)
    except Exception as e:  # an impl that fails on this case is a recorded failure, not a crash
        row.update(status="error", reason=f"{type(e).__name__}: {e}")
        return row
    n = min(t, y_ref.shape[0])
    err = M.errors(np.asarray(y[:n], np.float64), y_ref[:n])
    if y_float is not None:
        q_err = M.errors(np.asarray(y[:n], np.float64), y_float[:n])
        row["quantization_error"] = M.quantity(
            q_err["rel"], "ratio vs the float64 forward of the float weights, float activations (not gated)"
        )
    ids = np.asarray(r.expert_ids)
    n_route = min(t, ids_ref.shape[0])
    agree = M.routing_agreement(ids[:n_route], ids_ref[:n_route])
    tm = M.timing(samples, t)
    nbytes, touched = M.bytes_to_read(wb, ids)
    row.update(
        status="ok",
        finite=err["finite"],
        compared_tokens=M.quantity(n, "tokens (output error)"),
        routed_tokens=M.quantity(n_route, "tokens (routing agreement)"),
        max_abs_error=M.quantity(err["max_abs"], "abs (output units)"),
        rel_error=M.quantity(err["rel"], "ratio (max|err| / max|ref|)"),
        rms_rel_error=M.quantity(err["rms_rel"], "ratio (||err||_2 / ||ref||_2)"),
        routing_agreement=M.quantity(agree, "fraction of tokens with the reference's expert set"),
        first_call=M.quantity(first, "s (includes compile)"),
        time_median=M.quantity(tm["median_s"], "s"),
        time_q1=M.quantity(tm["q1_s"], "s"),
        time_q3=M.quantity(tm["q3_s"], "s"),
        time_iqr=M.quantity(tm["iqr_s"], "s"),
        time_min=M.quantity(tm["min_s"], "s"),
        time_max=M.quantity(tm["max_s"], "s"),
        repeats=M.quantity(len(samples), "calls"),
        tokens_per_s=M.quantity(tm["tokens_per_s"], "tokens/s"),
        experts_touched=M.quantity(touched, "experts"),
        weight_bytes_read=M.quantity(nbytes, "B"),
        bandwidth=M.quantity(nbytes / tm["median_s"] / 1e9, "GB/s (weight bytes read / median time)"),
    )
    return row


def judge(row: dict[str, Any], ex: ExecConfig, ecfg: EvalConfig) -> dict[str, Any]:
    """Sets ``tolerance``, ``passed`` and (when failing) ``reason`` of a measured case row
    of the entry ``ex``."""
    tol = case_tolerance(ecfg, ex, row["dtype"], row["quantize"])
    row["tolerance"] = M.quantity(tol, "ratio")
    if row["status"] != "ok":
        return row
    rel = row["rel_error"]["value"]
    agree = row["routing_agreement"]["value"]
    why = []
    if not row["finite"]:
        why.append("non-finite output")
    elif rel > tol:
        why.append(f"rel_error {rel:.3g} > tolerance {tol:.3g}")
    if agree < ecfg.min_routing_agreement:
        why.append(f"routing_agreement {agree:.3f} < {ecfg.min_routing_agreement}")
    row["passed"] = not why
    row.pop("reason", None)
    if why:
        row["reason"] = "; ".join(why)
    return row


def count_steps(ecfg: EvalConfig, specs: list[LayerSpec]) -> int:
    cases = len(ecfg.impls) * len(ecfg.case_dtypes) * len(ecfg.quantize) * len(ecfg.tokens)
    return len(specs) * (2 + cases)


def run_eval(
    ecfg: EvalConfig,
    *,
    source: str = "<config>",
    specs: list[LayerSpec] | None = None,
    progress=None,
    overrides: list[str] | None = None,
) -> dict[str, Any]:
    """Runs ``ecfg``; returns the ``results.json`` mapping (no files written).

    ``progress`` is any object with ``advance(msg)`` (one call per step of `count_steps`).
    """
    progress = progress or _NullProgress()
    specs = specs if specs is not None else layer_specs(ecfg, source)
    t_start = time.perf_counter()
    started = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    tmax = max(ecfg.tokens)
    layers = []
    for spec in specs:
        cfg = spec.cfg
        t0 = time.perf_counter()
        base = load_params(spec, ecfg)
        jax.block_until_ready(base)
        t_load = time.perf_counter() - t0
        progress.advance(f"{spec.label}: weights")
        x_all = load_inputs(spec, ecfg, max(tmax, ecfg.inputs.stats_tokens))
        # the reference and every case see the activations rounded to the parameter dtype, as
        # the model would (a float32 case of a bfloat16 model computes from the same inputs)
        x_base = np.asarray(jnp.asarray(x_all, ecfg.model.dtype).astype(jnp.float32))
        n_ref = min(ecfg.ref.max_tokens, tmax)
        y_ref, ids_ref, t_ref = _reference(spec, ecfg, base, x_base[:tmax], n_ref)
        stats = _layer_stats(spec, base, x_base[: ecfg.inputs.stats_tokens], ecfg.heatmap_tokens)
        progress.advance(f"{spec.label}: reference")
        rows = []
        for dtype in ecfg.case_dtypes:
            for quant in ecfg.quantize:
                params = case_params(base, dtype, quant)
                # quantized case: gate against the float64 forward of its dequantized weights
                # (same router, so same routing), report the error against the float weights
                y_case, y_float = y_ref, None
                if quant != "none" and ecfg.ref.impl == FLOAT64_REFERENCE:
                    y_case, y_float = reference_forward(params, x_base[:n_ref], cfg)[0], y_ref
                # an entry in llama.cpp's arithmetic (activations: ggml): gated against the
                # float64 forward that converts the activations as ggml does; its error
                # against the float-activation forward of the base weights is reported
                y_ggml = None
                if ecfg.ref.impl == FLOAT64_REFERENCE and any(e.activations == "ggml" for e in ecfg.impls):
                    y_ggml = reference_forward(params, x_base[:n_ref], cfg, activations="ggml")[0]
                wb = M.weight_bytes(params)
                done: dict[tuple[ExecConfig, int], dict[str, Any]] = {}
                # concrete impls first, so an `auto` entry that resolves to another entry (the
                # same but for the impl) reuses its measurement
                for ex in sorted(ecfg.impls, key=lambda e: e.impl == "auto"):
                    for t in ecfg.tokens:
                        same = dataclasses.replace(ex, impl=_resolved(ex, t, cfg, params, dtype))
                        if ex.impl == "auto" and (same, t) in done:
                            row = dict(
                                done[(same, t)],
                                case=case_label(ex, dtype, quant),
                                impl=ex.label,
                                measured_as=case_label(same, dtype, quant),
                            )
                        else:
                            ggml = y_ggml is not None and ex.activations == "ggml"
                            row = _run_case(
                                spec,
                                ecfg,
                                params,
                                wb,
                                x_base,
                                y_ggml if ggml else y_case,
                                ids_ref,
                                ex,
                                dtype,
                                quant,
                                t,
                                y_ref if ggml else y_float,
                            )
                        done[(ex, t)] = judge(row, ex, ecfg)
                        progress.advance(f"{spec.label}: {case_label(ex, dtype, quant)} T={t}")
                for ex in ecfg.impls:
                    rows.extend(done[(ex, t)] for t in ecfg.tokens)
                del params
        wb_base = M.weight_bytes(base)
        del base
        layers.append(
            {
                "label": spec.label,
                "model": spec.model,
                "layer": spec.layer,
                "weights": "checkpoint" if spec.checkpoint else f"random (seed {ecfg.model.seed})",
                "moe_config": cfg.to_dict(),
                "weight_bytes": {k: M.quantity(v, "B") for k, v in wb_base.items()},
                "load_time": M.quantity(t_load, "s"),
                "reference": {
                    "impl": ecfg.ref.impl,
                    "tokens": M.quantity(n_ref, "tokens"),
                    "time": M.quantity(t_ref, "s"),
                },
                "stats": stats,
                "results": rows,
            }
        )
    failures = [
        f"{lay['label']} {r['case']} T={r['tokens']}: {r.get('reason', r['status'])}"
        for lay in layers
        for r in lay["results"]
        if r["status"] == "error" or (r["status"] == "ok" and not r["passed"])
    ]
    return {
        "schema": SCHEMA,
        "name": ecfg.name,
        "description": ecfg.description,
        "config_file": source,
        "overrides": list(overrides or []),
        "config": ecfg.to_dict(),
        "started_utc": started,
        "wall_time": M.quantity(time.perf_counter() - t_start, "s"),
        "environment": _environment(),
        "layers": layers,
        "gate": {
            "passed": not failures,
            "failures": failures,
            "checked": sum(r["status"] != "skipped" for lay in layers for r in lay["results"]),
            "skipped": sum(r["status"] == "skipped" for lay in layers for r in lay["results"]),
        },
    }


class _Bar:
    def __init__(self, prog, task):
        self.prog, self.task = prog, task

    def advance(self, msg: str = "") -> None:
        self.prog.update(self.task, advance=1, description=msg)


def run(ecfg: EvalConfig, opts: RunOptions | None = None) -> tuple[dict, Path]:
    """Runs ``ecfg`` and writes the run directory (``out``, else ``<output_dir>/<name>-<UTC
    timestamp>``). Returns (results mapping, run directory); ``results["gate"]["passed"]``
    says whether every case met its tolerance."""
    opts = opts or RunOptions()
    source, out, overrides, progress = opts.source, opts.out, list(opts.overrides), opts.progress
    console = opts.console or Console()
    specs = layer_specs(ecfg, source)
    run_dir = R.make_run_dir(ecfg.output_dir, ecfg.name, out)
    if progress:
        with Progress(
            TextColumn("[bold]{task.description:<48}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=False,
        ) as prog:
            task = prog.add_task(f"{ecfg.name}: starting", total=count_steps(ecfg, specs))
            res = run_eval(ecfg, source=source, specs=specs, progress=_Bar(prog, task), overrides=overrides)
    else:
        res = run_eval(ecfg, source=source, specs=specs, overrides=overrides)
    res["run_dir"] = str(run_dir)
    names = P.write_plots(res, run_dir) if ecfg.plots else []
    res["plots"] = names
    with open(run_dir / "results.json", "w") as f:
        json.dump(res, f, indent=1, allow_nan=False)
    with open(run_dir / "config.yaml", "w") as f:
        yaml.safe_dump(ecfg.to_dict(), f, sort_keys=False)
    (run_dir / "report.md").write_text(R.render_markdown(res, names))
    console.print(R.summary_table(res))
    for fail in res["gate"]["failures"]:
        console.print(f"[red]FAIL[/] {fail}")
    console.print(f"results: {run_dir}/ (results.json, report.md{''.join(', ' + n for n in names)})")
    return res, run_dir

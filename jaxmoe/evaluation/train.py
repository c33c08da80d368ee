"""The ``train`` kind of eval run (``configs/evals/train.yaml``): one training step per impl.

Run it with ``jaxmoe eval train [--set key=value ...] [--out DIR]``.

For every token count ``T`` and impl it differentiates the scalar ``L = sum(g * y)`` of
one MoE layer (``y = moe_apply(params, x)``, ``g`` a fixed random cotangent ``[T, d]``)
with respect to every parameter and ``x`` (``jax.value_and_grad``, jitted) and records:

- ``step_ms``: the forward + backward step, ``fwd_ms``: the forward alone (``L``), both
  the best and median of the timed calls (each call on new tokens; the first call,
  which compiles, is not timed; timing stops after ``time_budget_s`` once one call ran);
- ``grad_err``: per parameter group (``x``, ``router``, ``experts``, ``shared``) the max
  relative difference ``max|grad - ref| / max|ref|`` from the float64 reference, and
  their max, the gate (within ``tolerance``);
- the same for the Hugging Face block (``hf: true``; Qwen3.6-family presets): torch's
  ``loss.backward()`` through ``Qwen3_5MoeSparseMoeBlock`` holding the same weights, and
  ``vs_hf = hf best step / impl best step`` (> 1: the impl is faster).

The float64 reference (`reference_grads`) is written from the layer's rules, not from
jaxmoe's kernels: routing by `jaxmoe.evaluation.reference.route_f64`, then a numpy loop
over experts with the SwiGLU derivative by hand, the routing-weight gradient ``dL/dw =
<dy, expert output>`` and the derivative of the weight rule (score function, top-k
softmax / sigmoid, renormalization, scaling) back to the logits and the router. The
selection itself has no gradient. A token whose float32 selection differs from the
float64 one (a near tie) makes the comparison meaningless: such a case is recorded with
its routing agreement, status ``flip``, and fails the gate only below
``min_routing_agreement``.

Schema (`TrainEvalConfig`; every key checked, unknown keys are errors naming the key)::

    kind: train
    name: train
    description: ...
    model: {preset: qwen3.6-35b-a3b, shrink: {d_model, expert_dim, ...}, seed: 0}
    inputs: {seed: 0, scale: 1.0}
    impls: [auto, cpu]             # impl names or mappings of ExecConfig fields ({impl: cpu, batch_invariant: true})
    tokens: [64, 256]
    impl_max_tokens: {gather: 8}   # by impl or entry label; cases above the cap are recorded as skipped
    hf: true                       # time the HF torch block (qwen3.6-family presets)
    hf_threads: 2
    repeats: 5
    time_budget_s: 10.0
    tolerance: 1.0e-4
    min_routing_agreement: 1.0
    output_dir: runs

It writes ``results.json`` and ``report.md`` to ``--out`` or
``<output_dir>/<name>-<UTC timestamp>``. Routed experts with the ``swiglu_oai`` activation
or biases (gpt-oss) have no reference here (a config error).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from rich.console import Console

from jaxmoe.config import MoEConfig, RouterConfig, load_config
from jaxmoe.evaluation.hf_block import qwen35_moe_block
from jaxmoe.evaluation.presets import PresetSection
from jaxmoe.evaluation.reference import RefRouting, route_f64, router_logits_f64, to_f64
from jaxmoe.evaluation.report import write_run
from jaxmoe.evaluation.schema import Context, RunConfig, RunOptions, mapping_reader
from jaxmoe.execution import ExecConfig
from jaxmoe.host_memory import host_memory_mode
from jaxmoe.impls.registry import available_impls
from jaxmoe.layer import moe_apply
from jaxmoe.params import MoEParams, init_params

KIND = "train"
#: Parameter groups of the gradient error.
GROUPS = ("x", "router", "experts", "shared")
#: Presets whose layer the Hugging Face ``Qwen3_5MoeSparseMoeBlock`` computes.
HF_PRESETS = ("qwen3.6-35b-a3b",)


@dataclasses.dataclass(frozen=True)
class TrainInputsSection:
    """Seeded normal activations ``scale * N(0, 1)`` and cotangent ``N(0, 1)``."""

    seed: int = 0
    scale: float = 1.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainEvalConfig(RunConfig):
    """One ``train`` eval run (see the module docstring for the YAML form)."""

    kind: Literal["train"] = KIND
    model: PresetSection
    inputs: TrainInputsSection = TrainInputsSection()
    impls: tuple[ExecConfig, ...] = (ExecConfig(),)
    tokens: tuple[int, ...] = (64,)
    impl_max_tokens: dict[str, int] = dataclasses.field(default_factory=dict)
    hf: bool = False
    hf_threads: int = 2
    repeats: int = 5
    time_budget_s: float = 10.0
    tolerance: float = 1e-4
    min_routing_agreement: float = 1.0


def check(cfg: TrainEvalConfig, ctx: Context) -> None:
    """Checks values beyond their types: known preset with a reference, sizes, impls."""
    ctx.check_preset("model.preset", cfg.model.preset)
    ctx.check_shrink("model.shrink", cfg.model.shrink, load_config(cfg.model.preset))
    mcfg = cfg.model.config()
    if mcfg.activation != "swiglu" or mcfg.expert_bias:
        ctx.fail(
            "model.preset",
            f"{cfg.model.preset!r} ({mcfg.activation}, expert_bias={mcfg.expert_bias}) has no float64 "
            "backward reference here: swiglu experts without biases only",
        )
    if cfg.hf and cfg.model.preset not in HF_PRESETS:
        ctx.fail("hf", f"the Hugging Face block is Qwen3_5MoeSparseMoeBlock: presets {HF_PRESETS} only")
    impls = available_impls()
    ctx.check_execs("impls", cfg.impls, impls)
    ctx.check_caps("impl_max_tokens", cfg.impl_max_tokens, cfg.impls, impls)
    ctx.check_list("tokens", cfg.tokens)
    for key in ("repeats", "hf_threads"):
        ctx.check_min(key, getattr(cfg, key))
    for key in ("time_budget_s", "tolerance"):
        ctx.check_positive(key, getattr(cfg, key))
    ctx.check_fraction("min_routing_agreement", cfg.min_routing_agreement)
    ctx.check_name(cfg.name)


config_from_mapping = mapping_reader(TrainEvalConfig, check, default_name=KIND)


# --------------------------------------------------------------------------- float64 reference


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def weights_backward(z: np.ndarray, ids: np.ndarray, dw: np.ndarray, rc: RouterConfig) -> np.ndarray:
    """``dL/dz [T, E]`` from ``dL/dw [T, k]`` through the weight rule of docs/routing.md
    (the selection ``ids`` fixed): score (``s[ids]``, or softmax / sigmoid of the selected
    logits), renormalization ``r / den`` with its floor, the routed scaling factor."""
    z = np.asarray(z, np.float64)
    if rc.score_fn == "softmax_topk":
        raw = _softmax(np.take_along_axis(z, ids, axis=-1))
    elif rc.score_fn == "sigmoid_topk":
        raw = _sigmoid(np.take_along_axis(z, ids, axis=-1))
    else:
        s = _softmax(z) if rc.score_fn == "softmax" else _sigmoid(z)
        raw = np.take_along_axis(s, ids, axis=-1)
    d = dw * rc.routed_scaling_factor
    if rc.renorm != "none":
        tot = raw.sum(axis=-1, keepdims=True)
        den = {"sum": tot, "clamp": np.maximum(tot, rc.renorm_eps), "add": tot + rc.renorm_eps}[rc.renorm]
        # w = r / den: dr = d / den - sum(d r) / den^2 where den follows sum(r)
        follows = np.ones_like(tot) if rc.renorm != "clamp" else (tot > rc.renorm_eps).astype(np.float64)
        d = d / den - follows * (d * raw).sum(axis=-1, keepdims=True) / den**2
    dz = np.zeros_like(z)
    if rc.score_fn == "softmax_topk":
        dsel = raw * (d - (d * raw).sum(axis=-1, keepdims=True))
        np.put_along_axis(dz, ids, dsel, axis=-1)
    elif rc.score_fn == "sigmoid_topk":
        np.put_along_axis(dz, ids, d * raw * (1.0 - raw), axis=-1)
    else:
        ds = np.zeros_like(z)
        np.put_along_axis(ds, ids, d, axis=-1)
        dz = s * (ds - (ds * s).sum(axis=-1, keepdims=True)) if rc.score_fn == "softmax" else ds * s * (1.0 - s)
    return dz


def _swiglu_fwd_bwd(xin, wg, wu, wd, dout):
    """SwiGLU ``silu(xin wg) * (xin wu) @ wd`` and its gradients for the cotangent ``dout``:
    ``(out, dxin, dwg, dwu, dwd)``."""
    hg, hu = xin @ wg, xin @ wu
    sg = _sigmoid(hg)
    act = hg * sg
    a = act * hu
    out = a @ wd
    da = dout @ wd.T
    dhu = da * act
    dhg = da * hu * sg * (1.0 + hg * (1.0 - sg))
    return out, dhg @ wg.T + dhu @ wu.T, xin.T @ dhg, xin.T @ dhu, a.T @ dout


def reference_grads(
    params: MoEParams, x: np.ndarray, g: np.ndarray, cfg: MoEConfig, visit: Callable[[int, dict], None]
) -> tuple[dict[str, np.ndarray], RefRouting]:
    """Float64 gradients of ``L = sum(g * layer(x))`` (swiglu experts without biases).

    ``visit(e, {"experts.w_gate": [d, F], "experts.w_up": [d, F], "experts.w_down": [F, d]})``
    is called for every expert ``e`` in order (zeros for an expert no token chose), so the
    full-size expert gradients never exist at once. Returns the other gradients by name
    (``x``, ``w_router``, ``b_router``, ``shared.w_gate``, ``shared.w_up``, ``shared.w_down``,
    ``shared.gate``, those the layer has) and the float64 routing.
    """
    x = np.asarray(x, np.float64)
    g = np.asarray(g, np.float64)
    z = router_logits_f64(params, x)
    sb = None if params.selection_bias is None else to_f64(params.selection_bias)
    r = route_f64(z, cfg.router, sb)
    ew = params.experts
    dx = np.zeros_like(x)
    dw = np.zeros_like(r.weights)
    for e in range(cfg.num_experts):
        tok, slot = np.nonzero(r.expert_ids == e)
        if tok.size == 0:
            f, d = cfg.expert_dim, cfg.d_model
            visit(
                e,
                {
                    "experts.w_gate": np.zeros((d, f)),
                    "experts.w_up": np.zeros((d, f)),
                    "experts.w_down": np.zeros((f, d)),
                },
            )
            continue
        w = r.weights[tok, slot][:, None]
        dy = g[tok]
        xin = x[tok] * w if cfg.weight_on_input else x[tok]
        dout = dy if cfg.weight_on_input else dy * w
        out, dxin, dwg, dwu, dwd = _swiglu_fwd_bwd(
            xin, to_f64(ew.w_gate, e), to_f64(ew.w_up, e), to_f64(ew.w_down, e), dout
        )
        if cfg.weight_on_input:
            dw[tok, slot] = (dxin * x[tok]).sum(-1)
            np.add.at(dx, tok, dxin * w)
        else:
            dw[tok, slot] = (out * dy).sum(-1)
            np.add.at(dx, tok, dxin)
        visit(e, {"experts.w_gate": dwg, "experts.w_up": dwu, "experts.w_down": dwd})
    dz = weights_backward(z, r.expert_ids, dw, cfg.router)
    small = {"w_router": x.T @ dz}
    dx += dz @ to_f64(params.w_router).T
    if params.b_router is not None:
        small["b_router"] = dz.sum(0)
    sh = params.shared
    if sh is not None:
        gate = None if sh.gate is None else _sigmoid(x @ to_f64(sh.gate))
        dys = g if gate is None else g * gate[:, None]
        out, dxs, dwg, dwu, dwd = _swiglu_fwd_bwd(x, to_f64(sh.w_gate), to_f64(sh.w_up), to_f64(sh.w_down), dys)
        small.update({"shared.w_gate": dwg, "shared.w_up": dwu, "shared.w_down": dwd})
        dx += dxs
        if gate is not None:
            dgz = (out * g).sum(-1) * gate * (1.0 - gate)
            small["shared.gate"] = x.T @ dgz
            dx += dgz[:, None] * to_f64(sh.gate)[None, :]
    small["x"] = dx
    return small, r


def group_of(name: str) -> str:
    """The error group of a gradient name: ``x``, ``router``, ``experts`` or ``shared``."""
    if name == "x":
        return "x"
    if name in ("w_router", "b_router"):
        return "router"
    return name.split(".")[0]


class ErrorAccumulator:
    """Per group ``max|got - ref|`` and ``max|ref|``, fed one tensor at a time."""

    def __init__(self):
        self.diff = dict.fromkeys(GROUPS, 0.0)
        self.ref = dict.fromkeys(GROUPS, 0.0)

    def add(self, name: str, got, ref: np.ndarray) -> None:
        got = np.asarray(got, np.float64)
        if got.shape != ref.shape:
            raise ValueError(f"gradient {name}: shape {got.shape}, reference {ref.shape}")
        grp = group_of(name)
        self.diff[grp] = max(self.diff[grp], float(np.abs(got - ref).max()))
        self.ref[grp] = max(self.ref[grp], float(np.abs(ref).max()))

    def result(self) -> dict[str, float]:
        """``{group: max|got - ref| / max|ref|}`` for the groups seen, and ``max`` over them."""
        out = {k: self.diff[k] / max(self.ref[k], 1e-30) for k in GROUPS if self.ref[k] > 0 or self.diff[k] > 0}
        out["max"] = max(out.values())
        return out


def grad_error(
    params: MoEParams, x, g, cfg: MoEConfig, small: dict[str, Any], expert: Callable[[int], dict]
) -> tuple[dict[str, float], RefRouting]:
    """Relative gradient error per group of one implementation's gradients: ``small`` by
    name (as `reference_grads` returns them) and ``expert(e)`` its per-expert gradients."""
    acc = ErrorAccumulator()
    small_ref, r = reference_grads(
        params, x, g, cfg, lambda e, ref: [acc.add(n, v, ref[n]) for n, v in expert(e).items()]
    )
    for name, ref in small_ref.items():
        acc.add(name, small[name], ref)
    return acc.result(), r


def jax_grads(grads: MoEParams, dx) -> tuple[dict[str, Any], Callable[[int], dict]]:
    """A jax gradient pytree as (``small`` by name, ``expert(e)``) for `grad_error`."""
    small: dict[str, Any] = {"x": np.asarray(dx), "w_router": np.asarray(grads.w_router)}
    if grads.b_router is not None:
        small["b_router"] = np.asarray(grads.b_router)
    sh = grads.shared
    if sh is not None:
        small.update({"shared.w_gate": sh.w_gate, "shared.w_up": sh.w_up, "shared.w_down": sh.w_down})
        if sh.gate is not None:
            small["shared.gate"] = sh.gate
    ew = grads.experts
    wg, wu, wd = (np.asarray(a) for a in (ew.w_gate, ew.w_up, ew.w_down))
    return small, lambda e: {"experts.w_gate": wg[e], "experts.w_up": wu[e], "experts.w_down": wd[e]}


# --------------------------------------------------------------------------- timing


def time_calls(fn: Callable[[int], Any], repeats: int, budget_s: float) -> dict[str, float]:
    """Calls ``fn(i)`` for i = 1..repeats (``fn(0)``, the compile, untimed), stopping once
    ``budget_s`` is spent; best and median milliseconds."""
    jax.block_until_ready(fn(0))
    ts: list[float] = []
    start = time.perf_counter()
    for i in range(1, repeats + 1):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(i))
        ts.append(time.perf_counter() - t0)
        if time.perf_counter() - start > budget_s:
            break
    return {"best_ms": 1e3 * min(ts), "median_ms": 1e3 * float(np.median(ts)), "calls": len(ts)}


def hf_case(blk, cfg: MoEConfig, xs: list, g, rcfg: TrainEvalConfig) -> tuple[dict, dict, Callable[[int], dict]]:
    """Times the HF block's forward and ``loss.backward()``; returns (timings, small grads, expert(e))."""
    import torch

    gt = torch.from_numpy(np.array(g))

    def step(i):
        blk.zero_grad(set_to_none=True)
        xt = torch.from_numpy(np.asarray(xs[i % len(xs)])).requires_grad_(True)
        loss = (blk(xt[None])[0] * gt).sum()
        loss.backward()
        return xt

    def fwd(i):
        with torch.no_grad():
            return blk(torch.from_numpy(np.asarray(xs[i % len(xs)]))[None])

    tf = time_calls(fwd, rcfg.repeats, rcfg.time_budget_s)
    ts = time_calls(step, rcfg.repeats, rcfg.time_budget_s)
    xt = step(0)
    n = lambda v: v.grad.detach().numpy()  # noqa: E731
    f = cfg.expert_dim
    gu, dn = n(blk.experts.gate_up_proj), n(blk.experts.down_proj)
    small = {
        "x": xt.grad.detach().numpy(),
        "w_router": n(blk.gate.weight).T,
        "shared.w_gate": n(blk.shared_expert.gate_proj.weight).T,
        "shared.w_up": n(blk.shared_expert.up_proj.weight).T,
        "shared.w_down": n(blk.shared_expert.down_proj.weight).T,
        "shared.gate": n(blk.shared_expert_gate.weight)[0],
    }
    expert = (
        lambda e: {  # noqa: E731
            "experts.w_gate": gu[e, :f].T,
            "experts.w_up": gu[e, f:].T,
            "experts.w_down": dn[e].T,
        }
    )
    return {"fwd": tf, "step": ts}, small, expert


# --------------------------------------------------------------------------- run


def _row(t: int, impl: str, timing: dict, err: dict, agree: float, rcfg: TrainEvalConfig) -> dict:
    status = "pass" if err["max"] <= rcfg.tolerance else "fail"
    if agree < 1.0:
        status = "flip" if agree >= rcfg.min_routing_agreement else "fail"
    return {
        "tokens": t,
        "impl": impl,
        "status": status,
        "fwd_ms": timing["fwd"]["best_ms"],
        "fwd_median_ms": timing["fwd"]["median_ms"],
        "step_ms": timing["step"]["best_ms"],
        "step_median_ms": timing["step"]["median_ms"],
        "calls": timing["step"]["calls"],
        "bwd_over_fwd": timing["step"]["best_ms"] / timing["fwd"]["best_ms"] - 1.0,
        "grad_err": err,
        "routing_agreement": agree,
    }


def _agreement(r: RefRouting, ids) -> float:
    a = np.sort(np.asarray(ids), axis=-1)
    b = np.sort(r.expert_ids, axis=-1)
    return float(np.mean(np.all(a == b, axis=-1)))


def run_train(cfg: TrainEvalConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Runs every case of ``cfg``; returns the results mapping (no files written)."""
    mcfg = cfg.model.config()
    params = init_params(mcfg, jax.random.key(cfg.model.seed))
    d = mcfg.d_model
    cases: list[dict] = []
    hf_blk = None
    if cfg.hf:
        try:
            hf_blk = qwen35_moe_block(params, mcfg, cfg.hf_threads)
        except ImportError as e:
            cases.append({"tokens": None, "impl": "hf", "status": "skipped", "reason": f"not installed: {e}"})
    for t in cfg.tokens:
        key = jax.random.key(cfg.inputs.seed + 1000 * t)
        xs = [
            jax.random.normal(k, (t, d), jnp.float32) * cfg.inputs.scale for k in jax.random.split(key, cfg.repeats + 1)
        ]
        g = jax.random.normal(jax.random.fold_in(key, 7), (t, d), jnp.float32)
        hf_step = None
        if hf_blk is not None:
            log(f"T={t} hf")
            timing, small, expert = hf_case(hf_blk, mcfg, xs, g, cfg)
            err, r = grad_error(params, xs[0], g, mcfg, small, expert)
            ids = _hf_ids(hf_blk, xs[0], mcfg.top_k)
            cases.append(_row(t, "hf", timing, err, _agreement(r, ids), cfg))
            hf_step = timing["step"]["best_ms"]
            del small, expert
        for ex in cfg.impls:
            impl = ex.label
            caps = [cfg.impl_max_tokens[n] for n in {impl, ex.impl} if n in cfg.impl_max_tokens]
            if caps and t > min(caps):
                reason = f"impl_max_tokens {min(caps)}"
                cases.append({"tokens": t, "impl": impl, "status": "skipped", "reason": reason})
                continue
            log(f"T={t} {impl}")

            def loss(p, x, ex=ex, g=g):
                return jnp.sum(moe_apply(p, x, mcfg, ex).astype(jnp.float32) * g)

            try:
                step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
                fwd = jax.jit(loss)
                tf = time_calls(lambda i, f=fwd, xs=xs: f(params, xs[i % len(xs)]), cfg.repeats, cfg.time_budget_s)
                ts = time_calls(lambda i, f=step, xs=xs: f(params, xs[i % len(xs)]), cfg.repeats, cfg.time_budget_s)
                _, (gp, gx) = step(params, xs[0])
            except Exception as e:  # an impl without a reverse mode: recorded, fails the gate
                cases.append({"tokens": t, "impl": impl, "status": "error", "reason": f"{type(e).__name__}: {e}"[:400]})
                continue
            small, expert = jax_grads(gp, gx)
            err, r = grad_error(params, xs[0], g, mcfg, small, expert)
            _, routing = moe_apply(params, xs[0], mcfg, ex, return_routing=True)
            row = _row(t, impl, {"fwd": tf, "step": ts}, err, _agreement(r, routing.expert_ids), cfg)
            if hf_step is not None:
                row["vs_hf"] = hf_step / row["step_ms"]
            cases.append(row)
            del gp, gx, small, expert
    passed = all(c["status"] in ("pass", "flip", "skipped") for c in cases)
    return dict(
        **cfg.results_head(),
        model=mcfg.to_dict(),
        platform=jax.devices()[0].platform,
        device_kind=jax.devices()[0].device_kind,
        cpu_count=os.cpu_count(),
        load_average=os.getloadavg()[0],
        cases=cases,
        gate=dict(passed=passed),
    )


def _hf_ids(blk, x, k: int) -> np.ndarray:
    """The experts the HF router selects for ``x`` (its own float32 softmax top-k)."""
    import torch

    with torch.no_grad():
        z = blk.gate.weight @ torch.from_numpy(np.asarray(x)).T
        return torch.topk(z.T, k, dim=-1).indices.numpy()


def report_md(res: dict) -> str:
    """The text of ``report.md``: one table row per case."""
    c = res["config"]
    lines = [
        f"# {res['name']}",
        "",
        res["description"],
        "",
        f"platform {res['platform']} ({res['device_kind']}, {res['cpu_count']} cores, load average "
        f"{res['load_average']:.1f} at the end); L = sum(g * y), gradients w.r.t. x and every parameter; "
        f"times: best of up to {c['repeats']} calls on new tokens (median in results.json); grad error: "
        f"max|grad - ref| / max|ref| per group against the float64 reference, tolerance {c['tolerance']:g}; "
        f"host memory: {res.get('host_memory', 'default')} (`jaxmoe eval --keep-freed-memory`, README, Training)",
        "",
        "| tokens | impl | fwd ms | fwd+bwd ms | bwd / fwd | vs hf | err x | err router | err experts | "
        "err shared | routing agree | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for k in res["cases"]:
        if k["status"] in ("skipped", "error"):
            lines.append(f"| {k['tokens']} | {k['impl']} | | | | | | | | | | {k['status']}: {k['reason']} |")
            continue
        e = k["grad_err"]
        fmt = lambda grp, e=e: f"{e[grp]:.1e}" if grp in e else ""  # noqa: E731
        vs = f"{k['vs_hf']:.2f}x" if "vs_hf" in k else ""
        lines.append(
            f"| {k['tokens']} | {k['impl']} | {k['fwd_ms']:.1f} | {k['step_ms']:.1f} | {k['bwd_over_fwd']:.2f} | "
            f"{vs} | {fmt('x')} | {fmt('router')} | {fmt('experts')} | {fmt('shared')} | "
            f"{k['routing_agreement']:.3f} | {k['status']} |"
        )
    lines += [
        "",
        "vs hf: the HF block's fwd+bwd time / the impl's (> 1: faster than torch). bwd / fwd: (fwd+bwd - fwd) / fwd.",
        "",
        f"gate: {'passed' if res['gate']['passed'] else 'FAILED'}",
        "",
    ]
    return "\n".join(lines)


def run(cfg: TrainEvalConfig, opts: RunOptions | None = None) -> tuple[dict, Path]:
    """Runs ``cfg`` and writes ``results.json`` and ``report.md`` into the run directory
    (``out``, else ``<output_dir>/<name>-<UTC timestamp>``). Returns (results, run directory).
    ``opts.progress``: print one line as each case starts."""
    opts = opts or RunOptions()
    console = opts.console or Console()
    res = run_train(cfg, log=(lambda s: console.print(s, highlight=False)) if opts.progress else (lambda s: None))
    res["host_memory"] = host_memory_mode()
    return res, write_run(cfg, opts, res, report_md)

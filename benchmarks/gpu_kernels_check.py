"""Kernel-check phase of benchmarks/gpu_check.sh: the Pallas kernels, compiled for the GPU,
against independent references; one JSON line per case in ``check.jsonl`` as it finishes.

First it writes ``env.json`` (device, L2 size, jax and Python versions, nvidia-smi, the
carried packages it can import). Then, at a small shape (d 512, F 256, 16 experts,
top-k <= 4), each case runs ``impl="pallas"`` (decode kernels when ``T * k <= 64``, else
the grouped kernels over a dispatch plan) and compares it with ``experts_dense`` (every
expert on every token, masked, float32-accumulated ``HIGHEST`` einsums): bf16, Q8_0
and 4-bit experts within 4e-2 of the reference's largest value; float32 within 1e-4 (a
TF32 dot would miss that); gpt-oss's clamped SwiGLU with biases; the routing weight on
the input (Llama 4); Mixtral's top-2. A failing case also checks its gate/up kernel
alone against that kernel's pure-jnp reference, to say which kernel is wrong. Cases run
four at a time in threads (compiling dominates); rows are written in case order. The last
case runs a whole layer (`jaxmoe.moe_apply`, shared expert included) with
``impl="auto"`` against ``impl="dense"``; on the GPU it must lower to the Triton kernels.

``--dry-run``: the same cases' plumbing on the CPU (kernels in interpret mode, tiny
shapes, one case per code path).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import importlib.metadata
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_common as common  # noqa: E402
from gpu_common import log  # noqa: E402

import jaxmoe  # noqa: E402
from jaxmoe.dispatch import plan_dispatch  # noqa: E402
from jaxmoe.execution import ExecConfig  # noqa: E402
from jaxmoe.impls.pallas import experts_pallas, kernel_weight  # noqa: E402
from jaxmoe.quant import quantize_int4_affine, quantize_int8  # noqa: E402
from pallas_kernels import decode, swiglu  # noqa: E402
from pallas_kernels.common import Activation  # noqa: E402
from pallas_kernels.launch import DecodeLaunch, Launch, Plan  # noqa: E402

TOL = {"bf16": 4e-2, "q8_0": 4e-2, "int4": 4e-2, "q4_k_m": 4e-2, "q5_0": 4e-2, "f32": 1e-4}
TRITON_CALL = re.compile(r"__gpu\$xla\.gpu\.triton|triton_kernel_call")
PRESETS = {"qwen3.6": "qwen3.6-35b-a3b", "gpt-oss": "gpt-oss-20b", "mixtral": "mixtral-8x7b"}


@dataclasses.dataclass(frozen=True)
class Case:
    """One check: a preset's routing and activation, a weight kind, a token count; ``woi``
    puts the routing weight on the expert input; ``block`` runs a whole `moe_apply` layer."""

    preset: str
    kind: str
    t: int
    woi: bool = False
    block: bool = False

    @property
    def name(self) -> str:
        return (
            f"{self.preset}/{self.kind}/T={self.t}"
            + ("/weight_on_input" if self.woi else "")
            + ("/moe_apply(auto)" if self.block else "")
        )


#: Every case on the GPU: decode (T = 1, 5) and grouped (T = 300) paths for each kind.
CASES = (
    Case("qwen3.6", "bf16", 1),
    Case("qwen3.6", "bf16", 300),
    Case("qwen3.6", "q8_0", 5),
    Case("qwen3.6", "q8_0", 300),
    Case("qwen3.6", "int4", 1),
    Case("qwen3.6", "int4", 300),
    Case("qwen3.6", "f32", 5),
    Case("qwen3.6", "f32", 300),
    Case("gpt-oss", "bf16", 5),
    Case("gpt-oss", "q8_0", 300),
    Case("gpt-oss", "int4", 1),
    Case("mixtral", "bf16", 300),
    Case("mixtral", "q8_0", 1),
    Case("qwen3.6", "q4_k_m", 1),  # GGUF blocks decoded in the kernels (never run on a GPU before)
    Case("qwen3.6", "q4_k_m", 300),
    Case("qwen3.6", "bf16", 5, woi=True),
    Case("qwen3.6", "bf16", 300, woi=True),
    Case("qwen3.6", "bf16", 300, block=True),
)
#: The dry run: each code path once (decode and grouped, each kind but bf16 in the kernels,
#: biases and the clamped activation, weight on input, the whole layer), at tiny shapes.
DRY_CASES = (
    Case("qwen3.6", "f32", 40, woi=True),
    Case("gpt-oss", "q8_0", 40),
    Case("gpt-oss", "int4", 1),
    Case("qwen3.6", "q5_0", 1),  # a GGUF block kind (Q4_K_M needs widths of 256)
    Case("qwen3.6", "bf16", 40, block=True),
)


def environment(dry_run: bool) -> dict:
    """What ran where: device, L2 size (PyTorch's report on the GPU), versions, nvidia-smi."""
    dev = jax.devices()[0]
    env = dict(
        device=str(getattr(dev, "device_kind", dev)),
        platform=dev.platform,
        backend=jax.default_backend(),
        jax=jax.__version__,
        python=platform.python_version(),
        dry_run=dry_run,
        l2_bytes=None,
    )
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version", "--format=csv"],
            capture_output=True,
            text=True,
            timeout=15,
        )
        env["nvidia_smi"] = (out.stdout or out.stderr).strip()
    except (OSError, subprocess.SubprocessError) as e:
        env["nvidia_smi"] = f"not available ({type(e).__name__})"
    if not dry_run:  # JAX has no L2 query; PyTorch's, in its own process (its own CUDA context)
        try:
            q = "import torch; print(torch.cuda.get_device_properties(0).L2_cache_size)"
            out = subprocess.run([sys.executable, "-c", q], capture_output=True, text=True, timeout=40)
            env["l2_bytes"] = int(out.stdout.strip().splitlines()[-1])
        except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
            env["l2_note"] = f"torch L2 query failed ({type(e).__name__})"
    for mod in ("jaxlib", "gguf", "flax", "triton"):
        try:
            env[mod] = importlib.metadata.version(mod)
        except importlib.metadata.PackageNotFoundError:
            env[mod] = "not installed"
    return env


def case_config(case: Case, dry_run: bool):
    d, f, e = (64, 32, 8) if dry_run else (512, 256, 16)
    base = jaxmoe.load_config(PRESETS[case.preset])
    cfg = common.shrink(base, d, f, e, min(base.top_k, 4))
    if case.woi:
        cfg = dataclasses.replace(cfg, weight_on_input=True)
    if case.block:  # the whole layer: with Qwen's gated shared expert
        cfg = dataclasses.replace(cfg, shared_expert_dim=f, num_shared_experts=1, shared_expert_gate=True)
    return cfg


def case_experts(ew: jaxmoe.ExpertWeights, kind: str) -> jaxmoe.ExpertWeights:
    names = ("w_gate", "w_up", "w_down")
    if kind == "q8_0":
        return dataclasses.replace(ew, **{n: quantize_int8(np.asarray(getattr(ew, n))) for n in names})
    if kind == "int4":
        return dataclasses.replace(ew, **{n: quantize_int4_affine(np.asarray(getattr(ew, n)), 32) for n in names})
    if kind in ("q4_k_m", "q5_0"):  # random valid blocks
        kinds = common.projection_kinds(kind)
        return dataclasses.replace(
            ew,
            **{
                n: common.gguf_random_weight(kk, *getattr(ew, n).shape, seed=i)
                for i, (n, kk) in enumerate(zip(names, kinds))
            },
        )
    dt = jnp.float32 if kind == "f32" else jnp.bfloat16
    return dataclasses.replace(ew, **{n: getattr(ew, n).astype(dt) for n in names})


def kernel_diagnosis(x, r, ew, cfg, interpret: bool) -> float:
    """The gate/up kernel alone (decode or grouped) against its pure-jnp reference."""
    wg, wu = kernel_weight(ew.w_gate), kernel_weight(ew.w_up)
    act = Activation(cfg.activation, float(cfg.swiglu_alpha), float(cfg.swiglu_limit))
    if x.shape[0] * cfg.top_k <= 64:
        lc = DecodeLaunch(interpret=interpret)
        h = decode.decode_gate_up(x, r.expert_ids, wg, wu, ew.b_gate, ew.b_up, act=act, launch=lc)
        ref = decode.decode_gate_up_reference(x, r.expert_ids, wg, wu, ew.b_gate, ew.b_up, act=act)
        return common.rel_err(h, ref)
    plan = plan_dispatch(r.expert_ids, cfg.num_experts, 32)
    kp = Plan(plan.group_offsets, plan.tile_group, plan.tile_row, plan.num_tiles)
    lc = Launch(block_m=32, interpret=interpret)
    h = swiglu.gate_up_swiglu(x, plan.token_idx, kp, wg, wu, ew.b_gate, ew.b_up, act=act, launch=lc)
    ref = swiglu.gate_up_swiglu_reference(x, plan.token_idx, plan.group_offsets, wg, wu, ew.b_gate, ew.b_up, act=act)
    return common.rel_err(h, ref)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def case_inputs(cfg, t: int, dt, key):
    """Float32 parameters, ``x [T, d]`` in ``dt`` and a routing, in one compiled call."""
    k1, k2, k3 = jax.random.split(key, 3)
    params = jaxmoe.init_params(cfg, k1, dtype=jnp.float32)
    x = jax.random.normal(k2, (t, cfg.d_model), dt)
    r = jaxmoe.route(jax.random.normal(k3, (t, cfg.num_experts), jnp.float32), cfg.router)
    return params, x, r


def run_case(case: Case, interpret: bool, dry_run: bool, key) -> dict:
    cfg = case_config(case, dry_run)
    dt = jnp.float32 if case.kind == "f32" else jnp.bfloat16
    params, x, r = case_inputs(cfg, case.t, dt, key)
    rec: dict = dict(case=case.name, preset=case.preset, kind=case.kind, T=case.t, tol=TOL[case.kind])
    rec["path"] = "decode" if case.t * cfg.top_k <= 64 else "grouped"
    t0 = time.perf_counter()
    if case.block:
        params = jax.jit(lambda p: jax.tree.map(lambda a: a.astype(dt), p))(params)
        f = jax.jit(functools.partial(jaxmoe.moe_apply, cfg=cfg, impl="auto"))
        rec["triton_calls"] = len(TRITON_CALL.findall(f.lower(params, x).as_text()))
        y = f(params, x)
        ref = jax.jit(functools.partial(jaxmoe.moe_apply, cfg=cfg, impl="dense"))(params, x)
        rec["rel_err"] = common.rel_err(y, ref)
        rec["ok"] = bool(rec["rel_err"] <= rec["tol"] and (dry_run or rec["triton_calls"] > 0))
    else:
        ew = case_experts(params.experts, case.kind)
        y = jax.jit(functools.partial(experts_pallas, cfg=cfg, ex=ExecConfig(interpret=interpret)))(x, r, ew)
        ref = jax.jit(functools.partial(jaxmoe.experts_dense, cfg=cfg))(x, r, ew)
        rec["rel_err"] = common.rel_err(y, ref)
        rec["ok"] = bool(rec["rel_err"] <= rec["tol"])
        if not rec["ok"]:
            rec["rel_err_gate_up_kernel"] = kernel_diagnosis(x, r, ew, cfg, interpret)
    rec["seconds"] = time.perf_counter() - t0
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder of env.json and check.jsonl")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, interpret-mode kernels")
    ap.add_argument("--deadline", type=float, default=120.0, help="seconds this phase plans to use")
    ap.add_argument("--no-deadline", action="store_true", help="run every case whatever the time (tests)")
    a = ap.parse_args(argv)
    dl = common.Deadline(math.inf if a.no_deadline else a.deadline)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment(a.dry_run)
    (out / "env.json").write_text(json.dumps(env, indent=1))
    log(json.dumps(env))
    interpret = common.check_backend(a.dry_run)
    rows = common.Rows(out / "check.jsonl")
    cases = DRY_CASES if a.dry_run else CASES
    reserve = 0.0 if a.dry_run else 8.0

    def one(i: int, case: Case) -> dict:
        if dl.left() < reserve:
            return dict(case=case.name, ok=False, skipped="phase deadline")
        try:
            return run_case(case, interpret, a.dry_run, jax.random.key(100 + i))
        except Exception as ex:  # record and go on: one broken case must not hide the rest
            traceback.print_exc()
            return dict(case=case.name, ok=False, error=f"{type(ex).__name__}: {ex}"[:2000])

    # cases run in threads (compiling dominates: XLA and Triton compile outside the GIL);
    # rows are written in case order, each as soon as it and those before it are done
    bad = 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        for case, fut in [(c, pool.submit(one, i, c)) for i, c in enumerate(cases)]:
            rec = fut.result()
            rows.write(rec)
            bad += not rec["ok"]
            shown = {k: v for k, v in rec.items() if k not in ("case", "preset", "kind", "T")}
            log(
                f"check {case.name:40s} "
                + " ".join(f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items())
            )
    log(f"kernel checks: {len(cases) - bad}/{len(cases)} within tolerance")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""The ``expert-parallel`` kind of eval run (``configs/evals/expert-parallel.yaml``).

Run it with ``jaxmoe eval expert-parallel [--set key=value ...] [--out DIR]``.

For every mesh (``{expert, data}``), token count, capacity factor and impl it runs
`jaxmoe.parallel.moe_apply_ep` and the single-device `jaxmoe.layer.moe_apply` on the
same seeded weights and inputs and records: the max relative difference ``max|y_ep -
y_1| / max|y_1|`` (the gate: within ``tolerance`` whenever no pair was dropped, and no
pair dropped without a capacity factor), pairs dropped, the capacity ``C``, all-to-all
buffer bytes per token, and the median step time. It writes ``results.json`` and
``report.md`` to ``--out`` or ``<output_dir>/<name>-<UTC timestamp>``.

On CPU the meshes need forced host devices: `run` asks JAX for ``max(expert * data)``
CPU devices (``jax_num_cpu_devices``) when the backend is not yet up; otherwise set
``XLA_FLAGS=--xla_force_host_platform_device_count=8``. A mesh larger than the devices
present is recorded as skipped.

Several processes (``processes: 2``, e.g. ``--set processes=2``): the run starts that many
worker processes on this machine (`run_processes`), each with ``devices_per_process``
CPU devices, joined by ``jax.distributed.initialize`` on ``127.0.0.1`` (a free port) with
gloo CPU collectives; every worker runs the cases (`run_cases`) on meshes over all
processes' devices (a mesh not spanning every device is skipped: each process must own
part of it), and compares with the single-device layer computed in that process. Process
0's results are the run's; a worker that fails or outlives ``timeout_s`` fails the run
with its output.

Schema (`ExpertParallelConfig`; every key checked, unknown keys are errors naming the key)::

    kind: expert-parallel
    name: expert-parallel          # defaults to the file's stem
    description: ...
    model: {preset: qwen3.6-35b-a3b, shrink: {d_model, expert_dim, shared_expert_dim, num_experts, top_k}, seed: 0}
    inputs: {kind: random, seed: 0, scale: 1.0}
    impls: [auto]                  # impl names or mappings of ExecConfig fields ({impl: xla, batch_invariant: true})
    tokens: [16, 256]
    mesh: [{expert: 1, data: 1}, {expert: 2}, ...]   # data defaults to 1
    capacity_factors: [null, 1.0]  # null: no drops (worst-case capacity)
    repeats: 3
    tolerance: 1.0e-5
    processes: 1                   # > 1: jax.distributed worker processes on 127.0.0.1
    devices_per_process: 4         # CPU devices of each worker process
    timeout_s: 600                 # bound on the workers' wall time
    output_dir: runs

Redundant experts (``load_balance:``, optional; the shipped config sets it): on the mesh
``{expert: expert}`` a Zipf(``zipf``) routing over the experts (each token's top-k
distinct experts drawn with probability ``1 / rank^zipf``, `zipf_routing`) is drawn
twice; the first batch's per-expert pair counts feed `jaxmoe.placement.rebalance` for
each ``replicas`` count, and the second is run through `moe_apply_ep` without and with
each placement. Each case records the pairs each device computed (before: static
placement; after: with the placement), max / mean device load, the max relative
difference from the one-device layer (gated by ``tolerance``) and the step time;
``device_load.png`` plots the device loads (``plot: false`` skips it)::

    load_balance: {expert: 8, tokens: 256, zipf: 1.2, replicas: [0, 8, 16], seed: 0, plot: true}

``model.shrink`` is read as every kind reads it (`jaxmoe.evaluation.presets.shrink_config`;
``shared_expert_dim: 0`` drops the shared expert). Results name each ``impls:`` entry by
its `jaxmoe.execution.ExecConfig.label`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxmoe.config import load_config
from jaxmoe.evaluation.presets import PresetSection
from jaxmoe.evaluation.report import write_run
from jaxmoe.evaluation.schema import Context, RunConfig, RunOptions, mapping_reader
from jaxmoe.execution import ExecConfig
from jaxmoe.impls.registry import available_impls
from jaxmoe.layer import moe_apply
from jaxmoe.parallel import gather_output, global_input, make_mesh, moe_apply_ep, shard_params
from jaxmoe.params import init_params
from jaxmoe.placement import device_loads, physical_experts, rebalance
from jaxmoe.routing import Routing

KIND = "expert-parallel"


@dataclasses.dataclass(frozen=True)
class EPInputsSection:
    """Seeded normal activations ``scale * N(0, 1)`` (seed ``seed + tokens`` per token count)."""

    kind: Literal["random"] = "random"
    seed: int = 0
    scale: float = 1.0


@dataclasses.dataclass(frozen=True)
class MeshSection:
    """One mesh: ``expert`` devices along the expert axis times ``data`` along the data axis."""

    expert: int
    data: int = 1


@dataclasses.dataclass(frozen=True)
class LoadBalanceSection:
    """Device loads before / after `jaxmoe.placement.rebalance` under a Zipf routing (see the
    module docstring)."""

    expert: int = 8
    tokens: int = 256
    zipf: float = 1.2
    replicas: tuple[int, ...] = (0, 8, 16)
    seed: int = 0
    plot: bool = True


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExpertParallelConfig(RunConfig):
    """One expert-parallel eval run (see the module docstring for the YAML form)."""

    kind: Literal["expert-parallel"] = KIND
    model: PresetSection
    mesh: tuple[MeshSection, ...]
    inputs: EPInputsSection = EPInputsSection()
    impls: tuple[ExecConfig, ...] = (ExecConfig(),)
    tokens: tuple[int, ...] = (16,)
    capacity_factors: tuple[float | None, ...] = (None,)
    repeats: int = 3
    tolerance: float = 1e-5
    processes: int = 1
    devices_per_process: int = 4
    timeout_s: float = 600.0
    load_balance: LoadBalanceSection | None = None


def check(cfg: ExpertParallelConfig, ctx: Context) -> None:
    """Checks values beyond their types: positive sizes, known preset and impls."""
    ctx.check_preset("model.preset", cfg.model.preset)
    ctx.check_shrink("model.shrink", cfg.model.shrink, load_config(cfg.model.preset))
    if not cfg.mesh:
        ctx.fail("mesh", "must be a non-empty list of {expert: n, data: m}")
    for i, m in enumerate(cfg.mesh):
        ctx.check_min(f"mesh[{i}].expert", m.expert)
        ctx.check_min(f"mesh[{i}].data", m.data)
    ctx.check_execs("impls", cfg.impls, available_impls())
    ctx.check_list("tokens", cfg.tokens)
    if not cfg.capacity_factors:
        ctx.fail("capacity_factors", "is an empty list")
    for i, cf in enumerate(cfg.capacity_factors):
        if cf is not None:
            ctx.check_positive(f"capacity_factors[{i}]", cf)
    for key in ("repeats", "processes", "devices_per_process"):
        ctx.check_min(key, getattr(cfg, key))
    for key in ("tolerance", "timeout_s"):
        ctx.check_positive(key, getattr(cfg, key))
    ctx.check_name(cfg.name)
    lb = cfg.load_balance
    if lb is not None:
        for key in ("expert", "tokens"):
            ctx.check_min(f"load_balance.{key}", getattr(lb, key))
        ctx.check_positive("load_balance.zipf", lb.zipf)
        e = cfg.model.config().num_experts  # preset and shrink checked above
        for i, r in enumerate(lb.replicas):
            if r < 0 or (e + r) % lb.expert or e % lb.expert:
                ctx.fail(
                    f"load_balance.replicas[{i}]",
                    f"{r}: needs r >= 0 and num_experts={e} and num_experts + r divisible by expert={lb.expert}",
                )


config_from_mapping = mapping_reader(ExpertParallelConfig, check, default_name=KIND)


def ensure_cpu_devices(n: int) -> None:
    """Asks for ``n`` CPU devices if the JAX backend is not up yet (else keeps what is there)."""
    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return
    try:
        if jax.config.jax_num_cpu_devices < n:
            jax.config.update("jax_num_cpu_devices", n)
    except Exception:  # backend already initialized: use the devices it has
        pass


def run_expert_parallel(cfg: ExpertParallelConfig) -> dict[str, Any]:
    """Runs every case of ``cfg``; returns the results mapping (no files written).
    With ``processes > 1`` the cases run in that many worker processes (`run_processes`)."""
    if cfg.processes > 1:
        return run_processes(cfg)
    ensure_cpu_devices(max(m.expert * m.data for m in cfg.mesh))
    return run_cases(cfg)


def run_cases(cfg: ExpertParallelConfig) -> dict[str, Any]:
    """The cases of ``cfg`` in this process, on meshes over ``jax.devices()`` (all processes'
    devices after ``jax.distributed.initialize``)."""
    mcfg = cfg.model.config()
    params = init_params(mcfg, jax.random.key(cfg.model.seed))
    single = jax.jit(moe_apply, static_argnames=("cfg", "ex"))
    ndev = len(jax.devices())
    nproc = jax.process_count()
    cases = []
    for t in cfg.tokens:
        x = jax.random.normal(jax.random.key(cfg.inputs.seed + t), (t, mcfg.d_model), jnp.float32) * cfg.inputs.scale
        for ex in cfg.impls:
            y1 = np.asarray(single(params, x, cfg=mcfg, ex=ex))
            for m in cfg.mesh:
                e, d = m.expert, m.data
                for cf in cfg.capacity_factors:
                    case = dict(tokens=t, impl=ex.label, expert=e, data=d, capacity_factor=cf)
                    if e * d > ndev:
                        cases.append({**case, "status": "skipped", "reason": f"needs {e * d} devices, {ndev} present"})
                        continue
                    if nproc > 1 and e * d != ndev:
                        why = f"{nproc} processes: a mesh must span all {ndev} devices"
                        cases.append({**case, "status": "skipped", "reason": why})
                        continue
                    mesh = make_mesh(e, d)
                    ps = shard_params(params, mesh)
                    xg = global_input(x, mesh)
                    step = jax.jit(
                        lambda p, x, mesh=mesh, cf=cf, ex=ex: moe_apply_ep(
                            p, x, mcfg, mesh, ex, capacity_factor=cf, return_stats=True
                        )
                    )
                    y, st = step(ps, xg)
                    ts = []
                    for _ in range(cfg.repeats):
                        t0 = time.perf_counter()
                        jax.block_until_ready(step(ps, xg))
                        ts.append(time.perf_counter() - t0)
                    err = float(np.abs(gather_output(y) - y1).max() / max(np.abs(y1).max(), 1e-30))
                    dropped = int(gather_output(st.dropped_pairs))
                    rows = e * st.capacity  # per device, each direction
                    buf = e * d * rows * (mcfg.d_model * x.dtype.itemsize + 8 + mcfg.d_model * 4)
                    ok = dropped > 0 or err <= cfg.tolerance
                    ok = ok and (cf is not None or dropped == 0)
                    cases.append(
                        {
                            **case,
                            "status": "pass" if ok else "fail",
                            "max_rel_err": err,
                            "dropped_pairs": dropped,
                            "pairs": t * mcfg.top_k,
                            "capacity": st.capacity,
                            "exchange": st.exchange,
                            "buffer_bytes_per_token": buf / t,
                            "step_ms": 1e3 * float(np.median(ts)),
                        }
                    )
    balance = load_balance_cases(cfg, mcfg, params) if cfg.load_balance is not None else []
    passed = all(k["status"] != "fail" for k in [*cases, *balance])
    return dict(
        **cfg.results_head(),
        model=mcfg.to_dict(),
        platform=jax.devices()[0].platform,
        devices=ndev,
        processes=nproc,
        cases=cases,
        load_balance=balance,
        gate=dict(passed=passed),
    )


def zipf_routing(rng: np.random.Generator, tokens: int, num_experts: int, top_k: int, s: float, order=None) -> Routing:
    """A skewed routing ``[tokens, top_k]``: each token's ``top_k`` distinct experts drawn
    without replacement with probability ``1 / rank^s`` (``order[i]`` has rank ``i + 1``;
    default a random permutation), weights a softmax of normal draws (float32)."""
    order = rng.permutation(num_experts) if order is None else np.asarray(order)
    logp = np.empty(num_experts)
    logp[order] = -s * np.log(np.arange(1, num_experts + 1))
    gumbel = -np.log(-np.log(rng.uniform(1e-12, 1.0, (tokens, num_experts))))
    ids = np.argsort(-(logp + gumbel), axis=1)[:, :top_k]  # Gumbel top-k: sampling without replacement
    z = rng.standard_normal((tokens, top_k))
    w = np.exp(z) / np.exp(z).sum(1, keepdims=True)
    return Routing(jnp.asarray(ids, jnp.int32), jnp.asarray(w, jnp.float32))


def load_balance_cases(cfg: ExpertParallelConfig, mcfg, params) -> list[dict[str, Any]]:
    """The ``load_balance`` cases of ``cfg`` (see the module docstring)."""
    lb = cfg.load_balance
    assert lb is not None
    n, ndev, e = lb.expert, len(jax.devices()), mcfg.num_experts
    if n > ndev or (jax.process_count() > 1 and n != ndev):
        return [dict(replicas=r, status="skipped", reason=f"mesh expert={n}, {ndev} devices") for r in lb.replicas]
    rng = np.random.default_rng(lb.seed)
    order = rng.permutation(e)
    cal = zipf_routing(rng, lb.tokens, e, mcfg.top_k, lb.zipf, order)
    fresh = zipf_routing(rng, lb.tokens, e, mcfg.top_k, lb.zipf, order)
    x = jax.random.normal(jax.random.key(lb.seed), (lb.tokens, mcfg.d_model), jnp.float32) * cfg.inputs.scale
    load = np.bincount(np.asarray(cal.expert_ids).reshape(-1), minlength=e)
    ex = cfg.impls[0]
    y1 = np.asarray(jax.jit(moe_apply, static_argnames=("cfg", "ex"))(params, x, mcfg, ex, routing=fresh))
    mesh = make_mesh(n)
    step = jax.jit(lambda p, x, r, pl: moe_apply_ep(p, x, mcfg, mesh, ex, routing=r, placement=pl, return_stats=True))
    xg, rg = global_input(x, mesh), global_input(fresh, mesh)
    before = None
    out = []
    for r in (None, *lb.replicas):
        pl = None if r is None else rebalance(load, e + r, n)
        ps = shard_params(
            params if pl is None else dataclasses.replace(params, experts=physical_experts(params.experts, pl)), mesh
        )
        y, st = step(ps, xg, rg, pl)
        ts = []
        for _ in range(cfg.repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(step(ps, xg, rg, pl))
            ts.append(time.perf_counter() - t0)
        dev = gather_output(st.expert_load).reshape(n, -1).sum(1)
        if pl is None:
            before = dev
            continue
        err = float(np.abs(gather_output(y) - y1).max() / max(np.abs(y1).max(), 1e-30))
        assert before is not None
        out.append(
            dict(
                replicas=r,
                status="pass" if err <= cfg.tolerance else "fail",
                slots=e + r,
                device_load_before=before.tolist(),
                device_load_after=dev.tolist(),
                max_over_mean_before=float(before.max() / before.mean()),
                max_over_mean_after=float(dev.max() / dev.mean()),
                expected_max_over_mean=float(device_loads(load, pl).max() / device_loads(load, pl).mean()),
                max_rel_err=err,
                step_ms=1e3 * float(np.median(ts)),
            )
        )
    return out


def report_md(res: dict) -> str:
    """The text of ``report.md``: one table row per case."""
    lines = [
        f"# {res['name']}",
        "",
        res["description"],
        "",
        f"platform {res['platform']}, {res['devices']} devices in {res.get('processes', 1)} process(es), "
        f"tolerance {res['config']['tolerance']:g} "
        "(max relative difference from the single-device layer, when no pair is dropped)",
        "",
        "| tokens | impl | expert x data | capacity factor | C | dropped / pairs | max rel err | "
        "buffer B/token | step ms | status |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for k in res["cases"]:
        if k["status"] == "skipped":
            lines.append(
                f"| {k['tokens']} | {k['impl']} | {k['expert']}x{k['data']} | {k['capacity_factor']} | "
                f"| | | | | skipped: {k['reason']} |"
            )
            continue
        lines.append(
            f"| {k['tokens']} | {k['impl']} | {k['expert']}x{k['data']} | {k['capacity_factor']} | "
            f"{k['capacity']} | {k['dropped_pairs']} / {k['pairs']} | {k['max_rel_err']:.2e} | "
            f"{k['buffer_bytes_per_token']:.0f} | {k['step_ms']:.2f} | {k['status']} |"
        )
    lb = res.get("load_balance") or []
    if lb:
        c = res["config"]["load_balance"]
        lines += [
            "",
            f"Redundant experts: mesh expert={c['expert']}, {c['tokens']} tokens, Zipf({c['zipf']}) routing; "
            "placement from a first batch's loads, device loads (pairs computed) on a second batch.",
            "",
            "| replicas | slots | max/mean before | max/mean after | expected after | max rel err | step ms | status |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for k in lb:
            if k["status"] == "skipped":
                lines.append(f"| {k['replicas']} | | | | | | | skipped: {k['reason']} |")
                continue
            lines.append(
                f"| {k['replicas']} | {k['slots']} | {k['max_over_mean_before']:.3f} | {k['max_over_mean_after']:.3f} | "
                f"{k['expected_max_over_mean']:.3f} | {k['max_rel_err']:.2e} | {k['step_ms']:.2f} | {k['status']} |"
            )
    lines += ["", f"gate: {'passed' if res['gate']['passed'] else 'FAILED'}", ""]
    return "\n".join(lines)


def run(cfg: ExpertParallelConfig, opts: RunOptions | None = None) -> tuple[dict, Path]:
    """Runs ``cfg`` and writes ``results.json`` and ``report.md`` into the run directory
    (``out``, else ``<output_dir>/<name>-<UTC timestamp>``). Returns (results, run directory).
    ``opts.progress`` does not apply (this run prints no progress bar)."""
    opts = opts or RunOptions()
    res = run_expert_parallel(cfg)
    run_dir = write_run(cfg, opts, res, report_md)
    if (
        cfg.load_balance is not None
        and cfg.load_balance.plot
        and any(k["status"] != "skipped" for k in res["load_balance"])
    ):
        from jaxmoe.evaluation.plots import plot_device_loads

        res["plot"] = str(plot_device_loads(res, run_dir / "device_load.png"))
        (run_dir / "results.json").write_text(json.dumps(res, indent=2))
    return res, run_dir


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0 and release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def worker_env(devices: int) -> dict[str, str]:
    """The environment of a worker: CPU only, ``devices`` host devices, no inherited device count."""
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    return env


def run_processes(cfg: ExpertParallelConfig) -> dict[str, Any]:
    """Runs ``cfg`` in ``cfg.processes`` worker processes joined by ``jax.distributed`` on
    ``127.0.0.1``; returns process 0's results. RuntimeError (with the workers' output
    tails) when a worker fails, or when they outlive ``cfg.timeout_s`` (all are killed)."""
    n = cfg.processes
    address = f"127.0.0.1:{free_port()}"
    with tempfile.TemporaryDirectory(prefix="jaxmoe-ep-") as tmp:
        conf = Path(tmp) / "config.json"
        conf.write_text(json.dumps(dataclasses.replace(cfg, processes=1).to_dict()))
        procs, logs = [], []
        for i in range(n):
            log = open(Path(tmp) / f"worker{i}.log", "w+")  # noqa: SIM115 (closed below)
            logs.append(log)
            cmd = [sys.executable, "-m", "jaxmoe.evaluation.expert_parallel", str(conf), str(i), str(n), address, tmp]
            procs.append(
                subprocess.Popen(cmd, env=worker_env(cfg.devices_per_process), stdout=log, stderr=subprocess.STDOUT)
            )
        deadline = time.monotonic() + cfg.timeout_s
        try:
            for proc in procs:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        finally:
            timed_out = [i for i, proc in enumerate(procs) if proc.poll() is None]
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        tails = []
        for i, log in enumerate(logs):
            log.seek(0)
            tails.append(f"--- worker {i} (rc {procs[i].returncode}) ---\n{log.read()[-3000:]}")
            log.close()
        if timed_out:
            raise RuntimeError(
                f"expert-parallel workers {timed_out} outlived timeout_s={cfg.timeout_s}\n" + "\n".join(tails)
            )
        if any(proc.returncode for proc in procs):
            raise RuntimeError("an expert-parallel worker failed\n" + "\n".join(tails))
        res = json.loads((Path(tmp) / "result0.json").read_text())
    res["config"] = cfg.to_dict()
    return res


def worker_main(argv: list[str] | None = None) -> None:
    """One worker of `run_processes`: ``CONFIG_JSON PROCESS_ID NUM_PROCESSES ADDRESS OUT_DIR``."""
    conf, pid, n, address, out = argv if argv is not None else sys.argv[1:]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=address, num_processes=int(n), process_id=int(pid))
    try:
        cfg = config_from_mapping(json.loads(Path(conf).read_text()), source=conf)
        res = run_cases(cfg)
        (Path(out) / f"result{pid}.json").write_text(json.dumps(res))
    finally:
        jax.distributed.shutdown()


if __name__ == "__main__":
    worker_main()

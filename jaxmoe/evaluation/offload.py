"""The ``offload`` kind of eval run: cache budgets x policies x predictors x inputs.

Run it with ``jaxmoe eval offload [--set key=value ...] [--out DIR]`` (e.g.
``--set tokens=8`` for a quick one). The run exits 0 when every streamed run was
bit-identical to the resident run (the gate), 1 if not, 2 on a bad config.

The YAML (`OffloadSweepConfig`; see ``configs/evals/offload.yaml``)::

    kind: offload
    name: offload
    model:
      preset: qwen3.6-35b-a3b       # shrunk with `shrink`, `num_layers` layers, random weights
      num_layers: 4
      shrink: {d_model: 256, expert_dim: 128, shared_expert_dim: 128, num_experts: 64, top_k: 8}
      storage: int8                 # float32 | float16 | int8 | int4 (safetensors) | gguf:Q8_0 | gguf:Q4_0 ...
      store: null                   # an existing store directory or .gguf (then preset/shrink are unused)
      seed: 0
    impl: gather                    # an impl name or a mapping of ExecConfig fields
    tokens: 48                      # decode tokens per configuration
    train_tokens: 192               # tokens that train the learned predictor (never the measured ones)
    inputs:                         # kinds: random | hidden (path: [N, d] .npy) | trace (synthetic, or path: .safetensors / .npy)
      - {kind: random, seed: 1}
      - {kind: trace, locality: 0.8, layer_corr: 0.1, zipf: 0.5, seed: 2}
    budgets: [0.0, 0.1, 0.25, 0.5, 1.0]   # fractions of all routed-expert bytes
    policies: [lru]                 # lru | lfu
    scopes: [global]                # global | per_layer
    predictors: [none, prev_token, next_router, learned, oracle]
    prefetch_k: null
    asynchronous: true              # prefetch in a background thread
    learned: {steps: 400, hidden_dim: 0}   # train_learned options (learning_rate, weight_decay too)
    output_dir: runs/offload
    plots: true

Every configuration records which kind of input produced it (``input``: ``random``,
``hidden:<file>``, ``synthetic(locality=p, ...)``, ``trace:<file>``), the hit rate,
prediction recall, bytes loaded per token, time waiting on loads, tokens/s against the
fully resident run, and whether the outputs were bit-identical to it. The resident
run's routing is saved as a safetensors routing trace (``input<i>_trace.safetensors``,
`jaxmoe.traces`; ids only) and, for hidden-state inputs, its hidden states as ``.npy``,
next to ``results.json``, so either can be replayed (``{kind: trace, path: ...}``) or
used to train a predictor.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np
from rich.console import Console

from jaxmoe.config import MoEConfig, load_config
from jaxmoe.evaluation.presets import PresetSection, ShrinkSection
from jaxmoe.evaluation.report import make_run_dir
from jaxmoe.evaluation.schema import Context, RunConfig, RunOptions, mapping_reader, to_plain
from jaxmoe.execution import ExecConfig
from jaxmoe.impls.registry import available_impls
from jaxmoe.offload.cache import POLICIES, SCOPES
from jaxmoe.offload.driver import OffloadConfig, OffloadedModel
from jaxmoe.offload.prerouter import PREDICTORS, make_predictor, train_learned
from jaxmoe.offload.store import STORE_KINDS, open_store, random_layers, write_gguf_store, write_safetensors_store
from jaxmoe.offload.traces import load_hidden, load_trace, reuse_rate, save_trace, synthetic_trace

KIND = "offload"


@dataclasses.dataclass(frozen=True)
class OffloadModelSection:
    """The layer stack: a shrunk preset with seeded random weights written in ``storage``
    format, or an existing ``store`` (a store directory or a ``.gguf``)."""

    preset: str | None = None
    num_layers: int = 4
    shrink: ShrinkSection | None = None
    storage: str = "float32"
    store: str | None = None
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class SweepInput:
    """One input of the sweep.

    ``random``: seeded normal hidden states ``scale * N(0, 1)``; ``hidden``: the rows of
    the ``[N, d]`` ``.npy`` at ``path``; ``trace``: random hidden states routed by a
    recorded trace (``path``) or a synthetic one (``locality``, ``layer_corr``, ``zipf``).
    """

    kind: Literal["random", "hidden", "trace"]
    seed: int = 0
    path: str | None = None
    locality: float = 0.5
    layer_corr: float = 0.0
    zipf: float = 0.0
    scale: float = 1.0


@dataclasses.dataclass(frozen=True)
class LearnedSection:
    """Options of `jaxmoe.offload.prerouter.train_learned`; null keeps its default."""

    steps: int | None = None
    hidden_dim: int | None = None
    learning_rate: float | None = None
    weight_decay: float | None = None

    def kwargs(self) -> dict[str, Any]:
        """The options that are set, as keyword arguments."""
        return {k: v for k, v in to_plain(self).items() if v is not None}


@dataclasses.dataclass(frozen=True, kw_only=True)
class OffloadSweepConfig(RunConfig):
    """One offload sweep (see the module docstring for the YAML form)."""

    kind: Literal["offload"] = KIND
    model: OffloadModelSection
    impl: ExecConfig = ExecConfig(impl="gather")
    tokens: int = 48
    train_tokens: int = 192
    inputs: tuple[SweepInput, ...] = (SweepInput(kind="random"),)
    budgets: tuple[float, ...] = (0.0, 0.1, 0.25, 0.5, 1.0)
    policies: tuple[Literal[POLICIES], ...] = ("lru",)
    scopes: tuple[Literal[SCOPES], ...] = ("global",)
    predictors: tuple[Literal[PREDICTORS], ...] = ("none", "prev_token", "next_router", "learned", "oracle")
    prefetch_k: int | None = None
    asynchronous: bool = True
    learned: LearnedSection = LearnedSection()
    output_dir: str = "runs/offload"
    plots: bool = True


def check(cfg: OffloadSweepConfig, ctx: Context) -> None:
    """Checks values beyond their types: storage kind, model source, inputs, budgets, sizes."""
    m = cfg.model
    if not (m.storage in STORE_KINDS or m.storage.startswith("gguf:")):
        ctx.fail("model.storage", f"{m.storage!r}: expected one of {STORE_KINDS} or gguf:<F32|F16|Q8_0|Q4_0>")
    if not m.store and not m.preset:
        ctx.fail("model.preset", "a preset (random weights) or model.store (an existing store) is required")
    if m.store and not Path(m.store).exists():
        ctx.fail("model.store", f"{m.store} does not exist")
    if not m.store:
        ctx.check_preset("model.preset", m.preset)
        ctx.check_shrink("model.shrink", m.shrink, load_config(m.preset))
    ctx.check_min("model.num_layers", m.num_layers)
    ctx.check_exec("impl", cfg.impl, available_impls())
    if not cfg.inputs:
        ctx.fail("inputs", "is an empty list of inputs ({kind: random | hidden | trace, ...})")
    for i, inp in enumerate(cfg.inputs):
        if inp.kind == "hidden" and not inp.path:
            ctx.fail(f"inputs[{i}].path", "is required with kind: hidden")
    ctx.check_list("budgets", cfg.budgets, lo=None)
    for i, b in enumerate(cfg.budgets):
        ctx.check_fraction(f"budgets[{i}]", b)  # of all routed-expert bytes
    for key in ("policies", "scopes", "predictors"):
        ctx.check_list(key, getattr(cfg, key), lo=None)
    for key in ("tokens", "train_tokens"):
        ctx.check_min(key, getattr(cfg, key), 2)
    if cfg.prefetch_k is not None:
        ctx.check_min("prefetch_k", cfg.prefetch_k, 0)
    ctx.check_name(cfg.name)


config_from_mapping = mapping_reader(OffloadSweepConfig, check, default_name=KIND)


def stack_config(cfg: OffloadSweepConfig) -> MoEConfig:
    """The `MoEConfig` of the random layer stack: the preset shrunk by ``model.shrink``
    (`jaxmoe.evaluation.presets.shrink_config`) to ``model.num_layers`` MoE layers."""
    m = cfg.model
    return PresetSection(m.preset, m.shrink).config(num_layers=m.num_layers)


def build_store(cfg: OffloadSweepConfig, out: Path):
    """Opens ``model.store`` or writes seeded random layers of the shrunk preset to ``out``."""
    m = cfg.model
    if m.store:
        return open_store(m.store)
    mcfg = stack_config(cfg)
    layers = random_layers(mcfg, m.num_layers, seed=m.seed)
    if m.storage.startswith("gguf:"):
        return write_gguf_store(out / "experts.gguf", mcfg, layers, qtype=m.storage[5:])
    return write_safetensors_store(out / "store", mcfg, layers, kind=m.storage, group_size=32)


def input_label(inp: SweepInput) -> str:
    """How results name an input: ``random(seed=1)``, ``hidden:<file>``, ``trace:<file>``
    or ``synthetic(locality=..., layer_corr=..., zipf=...)``."""
    if inp.kind == "random":
        return f"random(seed={inp.seed})"
    if inp.path:
        return f"{inp.kind}:{Path(inp.path).name}"
    return f"synthetic(locality={inp.locality}, layer_corr={inp.layer_corr}, zipf={inp.zipf})"


def prepare_input(inp: SweepInput, model, n: int, n_train: int):
    """Returns (label, x_train, x_test, trace_train, trace_test) for one input.

    ``model`` needs ``cfg`` and ``num_layers`` (an `OffloadedModel`). Training rows come
    first in a file, measured rows after them; traces are ``None`` unless the input is a
    trace (recorded or synthetic).
    """
    cfg, L = model.cfg, model.num_layers
    rng = np.random.default_rng(inp.seed)
    rand = lambda k: (inp.scale * rng.standard_normal((k, cfg.d_model))).astype(np.float32)  # noqa: E731
    label = input_label(inp)
    if inp.kind == "random":
        return label, rand(n_train), rand(n), None, None
    if inp.kind == "hidden":
        h = load_hidden(inp.path, cfg.d_model)
        if h.shape[0] < n + 2:
            raise ValueError(f"inputs: {inp.path} has {h.shape[0]} tokens, the sweep needs at least {n + 2}")
        k = min(n_train, h.shape[0] - n)
        return label, h[:k], h[k : k + n], None, None
    if inp.path:
        tr = load_trace(inp.path, L, cfg.num_experts, cfg.top_k)[:, :L]
        if tr.shape[0] < n + 2:
            raise ValueError(f"inputs: {inp.path} has {tr.shape[0]} tokens, the sweep needs at least {n + 2}")
        k = min(n_train, tr.shape[0] - n)
        return label, rand(k), rand(n), tr[:k], tr[k : k + n]
    tr = synthetic_trace(
        n_train + n,
        L,
        cfg.num_experts,
        cfg.top_k,
        locality=inp.locality,
        layer_corr=inp.layer_corr,
        zipf=inp.zipf,
        seed=inp.seed,
    )
    return label, rand(n_train), rand(n), tr[:n_train], tr[n_train:]


def run_sweep(cfg: OffloadSweepConfig, out: Path, log: Callable[[str], Any] = print) -> dict[str, Any]:
    """Runs every configuration of ``cfg``; writes ``results.json`` (and ``offload.png``,
    the routing traces as safetensors, hidden states as ``.npy``) into ``out``. Returns the results;
    ``results["gate"]["passed"]`` (= ``all_identical``) says whether every streamed run was
    bit-identical to the resident run."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    store = build_store(cfg, out)
    model = OffloadedModel(store, ex=cfg.impl)
    mcfg = model.cfg
    eb = store.expert_nbytes(0)
    total = store.total_expert_bytes()
    results: dict[str, Any] = {
        **cfg.results_head(),
        "model": {
            "preset": cfg.model.preset,
            "store": str(store.path),
            "storage": store.kind,
            "num_layers": model.num_layers,
            "d_model": mcfg.d_model,
            "expert_dim": mcfg.expert_dim,
            "num_experts": mcfg.num_experts,
            "top_k": mcfg.top_k,
            "expert_bytes": eb,
            "total_expert_bytes": total,
            "impl": cfg.impl.label,
        },
        "inputs": [],
        "configurations": [],
    }
    n, n_train = cfg.tokens, cfg.train_tokens
    for ii, inp in enumerate(cfg.inputs):
        label, x_train, x, tr_train, tr = prepare_input(inp, model, n, n_train)
        ref = model.run_resident(x, trace=tr)
        ref = model.run_resident(x, trace=tr)  # timed again after the first run's compiles
        save_trace(out / f"input{ii}_trace.safetensors", ref.ids, mcfg.num_experts, preset=cfg.model.preset or "")
        if inp.kind != "trace":
            np.save(out / f"input{ii}_hidden.npy", ref.hidden[:, 0])
        learned = None
        if "learned" in cfg.predictors:
            if tr_train is not None:
                # replayed routes: the hidden states carry no routing signal, train on the ids
                learned = train_learned(tr_train, mcfg.num_experts, **cfg.learned.kwargs())
            else:
                rtrain = model.run_resident(x_train)
                learned = train_learned(rtrain.ids, mcfg.num_experts, rtrain.hidden, **cfg.learned.kwargs())
        info = {
            "input": label,
            "kind": inp.kind,
            "tokens": n,
            "reuse_rate": reuse_rate(ref.ids),
            "resident_tokens_per_s": ref.tokens_per_s,
        }
        results["inputs"].append(info)
        log(f"[{label}] resident {ref.tokens_per_s:.1f} tok/s, reuse rate {info['reuse_rate']:.3f}")
        for frac in cfg.budgets:
            budget = int(round(frac * total))
            for policy in cfg.policies:
                for scope in cfg.scopes:
                    for pname in cfg.predictors:
                        pred = make_predictor(
                            pname, resident=model.resident, router_cfg=mcfg.router, learned=learned, oracle_ids=ref.ids
                        )
                        ocfg = OffloadConfig(budget, policy, scope, cfg.prefetch_k, cfg.asynchronous)
                        got, st = model.run_offloaded(x, ocfg, pred, trace=tr)
                        d = st.to_dict()
                        row = {
                            "input": label,
                            "budget_fraction": frac,
                            "budget_experts": budget // eb,
                            "policy": policy,
                            "scope": scope,
                            "predictor": pname,
                            "identical_to_resident": bool(np.array_equal(got.outputs, ref.outputs)),
                            "resident_tokens_per_s": ref.tokens_per_s,
                            **d,
                        }
                        results["configurations"].append(row)
                        log(
                            f"  budget {frac:4.2f} {policy}/{scope} {pname:11s} hit {d['hit_rate']:.3f} "
                            f"recall {d['recall'] if d['recall'] is not None else float('nan'):.3f} "
                            f"{d['bytes_loaded_per_token'] / 1e3:9.1f} kB/tok wait {d['wait_s']:.3f}s "
                            f"{d['tokens_per_s']:.1f} tok/s identical={row['identical_to_resident']}"
                        )
    results["all_identical"] = all(r["identical_to_resident"] for r in results["configurations"])
    results["gate"] = {"passed": results["all_identical"]}
    results["seconds"] = time.time() - t_start
    (out / "results.json").write_text(json.dumps(results, indent=1, default=float))
    if cfg.plots:
        results["plot"] = str(plot_results(results, out / "offload.png"))
    return results


def plot_results(results: dict, path: Path) -> Path:
    """Hit rate and tokens/s against budget, one line per predictor, one row per input."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["configurations"]
    inputs = [i["input"] for i in results["inputs"]]
    fig, axes = plt.subplots(len(inputs), 2, figsize=(11, 3.2 * len(inputs)), squeeze=False)
    for r, label in enumerate(inputs):
        sub = [x for x in rows if x["input"] == label]
        combos = sorted({(x["predictor"], x["policy"], x["scope"]) for x in sub})
        for combo in combos:
            pts = sorted(
                (x["budget_fraction"], x["hit_rate"], x["tokens_per_s"])
                for x in sub
                if (x["predictor"], x["policy"], x["scope"]) == combo
            )
            name = combo[0] if len(combos) == len({c[0] for c in combos}) else "/".join(combo)
            axes[r, 0].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
            axes[r, 1].plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=name)
        res_tps = next(i["resident_tokens_per_s"] for i in results["inputs"] if i["input"] == label)
        axes[r, 1].axhline(res_tps, color="k", ls="--", lw=1, label="resident")
        axes[r, 0].set_ylabel("hit rate")
        axes[r, 1].set_ylabel("tokens/s")
        axes[r, 0].set_title(label, fontsize=9)
        axes[r, 1].set_title(label, fontsize=9)
        for a in axes[r]:
            a.set_xlabel("cache budget (fraction of routed-expert bytes)")
            a.grid(alpha=0.3)
        axes[r, 1].legend(fontsize=7)
    m = results["model"]
    fig.suptitle(
        f"{results['name']}: {m['num_layers']} layers, E={m['num_experts']}, k={m['top_k']}, "
        f"{m['storage']} experts of {m['expert_bytes'] / 1e3:.1f} kB, impl {m['impl']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run(cfg: OffloadSweepConfig, opts: RunOptions | None = None) -> tuple[dict, Path]:
    """Runs the sweep into the run directory (``out``, else ``<output_dir>/<name>-<UTC
    timestamp>``), logging one line per configuration. Returns (results, run directory).
    ``opts.source`` and ``opts.overrides`` are recorded in the results; ``opts.progress``
    does not apply (the log lines are the progress)."""
    opts = opts or RunOptions()
    source, out, overrides = opts.source, opts.out, list(opts.overrides)
    console = opts.console or Console()
    run_dir = make_run_dir(cfg.output_dir, cfg.name, out)
    res = run_sweep(cfg, run_dir, log=lambda s: console.print(s, markup=False, highlight=False, soft_wrap=True))
    res["config_file"] = source
    res["overrides"] = list(overrides or [])
    (run_dir / "results.json").write_text(json.dumps(res, indent=1, default=float))
    console.print(
        f"results: {run_dir}/ (results.json{', offload.png' if cfg.plots else ''}; "
        f"{len(res['configurations'])} configurations, all identical to resident: {res['all_identical']}, "
        f"{res['seconds']:.0f} s)",
        soft_wrap=True,
    )
    return res, run_dir

"""`jaxmoe eval`: config validation, --set overrides, the float64 reference, metrics, and
the runner end to end on tiny configs (files, JSON schema, PNGs, the regression gate)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import jax.numpy as jnp
import matplotlib.image as mpimg
import numpy as np
import pytest
import yaml

import jaxmoe
from jaxmoe.config import MoEConfig, RouterConfig
from jaxmoe.evaluation import ConfigError, cli_main, config_from_mapping, load_eval_config
from jaxmoe.evaluation import metrics as M
from jaxmoe.evaluation.config import EvalConfig, case_tolerance
from jaxmoe.evaluation.expert_parallel import ExpertParallelConfig
from jaxmoe.evaluation.kinds import KINDS, from_mapping, load_any
from jaxmoe.evaluation.offload import OffloadSweepConfig, stack_config
from jaxmoe.evaluation.presets import shrink_config
from jaxmoe.evaluation.reference import dequantize_f64, reference_forward
from jaxmoe.evaluation.runner import moe_apply_jit
from jaxmoe.evaluation.schema import apply_overrides, evals_dir, list_eval_configs, parse_override
from jaxmoe.evaluation.train import TrainEvalConfig, reference_grads
from jaxmoe.execution import ExecConfig
from jaxmoe.experts import ExpertWeights, SharedWeights
from jaxmoe.params import MoEParams

TINY = {
    "name": "tiny",
    "model": {
        "preset": "qwen3.6-35b-a3b",
        "layers": [1],
        "shrink": {"d_model": 64, "expert_dim": 32, "num_experts": 16},
    },
    "inputs": {"kind": "random", "seed": 3, "scale": 1.5, "stats_tokens": 96},
    "impls": ["auto", "gather", "dense"],
    "tokens": [1, 5, 12],
    "reference": {"impl": "float64", "max_tokens": 12},
    "repeats": 2,
    "warmup": 0,
    "tolerance": {"default": 1.0e-5},
    "min_routing_agreement": 1.0,
    "heatmap_tokens": 16,
}


def _write(tmp_path: Path, data: dict, name: str = "tiny.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data))
    return p


def _q(x):
    """Asserts ``x`` is a {"value", "unit"} quantity and returns the value."""
    assert isinstance(x, dict) and set(x) == {"value", "unit"} and isinstance(x["unit"], str) and x["unit"], x
    return x["value"]


# --------------------------------------------------------------------------- config


def test_shipped_configs_validate():
    names = list_eval_configs()
    for want in ("default", "presets-sweep", "quantized", "gguf"):
        assert want in names
    for n in ("default", "presets-sweep", "quantized"):
        cfg = load_eval_config(n)
        assert cfg.name == n
    d = load_eval_config("default")
    assert d.model.preset == "qwen3.6-35b-a3b" and {ex.label for ex in d.impls} == {
        "auto",
        "cpu",
        "xla",
        "gather",
        "dense",
    }
    with pytest.raises(ConfigError, match=r"gguf\.yaml: key 'model.path'.*--set model.path"):
        load_eval_config("gguf")
    # narrowing a shipped config leaves its named tolerances unused, not wrong
    q = load_eval_config("quantized", ["impls=[gather]", "dtypes=[float32]"])
    assert q.impls == (ExecConfig(impl="gather"),) and case_tolerance(q, "gather", "float32", "int4") == 1e-4
    int8, ggml = load_eval_config("quantized").impls[-2:]
    assert int8 == ExecConfig(impl="cpu", activations="int8") and int8.label == "cpu,activations=int8"
    assert case_tolerance(load_eval_config("quantized"), int8, "float32", "int8") == 3e-2
    assert ggml == ExecConfig(activations="ggml") and ggml.label == "auto,activations=ggml"
    assert case_tolerance(load_eval_config("quantized"), ggml, "float32", "int8") == 1e-4


@pytest.mark.parametrize(
    "mutate, key, text",
    [
        (lambda d: d.update(bogus=1), "bogus", "unknown key"),
        (lambda d: d["model"].update(presett="x"), "model.presett", "unknown key"),
        (lambda d: d["model"]["shrink"].update(width=3), "model.shrink.width", "unknown key"),
        (lambda d: d.update(tokens=["a", 2]), r"tokens\[0\]", "must be an int, got str 'a'"),
        (lambda d: d.update(repeats=2.5), "repeats", "must be an int, got float 2.5"),
        (lambda d: d.update(plots="yes"), "plots", "must be a bool"),
        (lambda d: d["inputs"].update(kind="video"), "inputs.kind", "must be one of"),
        (lambda d: d.update(impls=["dense", "warp"]), r"impls\[1\]", "impl 'warp' is not available"),
        (
            lambda d: d.update(impls=["cpu_int8"]),
            r"impls\[0\]",
            r"was removed; use the entry \{impl: cpu, activations: int8\}",
        ),
        (lambda d: d.update(impls=[{"impl": "xla", "activations": "int8"}]), r"impls\[0\]", "a mode of impl='cpu'"),
        (lambda d: d.update(impls=[{"impl": "cpu", "int8": True}]), r"impls\[0\]", "unknown key 'int8'"),
        (lambda d: d.update(impls=["cpu", {"impl": "cpu"}]), "impls", "has duplicates"),
        (lambda d: d["model"].update(batch_invariant=True), "model.batch_invariant", "was removed"),
        (lambda d: d["model"].update(preset="nope-1b"), "model.preset", "unknown preset 'nope-1b'"),
        (lambda d: d.update(tolerance={"gathr": 1e-3}), "tolerance.gathr", "matches no case"),
        (lambda d: d.update(tolerance={"dense/float16": 1e-3}), "tolerance.dense/float16", "matches no case"),
        (lambda d: d.update(tokens=[4, 4]), "tokens", "duplicates"),
        (lambda d: d.update(reference={"impl": "nope"}), "reference.impl", "must be 'float64' or an available impl"),
        (lambda d: d["inputs"].update(kind="npy"), "inputs.path", "is required"),
        (lambda d: d.update(model="qwen"), "model", "must be a mapping"),
    ],
)
def test_config_errors_name_file_and_key(tmp_path, mutate, key, text):
    data = json.loads(json.dumps(TINY))
    mutate(data)
    p = _write(tmp_path, data, "bad.yaml")
    with pytest.raises(ConfigError, match=rf"bad\.yaml: key '{key}'.*{text}"):
        load_eval_config(p)
    assert cli_main([str(p), "--no-progress", "--out", str(tmp_path / "never")]) == 2
    assert not (tmp_path / "never").exists()


def test_cli_exit_2_for_missing_config_and_bad_set(tmp_path, capsys):
    assert cli_main([str(tmp_path / "missing.yaml")]) == 2
    assert "not found" in capsys.readouterr().err
    p = _write(tmp_path, TINY)
    assert cli_main([str(p), "--set", "novalue"]) == 2
    assert "expected key=value" in capsys.readouterr().err
    assert cli_main([str(p), "--set", "model.seed=x7"]) == 2
    err = capsys.readouterr().err
    assert "key 'model.seed' (from --set model.seed=x7): must be an int" in err


def test_layer_errors_are_config_errors(tmp_path, capsys):
    data = json.loads(json.dumps(TINY))
    data["model"] = {"preset": "deepseek-v3", "layers": [1], "shrink": {"d_model": 64, "expert_dim": 32}}
    p = _write(tmp_path, data)
    assert cli_main([str(p), "--no-progress", "--out", str(tmp_path / "o")]) == 2
    assert "key 'model.layers': layer 1 of deepseek-v3 is a dense layer" in capsys.readouterr().err
    data["model"]["layers"] = [3]
    data["quantize"] = ["int4"]
    data["model"]["shrink"] = {"d_model": 96, "expert_dim": 32}
    p = _write(tmp_path, data)
    assert cli_main([str(p), "--no-progress", "--out", str(tmp_path / "o")]) == 2
    assert "key 'quantize': int4 needs d_model and expert_dim divisible by 64" in capsys.readouterr().err


def test_set_overrides_are_yaml_typed_and_dotted():
    assert parse_override("tokens=[1, 8]") == ("tokens", [1, 8])
    assert parse_override("tolerance.int4=1e-3") == ("tolerance.int4", 1e-3)
    assert parse_override("plots=false") == ("plots", False)
    assert parse_override("model.path=a=b.gguf") == ("model.path", "a=b.gguf")
    assert parse_override("model.shrink=null") == ("model.shrink", None)
    data, seen = apply_overrides(
        {"model": {"preset": "x", "shrink": None}},
        ["model.shrink.d_model=32", "inputs.seed=9", "model.preset=mixtral-8x7b"],
    )
    assert data == {"model": {"preset": "mixtral-8x7b", "shrink": {"d_model": 32}}, "inputs": {"seed": 9}}
    assert seen["inputs.seed"] == "inputs.seed=9"
    with pytest.raises(ConfigError, match="holds str 'x', not a mapping"):
        apply_overrides({"model": {"preset": "x"}}, ["model.preset.name=3"])
    cfg = config_from_mapping(
        TINY, "t.yaml", ["tokens=[2,3]", "model.seed=4", "tolerance.dense=2e-3", "reference=gather", "inputs.scale=0.5"]
    )
    assert cfg.tokens == (2, 3) and cfg.model.seed == 4 and cfg.inputs.scale == 0.5
    assert cfg.ref.impl == "gather" and cfg.ref.max_tokens == 64
    assert case_tolerance(cfg, "dense", "float32", "none") == 2e-3
    assert case_tolerance(cfg, "gather", "float32", "none") == 1e-5
    with pytest.raises(ConfigError, match=r"t\.yaml: key 'model.sede' \(from --set model.sede=1\): unknown key"):
        config_from_mapping(TINY, "t.yaml", ["model.sede=1"])


def test_case_tolerance_picks_label_then_largest_component():
    data = dict(
        TINY,
        dtypes=["float32", "bfloat16"],
        quantize=["none", "int4"],
        tolerance={"default": 1e-5, "bfloat16": 1e-2, "int4": 0.2, "gather/bfloat16": 5e-3},
    )
    cfg = config_from_mapping(data)
    assert case_tolerance(cfg, "dense", "float32", "none") == 1e-5
    assert case_tolerance(cfg, "dense", "bfloat16", "none") == 1e-2
    assert case_tolerance(cfg, "dense", "bfloat16", "int4") == 0.2
    assert case_tolerance(cfg, "gather", "bfloat16", "none") == 5e-3


def test_shrink_keeps_every_preset_valid():
    s = load_eval_config("presets-sweep").model.shrink
    for name in jaxmoe.list_presets():
        full = jaxmoe.load_config(name)
        c = shrink_config(full, **s.widths())
        assert c.d_model == 128 and c.expert_dim == 64
        assert c.num_experts == min(16, full.num_experts)
        assert c.top_k == min(full.top_k, c.num_experts)
        assert c.router.score_fn == full.router.score_fn and c.router.n_group == full.router.n_group
        if full.shared_expert_dim:
            assert c.shared_expert_dim == round(full.shared_expert_dim * 64 / full.expert_dim)


def test_every_kind_shrinks_by_one_rule():
    """``model.shrink`` means the same in every kind (`presets.shrink_config`): experts and
    top-k never grow, ``shared_expert_dim: 0`` drops the shared expert (and its gate)."""
    widths = {"d_model": 64, "expert_dim": 32, "shared_expert_dim": 0, "num_experts": 16, "top_k": 4}
    want = shrink_config(jaxmoe.load_config("qwen3.6-35b-a3b"), **widths)
    assert (want.d_model, want.expert_dim, want.num_experts, want.top_k) == (64, 32, 16, 4)
    assert want.shared_expert_dim == want.num_shared_experts == 0 and not want.shared_expert_gate
    flow = "model.shrink={" + ", ".join(f"{k}: {v}" for k, v in widths.items()) + "}"
    assert load_any("expert-parallel", [flow]).model.config() == want
    assert load_any("train", [flow, "hf=false"]).model.config() == want
    off = load_any("offload", [flow, "model.num_layers=2"])
    assert stack_config(off) == dataclasses.replace(want, num_layers=2, dense_layers=())
    mixtral = shrink_config(jaxmoe.load_config("mixtral-8x7b"), num_experts=16, top_k=8)
    assert (mixtral.num_experts, mixtral.top_k) == (8, 2)
    with pytest.raises(ConfigError, match=r"expert-parallel\.yaml: key 'model\.shrink\.d_model'.*must be >= 1, got 0"):
        load_any("expert-parallel", ["model.shrink.d_model=0"])


# --------------------------------------------------------------------------- float64 reference


def _loop_reference(p: MoEParams, x: np.ndarray, cfg: MoEConfig):
    """Token-by-token, slot-by-slot float64 forward (a second, loop-shaped reading of docs/routing.md)."""
    f = lambda a: None if a is None else np.asarray(a, np.float64)  # noqa: E731
    rc = cfg.router
    wr, br, sb = f(p.w_router), f(p.b_router), f(p.selection_bias)
    ew = p.experts
    wg, wu, wd = f(ew.w_gate), f(ew.w_up), f(ew.w_down)
    bg, bu, bd = f(ew.b_gate), f(ew.b_up), f(ew.b_down)
    sig = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731

    def act(g, u):
        if cfg.activation == "swiglu":
            return g * sig(g) * u
        g = np.minimum(g, cfg.swiglu_limit)
        u = np.clip(u, -cfg.swiglu_limit, cfg.swiglu_limit)
        return (u + 1) * g * sig(cfg.swiglu_alpha * g)

    ys, all_ids = [], []
    for xt in np.asarray(x, np.float64):
        z = xt @ wr + (0 if br is None else br)
        e = z.size
        if rc.score_fn in ("softmax", "softmax_topk"):
            s = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
        else:
            s = sig(z)
        c = list(z if rc.score_fn.endswith("_topk") else s + (0 if sb is None else sb))
        if rc.n_group > 1 and rc.topk_group < rc.n_group:
            per = e // rc.n_group
            score = []
            for g in range(rc.n_group):
                grp = sorted(c[g * per : (g + 1) * per], reverse=True)
                score.append(grp[0] if rc.group_score == "max" else grp[0] + grp[1])
            kept = sorted(range(rc.n_group), key=lambda g: (-score[g], g))[: rc.topk_group]
            c = [c[j] if j // per in kept else -np.inf for j in range(e)]
        ids = sorted(range(e), key=lambda j: (-c[j], j))[: rc.top_k]
        if rc.score_fn == "softmax_topk":
            w = np.exp(z[ids] - z[ids].max()) / np.exp(z[ids] - z[ids].max()).sum()
        elif rc.score_fn == "sigmoid_topk":
            w = sig(z[ids])
        else:
            w = s[ids]
        den = w.sum()
        if rc.renorm == "sum":
            w = w / den
        elif rc.renorm == "clamp":
            w = w / max(den, rc.renorm_eps)
        elif rc.renorm == "add":
            w = w / (den + rc.renorm_eps)
        w = w * rc.routed_scaling_factor
        y = np.zeros_like(xt)
        for j, wj in zip(ids, w):
            xin = xt * wj if cfg.weight_on_input else xt
            g = xin @ wg[j] + (0 if bg is None else bg[j])
            u = xin @ wu[j] + (0 if bu is None else bu[j])
            o = act(g, u) @ wd[j] + (0 if bd is None else bd[j])
            y += o if cfg.weight_on_input else wj * o
        if p.shared is not None:
            sh = p.shared
            o = act(xt @ f(sh.w_gate), xt @ f(sh.w_up)) @ f(sh.w_down)
            y += o * (sig(xt @ f(sh.gate)) if sh.gate is not None else 1.0)
        ys.append(y)
        all_ids.append(ids)
    return np.stack(ys), np.array(all_ids)


def _random_params(cfg: MoEConfig, rng) -> MoEParams:
    d, e, f, fs = cfg.d_model, cfg.num_experts, cfg.expert_dim, cfg.shared_expert_dim
    n = lambda *s: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[-2] if len(s) > 1 else 4), jnp.float32)  # noqa: E731
    ew = ExpertWeights(n(e, d, f), n(e, d, f), n(e, f, d))
    if cfg.expert_bias:
        ew = dataclasses.replace(ew, b_gate=n(e, f), b_up=n(e, f), b_down=n(e, d))
    shared = SharedWeights(n(d, fs), n(d, fs), n(fs, d), n(d) if cfg.shared_expert_gate else None) if fs else None
    return MoEParams(
        n(d, e),
        ew,
        n(e) if cfg.router.router_bias else None,
        jnp.asarray(rng.standard_normal(e) * 0.3, jnp.float32) if cfg.router.use_selection_bias else None,
        shared,
    )


LLAMA4_LIKE = MoEConfig(
    d_model=32,
    expert_dim=16,
    shared_expert_dim=16,
    num_shared_experts=1,
    weight_on_input=True,
    router=RouterConfig(num_experts=8, top_k=1, score_fn="sigmoid_topk", renorm="none"),
)
CLAMP_LIKE = MoEConfig(
    d_model=32,
    expert_dim=16,
    router=RouterConfig(
        num_experts=12,
        top_k=3,
        score_fn="softmax",
        renorm="clamp",
        renorm_eps=2.0**-14,
        n_group=4,
        topk_group=2,
        group_score="max",
    ),
)


@pytest.mark.parametrize("name", [*jaxmoe.list_presets(), "llama4-like", "clamp-like"])
@pytest.mark.slow
def test_reference_matches_loop_and_dense(name, rng):
    if name == "llama4-like":
        cfg = LLAMA4_LIKE
    elif name == "clamp-like":
        cfg = CLAMP_LIKE
    else:
        cfg = shrink_config(jaxmoe.load_config(name), **load_eval_config("presets-sweep").model.shrink.widths())
        cfg = dataclasses.replace(
            cfg,
            d_model=32,
            expert_dim=16,
            shared_expert_dim=min(cfg.shared_expert_dim, 24),
            num_shared_experts=min(cfg.num_shared_experts, 1 if cfg.shared_expert_dim else 0),
        )
    p = _random_params(cfg, rng)
    x = rng.standard_normal((9, cfg.d_model)) * 2.0
    y, r = reference_forward(p, x, cfg)
    y_loop, ids_loop = _loop_reference(p, x, cfg)
    np.testing.assert_array_equal(r.expert_ids, ids_loop)
    np.testing.assert_allclose(y, y_loop, rtol=1e-12, atol=1e-12)
    # and the library's float32 dense oracle agrees to float32 rounding
    y32 = np.asarray(moe_apply_jit(p, jnp.asarray(x, jnp.float32), cfg=cfg, impl="dense"), np.float64)
    assert M.errors(y32, y)["rel"] < 1e-5


def test_reference_dequantizes_quantized_experts(rng):
    cfg = dataclasses.replace(
        LLAMA4_LIKE,
        weight_on_input=False,
        router=dataclasses.replace(LLAMA4_LIKE.router, top_k=2, score_fn="softmax", renorm="sum"),
    )
    p = _random_params(cfg, rng)
    q = dataclasses.replace(
        p,
        experts=dataclasses.replace(
            p.experts,
            w_gate=jaxmoe.quant.quantize_int8(p.experts.w_gate),
            w_up=jaxmoe.quant.quantize_int8(p.experts.w_up),
            w_down=jaxmoe.quant.quantize_int4_affine(np.asarray(p.experts.w_down), group_size=16),
        ),
    )
    for w in (q.experts.w_gate, q.experts.w_down):  # numpy dequantization == the library's
        np.testing.assert_allclose(dequantize_f64(w), np.asarray(w.dequantize(jnp.float32)), rtol=1e-6, atol=1e-7)
    deq = dataclasses.replace(
        p,
        experts=dataclasses.replace(
            p.experts,
            w_gate=dequantize_f64(q.experts.w_gate),
            w_up=dequantize_f64(q.experts.w_up),
            w_down=dequantize_f64(q.experts.w_down),
        ),
    )
    x = rng.standard_normal((6, cfg.d_model))
    y_q, _ = reference_forward(q, x, cfg)
    y_loop, _ = _loop_reference(deq, x, cfg)
    np.testing.assert_allclose(y_q, y_loop, rtol=1e-12, atol=1e-12)
    assert M.errors(y_q, reference_forward(p, x, cfg)[0])["rel"] > 1e-4  # quantization changed something


# --------------------------------------------------------------------------- metrics


def test_metrics_against_plain_python(rng):
    e, k = 10, 3
    ids = np.stack([rng.choice(e, k, replace=False) for _ in range(40)])
    st = M.load_stats(ids, e)
    cnt = Counter(ids.ravel().tolist())
    counts = [cnt.get(i, 0) for i in range(e)]
    assert st["counts"] == counts
    mean = sum(counts) / e
    assert st["max_over_mean"] == pytest.approx(max(counts) / mean)
    assert st["cv"] == pytest.approx(np.sqrt(sum((c - mean) ** 2 for c in counts) / e) / mean)
    assert st["idle"] == sum(c == 0 for c in counts)
    other = ids.copy()
    other[::4, [0, 1]] = other[::4, [1, 0]]  # same sets, other slot order
    other[1] = [(v + 1) % e if v + 1 < e else v for v in other[1]]
    same = [set(a) == set(b) for a, b in zip(ids.tolist(), other.tolist())]
    assert M.routing_agreement(other, ids) == pytest.approx(sum(same) / len(same))
    ref = rng.standard_normal((5, 7))
    y = ref + rng.standard_normal((5, 7)) * 1e-3
    er = M.errors(y, ref)
    assert er["max_abs"] == pytest.approx(max(abs(a - b) for a, b in zip(y.ravel(), ref.ravel())))
    assert er["rel"] == pytest.approx(er["max_abs"] / max(abs(v) for v in ref.ravel()))
    y[2, 3] = np.nan
    assert M.errors(y, ref)["finite"] is False
    s = rng.random((6, e))
    p = s / s.sum(-1, keepdims=True)
    assert M.routing_entropy(s) == pytest.approx(float(np.mean([-sum(v * np.log(v) for v in row) for row in p])))
    t = M.timing([0.3, 0.1, 0.2, 0.4], 8)
    assert t["median_s"] == pytest.approx(0.25) and t["tokens_per_s"] == pytest.approx(32.0)


# --------------------------------------------------------------------------- end to end


def _check_png(path: Path):
    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
    assert float(img[..., :3].std()) > 0.05, f"{path.name} looks blank"


def test_eval_end_to_end(tmp_path, capsys):
    p = _write(tmp_path, dict(TINY, impls=["auto", "cpu", "dense"]))  # auto resolves to cpu here
    out = tmp_path / "run"
    rc = cli_main([str(p), "--out", str(out), "--set", "tokens=[1,6]", "--set", "inputs.seed=4"])
    assert rc == 0, capsys.readouterr()
    printed = capsys.readouterr().out
    assert "gate passed" in printed and str(out) in printed
    for f in (
        "results.json",
        "report.md",
        "config.yaml",
        "expert_load.png",
        "routing_heatmap.png",
        "time_vs_tokens.png",
    ):
        assert (out / f).is_file(), f
    res = json.loads((out / "results.json").read_text())
    assert res["schema"] == "jaxmoe.eval/1" and res["name"] == "tiny"
    assert res["overrides"] == ["tokens=[1,6]", "inputs.seed=4"]
    assert res["config"]["inputs"]["seed"] == 4 and res["config"]["tokens"] == [1, 6]
    assert yaml.safe_load((out / "config.yaml").read_text()) == res["config"]
    assert _q(res["wall_time"]) > 0
    assert res["gate"] == {"passed": True, "failures": [], "checked": 6, "skipped": 0}
    (lay,) = res["layers"]
    assert lay["label"] == "qwen3.6-35b-a3b/L1" and lay["moe_config"]["router"]["num_experts"] == 16
    st = lay["stats"]
    counts = _q(st["expert_load"])
    assert len(counts) == 16 and sum(counts) == 96 * 8 and _q(st["tokens"]) == 96
    assert _q(st["load_max_over_mean"]) == pytest.approx(max(counts) / np.mean(counts))
    assert _q(st["idle_experts"]) == counts.count(0)
    assert 0 < _q(st["routing_entropy"]) < _q(st["routing_entropy_max"])
    assert 1 / 8 <= _q(st["mean_top1_weight"]) <= 1 and 0 < _q(st["shared_gate_mean"]) < 1
    wb = {k: _q(v) for k, v in lay["weight_bytes"].items()}
    assert wb["per_expert"] == 3 * 64 * 32 * 4 and wb["router"] == 64 * 16 * 4
    rows = lay["results"]
    assert [(r["impl"], r["tokens"]) for r in rows] == [(i, t) for i in ("auto", "cpu", "dense") for t in (1, 6)]
    for r in rows:
        assert r["status"] == "ok" and r["passed"] is True
        assert 0 <= _q(r["rel_error"]) < 1e-5 and _q(r["max_abs_error"]) >= 0
        assert _q(r["routing_agreement"]) == 1.0 and _q(r["compared_tokens"]) == r["tokens"]
        assert _q(r["time_min"]) <= _q(r["time_median"]) <= _q(r["time_max"])
        assert _q(r["tokens_per_s"]) == pytest.approx(r["tokens"] / _q(r["time_median"]))
        touched = _q(r["experts_touched"])
        assert 8 <= touched <= 16
        assert _q(r["weight_bytes_read"]) == touched * wb["per_expert"] + wb["shared"] + wb["router"]
        assert _q(r["bandwidth"]) == pytest.approx(_q(r["weight_bytes_read"]) / _q(r["time_median"]) / 1e9)
    auto1 = rows[0]
    assert auto1["resolved_impl"] == "cpu" and auto1["measured_as"] == "cpu/float32"
    assert auto1["time_median"] == rows[2]["time_median"]
    md = (out / "report.md").read_text()
    assert "| layer | case |" in md and md.count("| qwen3.6-35b-a3b/L1 |") == 7 and "gate: PASSED" in md
    for png in ("expert_load.png", "routing_heatmap.png", "time_vs_tokens.png"):
        _check_png(out / png)
        assert f"]({png})" in md


def test_eval_gate_fails_on_impossible_tolerance(tmp_path, capsys):
    p = _write(tmp_path, TINY)
    out = tmp_path / "run"
    rc = cli_main(
        [
            str(p),
            "--no-progress",
            "--out",
            str(out),
            "--set",
            "impls=[gather]",
            "--set",
            "tokens=[3]",
            "--set",
            "tolerance.default=1e-12",
            "--set",
            "plots=false",
        ]
    )
    assert rc == 1
    assert "FAIL" in capsys.readouterr().out
    res = json.loads((out / "results.json").read_text())
    assert res["gate"]["passed"] is False
    assert res["gate"]["failures"] == [
        f"qwen3.6-35b-a3b/L1 gather/float32 T=3: rel_error "
        f"{_q(res['layers'][0]['results'][0]['rel_error']):.3g} > tolerance 1e-12"
    ]
    assert not list(out.glob("*.png"))


def test_eval_quantized_and_npy_inputs(tmp_path, rng):
    x = rng.standard_normal((2, 10, 64)).astype(np.float32)
    np.save(tmp_path / "h.npy", x)
    model = dict(TINY["model"], shrink={"d_model": 64, "expert_dim": 64, "num_experts": 16})
    data = dict(
        TINY,
        model=model,
        impls=["gather"],
        tokens=[20],
        quantize=["none", "int8", "int4"],
        plots=False,
        inputs={"kind": "npy", "path": str(tmp_path / "h.npy"), "stats_tokens": 64},
        tolerance={"default": 1e-5, "int8": 0.05, "int4": 0.3},
        min_routing_agreement=0.0,
    )
    out = tmp_path / "run"
    assert cli_main([str(_write(tmp_path, data)), "--no-progress", "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    lay = res["layers"][0]
    assert _q(lay["stats"]["tokens"]) == 20  # every token of the file
    by = {(r["quantize"], r["tokens"]): r for r in lay["results"]}
    # the gate: each case against the float64 forward of ITS weights (dequantized): tight
    assert all(_q(by[(q, 20)]["rel_error"]) < 1e-5 for q in ("none", "int8", "int4"))
    # the quantization error against the float weights is reported separately, not gated
    assert "quantization_error" not in by[("none", 20)]
    e8, e4 = (_q(by[(q, 20)]["quantization_error"]) for q in ("int8", "int4"))
    assert 1e-5 < e8 < e4 < 0.3
    assert "quantization error" in (out / "report.md").read_text()
    b = {q: _q(by[(q, 20)]["weight_bytes_read"]) for q in ("none", "int8", "int4")}
    assert b["int4"] < b["int8"] < b["none"]
    # too few tokens in the file for the requested counts: a config error
    data["tokens"] = [21]
    assert cli_main([str(_write(tmp_path, data)), "--no-progress", "--out", str(out)]) == 2


def test_float32_case_of_a_bfloat16_model_sees_the_references_inputs(tmp_path):
    """A bfloat16 model's reference computes from the activations rounded to bfloat16; a
    float32 case must take the same inputs (it took the unrounded ones until 5 Dec 2026 and
    missed a 1e-5 gate by bfloat16 rounding, ~3e-3)."""
    model = dict(TINY["model"], dtype="bfloat16")
    data = dict(TINY, model=model, impls=["xla"], tokens=[6], dtypes=["float32"], plots=False)
    out = tmp_path / "run"
    assert cli_main([str(_write(tmp_path, data)), "--no-progress", "--out", str(out)]) == 0
    (row,) = json.loads((out / "results.json").read_text())["layers"][0]["results"]
    assert row["passed"] and _q(row["rel_error"]) < 1e-5


@pytest.mark.slow
def test_eval_int8_activations_impl(tmp_path):
    """The entry ``{impl: cpu, activations: int8}`` (label ``cpu,activations=int8``) runs
    ``cpu`` with int8 activations: on int8 / int4 experts its error against the dequantized
    weights' float64 forward is the documented Q8 error (well above float rounding, ~1% of the
    output), while ``cpu`` stays within float rounding; on float experts it is ``cpu`` exactly
    (float weights keep float activations)."""
    int8 = "cpu,activations=int8"
    model = dict(TINY["model"], shrink={"d_model": 64, "expert_dim": 64, "num_experts": 16})
    data = dict(
        TINY,
        model=model,
        impls=["cpu", {"impl": "cpu", "activations": "int8"}],
        tokens=[9],
        quantize=["none", "int8", "int4"],
        plots=False,
        tolerance={"default": 1e-5, int8: 3e-2},
        min_routing_agreement=0.0,
    )
    out = tmp_path / "run"
    assert cli_main([str(_write(tmp_path, data)), "--no-progress", "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["config"]["impls"] == ["cpu", {"impl": "cpu", "activations": "int8"}]
    by = {(r["impl"], r["quantize"]): r for r in res["layers"][0]["results"]}
    assert by[(int8, "int8")]["resolved_impl"] == "cpu" and by[(int8, "int8")]["case"] == f"{int8}/float32/int8"
    for q in ("int8", "int4"):
        assert _q(by[("cpu", q)]["rel_error"]) < 1e-5
        assert 1e-4 < _q(by[(int8, q)]["rel_error"]) < 3e-2, q
    assert _q(by[(int8, "none")]["rel_error"]) == _q(by[("cpu", "none")]["rel_error"])
    # the tolerance names it by its label like any impl: a 1e-5 gate on it fails
    data["tolerance"] = {"default": 1e-5}
    assert cli_main([str(_write(tmp_path, data)), "--no-progress", "--out", str(out)]) == 1


def test_quantized_gate_fails_a_broken_kernel(tmp_path):
    """A deliberately broken quantized impl (its int4 dequantization off by one code) passes
    a loose quantization-error tolerance against the float weights but fails the tight gate
    against the dequantized weights; the float cases are untouched."""
    from jaxmoe.impls import registry

    good = registry.get_impl("gather").routed

    def broken(x, routing, ew, cfg, ex):
        def off(w):
            if isinstance(w, jaxmoe.QuantizedTensor) and w.kind == "int4":
                assert w.scales is not None and w.biases is not None
                return dataclasses.replace(w, biases=w.biases + w.scales)  # every code read as q + 1
            return w

        return good(x, routing, dataclasses.replace(ew, w_gate=off(ew.w_gate)), cfg, ex)

    model = dict(TINY["model"], shrink={"d_model": 64, "expert_dim": 64, "num_experts": 16})
    data = dict(
        TINY,
        model=model,
        impls=["broken_q"],
        tokens=[5],
        quantize=["none", "int8", "int4"],
        plots=False,
        tolerance={"default": 1e-5},
        min_routing_agreement=0.0,
    )
    out = tmp_path / "run"
    registry.register_impl("broken_q", broken)
    try:
        assert cli_main([str(_write(tmp_path, data)), "--no-progress", "--out", str(out)]) == 1
    finally:
        registry.unregister_impl("broken_q")
    res = json.loads((out / "results.json").read_text())
    by = {r["quantize"]: r for r in res["layers"][0]["results"]}
    assert by["none"]["passed"] and by["int8"]["passed"] and not by["int4"]["passed"]
    assert "rel_error" in by["int4"]["reason"]
    assert res["gate"]["failures"] and "broken_q/float32/int4" in res["gate"]["failures"][0]
    assert _q(by["int4"]["quantization_error"]) < 0.5  # a loose quantization-error bound would not catch it


def test_eval_reads_a_gguf_file(tmp_path, rng):
    cfg = shrink_config(
        jaxmoe.load_config("qwen3.6-35b-a3b"), **load_eval_config("presets-sweep").model.shrink.widths()
    )
    cfg = dataclasses.replace(cfg, d_model=64, expert_dim=32, shared_expert_dim=32)
    block = jaxmoe.MoEBlock(cfg, params=_random_params(cfg, rng))
    path = jaxmoe.save_gguf(block, tmp_path / "m.gguf", layer=0, dtype="q8_0")
    out = tmp_path / "run"
    rc = cli_main(
        [
            "gguf",
            "--no-progress",
            "--out",
            str(out),
            "--set",
            f"model.path={path}",
            "--set",
            "impls=[gather]",
            "--set",
            "tokens=[1,6]",
            "--set",
            "plots=false",
            "--set",
            "min_routing_agreement=1.0",
        ]
    )
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    lay = res["layers"][0]
    assert lay["label"] == "m.gguf/L0" and lay["weights"] == "checkpoint"
    assert _q(lay["weight_bytes"]["per_expert"]) == 3 * 64 * 32 + 3 * 64 * 32 // 32 * 2  # Q8_0: int8 + f16 scales
    assert all(r["passed"] for r in lay["results"])


def test_kind_key_picks_schema_and_runner(tmp_path, monkeypatch, capsys):
    """Every shipped config names its kind; the kind picks the schema and the runner; one
    engine checks every kind (unknown keys, types, --set) with errors naming file and key."""
    want = {
        "default": EvalConfig,
        "expert-parallel": ExpertParallelConfig,
        "offload": OffloadSweepConfig,
        "train": TrainEvalConfig,
    }
    assert {n: k.config_class for n, k in KINDS.items()} == want
    for name in list_eval_configs():
        raw = yaml.safe_load((evals_dir() / f"{name}.yaml").read_text())
        assert raw["kind"] in KINDS, name  # explicit, no sniffing
        if name != "gguf":  # gguf needs --set model.path
            cfg = load_any(name)
            assert isinstance(cfg, want[raw["kind"]]) and cfg.kind == raw["kind"] and cfg.name == name
    assert isinstance(from_mapping(TINY), EvalConfig)  # no kind key: the default kind
    ep = load_any("expert-parallel", ["tokens=[4]", "mesh=[{expert: 2}]"])
    assert ep.tokens == (4,) and ep.mesh[0].expert == 2 and ep.mesh[0].data == 1
    off = load_any("offload", ["tokens=8", "learned.steps=3"])
    assert off.tokens == 8 and off.learned.kwargs() == {"steps": 3}
    # the same engine's errors for every kind: file, dotted key, the --set it came from
    with pytest.raises(ConfigError, match=r"offload\.yaml: key 'tokens' \(from --set tokens=x\): must be an int"):
        load_any("offload", ["tokens=x"])
    with pytest.raises(ConfigError, match=r"expert-parallel\.yaml: key 'mesh\[0\]\.data' .*must be an int"):
        load_any("expert-parallel", ["mesh=[{expert: 2, data: two}]"])
    with pytest.raises(
        ConfigError, match=r"offload\.yaml: key 'model\.shrink\.width' \(from --set model.shrink.width=3\): unknown key"
    ):
        load_any("offload", ["model.shrink.width=3"])
    with pytest.raises(ConfigError, match=r"offload\.yaml: key 'kind': is 'offload', but EvalConfig reads only"):
        load_eval_config("offload")

    # the CLI hands each kind to its runner
    seen = []

    def fake_run(cfg, opts):
        seen.append((type(cfg).__name__, opts.source, opts.out, list(opts.overrides)))
        return {"gate": {"passed": cfg.tokens != 9}}, opts.out

    monkeypatch.setitem(KINDS, "offload", dataclasses.replace(KINDS["offload"], run=fake_run))
    spec = {"kind": "offload", "name": "x", "model": {"preset": "qwen3.6-35b-a3b"}}
    p = _write(tmp_path, spec, "sweep.yaml")
    assert cli_main([str(p), "--out", str(tmp_path / "o"), "--set", "tokens=4"]) == 0
    assert seen == [("OffloadSweepConfig", str(p), str(tmp_path / "o"), ["tokens=4"])]
    assert cli_main([str(p), "--set", "tokens=9"]) == 1
    assert len(seen) == 2
    for bad, key, text in (
        ({**spec, "kind": "sweep"}, "kind", "unknown kind 'sweep'; known kinds: "),
        ({**spec, "kind": 3}, "kind", "must be a string"),
        ({**spec, "runner": "jaxmoe.offload.sweep"}, "runner", "unknown key"),
        ({**spec, "anything": [1, 2]}, "anything", "unknown key"),
    ):
        p = _write(tmp_path, bad, "bad.yaml")
        assert cli_main([str(p)]) == 2
        assert f"bad.yaml: key '{key}': {text}" in capsys.readouterr().err
    assert len(seen) == 2  # nothing ran
    assert cli_main(["--list"]) == 0
    assert "default" in capsys.readouterr().out.split()
    assert cli_main(["--help"]) == 0


def test_reference_matches_transformers_deepseek_v3_moe(rng):
    """Sigmoid scores, selection bias, top-2-sum group limit, renorm + 1e-20, x2.5 scaling and a
    shared expert: the HF DeepseekV3MoE module (float64, router in float32 as HF computes it)."""
    import torch
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Config, DeepseekV3MoE

    d, f, e, k = 32, 16, 16, 4
    hcfg = DeepseekV3Config(
        hidden_size=d,
        moe_intermediate_size=f,
        n_routed_experts=e,
        num_experts_per_tok=k,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        hidden_act="silu",
    )
    mod = DeepseekV3MoE(hcfg).double().eval()
    t = lambda *s: torch.tensor(rng.standard_normal(s) / np.sqrt(s[-1]), dtype=torch.float64)  # noqa: E731
    with torch.no_grad():
        mod.gate.weight.copy_(t(e, d).float())
        mod.gate.e_score_correction_bias.copy_(torch.tensor(rng.standard_normal(e) * 0.2, dtype=torch.float32))
        mod.experts.gate_up_proj.copy_(t(e, 2 * f, d))
        mod.experts.down_proj.copy_(t(e, d, f))
        for lin in (mod.shared_experts.gate_proj, mod.shared_experts.up_proj, mod.shared_experts.down_proj):
            lin.weight.copy_(t(*lin.weight.shape))
    x = rng.standard_normal((11, d))
    with torch.no_grad():
        y_hf = mod(torch.tensor(x)[None]).numpy()[0]
    gu = mod.experts.gate_up_proj.detach().numpy()
    sh = mod.shared_experts
    params = MoEParams(
        w_router=mod.gate.weight.detach().double().numpy().T,
        experts=ExpertWeights(
            gu[:, :f, :].transpose(0, 2, 1),
            gu[:, f:, :].transpose(0, 2, 1),
            mod.experts.down_proj.detach().numpy().transpose(0, 2, 1),
        ),
        selection_bias=mod.gate.e_score_correction_bias.detach().double().numpy(),
        shared=SharedWeights(
            sh.gate_proj.weight.detach().numpy().T,
            sh.up_proj.weight.detach().numpy().T,
            sh.down_proj.weight.detach().numpy().T,
        ),
    )
    cfg = shrink_config(jaxmoe.load_config("deepseek-v3"), **load_eval_config("presets-sweep").model.shrink.widths())
    cfg = dataclasses.replace(
        cfg,
        d_model=d,
        expert_dim=f,
        shared_expert_dim=f,
        router=dataclasses.replace(cfg.router, top_k=k, n_group=4, topk_group=2),
    )
    assert cfg.router.score_fn == "sigmoid" and cfg.router.renorm == "add" and cfg.router.routed_scaling_factor == 2.5
    with torch.no_grad():
        _, _, hf_ids = mod.gate(torch.tensor(x))
    y, r = reference_forward(params, x, cfg)
    np.testing.assert_array_equal(np.sort(r.expert_ids, -1), np.sort(hf_ids.numpy(), -1))
    assert M.errors(y, y_hf)["rel"] < 1e-6  # HF's router runs in float32


# --------------------------------------------------------------------------- kind: train


def _train_loss(params, x, g, cfg):
    return float(np.sum(g * reference_forward(params, x, cfg)[0]))


@pytest.mark.parametrize(
    "router, weight_on_input",
    [
        (RouterConfig(num_experts=6, top_k=2, renorm="sum"), False),  # Qwen
        (
            RouterConfig(
                num_experts=6, top_k=2, score_fn="sigmoid", renorm="add", renorm_eps=0.3, routed_scaling_factor=2.5
            ),
            False,
        ),
        (RouterConfig(num_experts=6, top_k=3, score_fn="softmax_topk", renorm="none"), False),  # Mixtral
        (RouterConfig(num_experts=6, top_k=1, score_fn="sigmoid_topk", renorm="none"), True),  # Llama 4
        (RouterConfig(num_experts=6, top_k=2, score_fn="sigmoid", renorm="clamp", renorm_eps=1e-3), False),
    ],
)
def test_train_reference_grads_match_finite_differences(router, weight_on_input, rng):
    """`reference_grads` (hand-written float64 backward) against central differences of the
    float64 forward `reference_forward`, at random coordinates of every gradient."""
    t, d, f, e = 5, 8, 6, router.num_experts
    cfg = MoEConfig(
        d_model=d,
        expert_dim=f,
        router=router,
        shared_expert_dim=4,
        num_shared_experts=1,
        shared_expert_gate=True,
        weight_on_input=weight_on_input,
    )
    n = lambda *s: rng.normal(size=s) * 0.7  # noqa: E731
    params = MoEParams(
        n(d, e),
        ExpertWeights(n(e, d, f), n(e, d, f), n(e, f, d)),
        None,
        None,
        SharedWeights(n(d, 4), n(d, 4), n(4, d), n(d)),
    )
    x, g = n(t, d), n(t, d)
    experts: dict[str, list] = {"experts.w_gate": [], "experts.w_up": [], "experts.w_down": []}
    small, _ = reference_grads(params, x, g, cfg, lambda i, gr: [experts[k].append(v) for k, v in gr.items()])
    where = {
        "x": (lambda a: (params, a), x),
        "w_router": (lambda a: (dataclasses.replace(params, w_router=a), x), params.w_router),
        "experts.w_gate": (
            lambda a: (dataclasses.replace(params, experts=dataclasses.replace(params.experts, w_gate=a)), x),
            params.experts.w_gate,
        ),
        "experts.w_down": (
            lambda a: (dataclasses.replace(params, experts=dataclasses.replace(params.experts, w_down=a)), x),
            params.experts.w_down,
        ),
        "shared.w_up": (
            lambda a: (dataclasses.replace(params, shared=dataclasses.replace(params.shared, w_up=a)), x),
            params.shared.w_up,
        ),
        "shared.gate": (
            lambda a: (dataclasses.replace(params, shared=dataclasses.replace(params.shared, gate=a)), x),
            params.shared.gate,
        ),
    }
    grads = {**small, **{k: np.stack(v) for k, v in experts.items()}}
    h = 1e-6
    for name, (put, base) in where.items():
        for _ in range(12):
            idx = tuple(int(rng.integers(s)) for s in base.shape)
            hi, lo = base.copy(), base.copy()
            hi[idx] += h
            lo[idx] -= h
            fd = (_train_loss(*put(hi), g, cfg) - _train_loss(*put(lo), g, cfg)) / (2 * h)
            assert grads[name][idx] == pytest.approx(fd, rel=1e-5, abs=1e-7), (name, idx)


@pytest.mark.slow
def test_eval_train_end_to_end(tmp_path, capsys):
    """`jaxmoe eval train` at tiny shapes: each impl's gradients within 1e-5 of float64, the
    Hugging Face block's too; an impossible tolerance fails the gate (exit code 1)."""
    shrink = "model.shrink={d_model: 64, expert_dim: 32, shared_expert_dim: 32, num_experts: 16}"
    args = ["train", "--set", shrink, "--set", "tokens=[3, 9]", "--set", "repeats=1", "--no-progress"]
    out = tmp_path / "run"
    rc = cli_main([*args, "--set", "impls=[auto, cpu, xla, dense]", "--set", "tolerance=1e-5", "--out", str(out)])
    assert rc == 0, capsys.readouterr()
    res = json.loads((out / "results.json").read_text())
    assert res["kind"] == "train" and res["gate"]["passed"]
    rows = {(c["impl"], c["tokens"]): c for c in res["cases"]}
    assert set(rows) == {(i, t) for i in ("hf", "auto", "cpu", "xla", "dense") for t in (3, 9)}
    for c in rows.values():
        assert c["status"] == "pass" and c["routing_agreement"] == 1.0
        assert set(c["grad_err"]) == {"x", "router", "experts", "shared", "max"}
        assert 0 < c["grad_err"]["max"] < 1e-5 and c["step_ms"] > 0 and c["fwd_ms"] > 0
        assert c["impl"] == "hf" or c["vs_hf"] == pytest.approx(rows["hf", c["tokens"]]["step_ms"] / c["step_ms"])
    md = (out / "report.md").read_text()
    assert md.count("| pass |") == 10 and "gate: passed" in md
    rc = cli_main(
        [*args, "--set", "impls=[dense]", "--set", "hf=false", "--set", "tolerance=1e-12", "--out", str(tmp_path / "f")]
    )
    assert rc == 1
    res = json.loads((tmp_path / "f" / "results.json").read_text())
    assert not res["gate"]["passed"] and {c["status"] for c in res["cases"]} == {"fail"}


def test_eval_train_config_errors():
    with pytest.raises(ConfigError, match=r"train\.yaml: key 'hf'.*Qwen3_5MoeSparseMoeBlock"):
        load_any("train", ["model.preset=mixtral-8x7b"])
    with pytest.raises(ConfigError, match=r"key 'model\.preset'.*no float64 backward reference"):
        load_any("train", ["model.preset=gpt-oss-20b", "hf=false"])
    with pytest.raises(ConfigError, match=r"key 'impl_max_tokens\.warp'.*is not an available impl"):
        load_any("train", ["impl_max_tokens={warp: 8}"])
    with pytest.raises(ConfigError, match=r"key 'tokens\[1\]'.*must be >= 1, got 0"):
        load_any("train", ["tokens=[3, 0]"])
    with pytest.raises(ConfigError, match=r"key 'model\.shrink'.*cannot keep the group limit"):
        load_any("train", ["model.preset=deepseek-v3", "hf=false", "model.shrink={num_experts: 12}"])
    cfg = load_any("train", ["impls=[xla, {impl: cpu, batch_invariant: true}]", "impl_max_tokens={cpu: 8}"])
    assert [ex.label for ex in cfg.impls] == ["xla", "cpu,batch_invariant=True"]
    cfg = load_any("train")
    assert cfg.kind == "train" and cfg.hf and cfg.tokens == (64, 256)


@pytest.mark.slow
def test_eval_keep_freed_memory_recorded(tmp_path):
    """``jaxmoe eval --keep-freed-memory`` in a fresh process sets the glibc options before
    JAX starts, runs, and records it in results.json and report.md; in a process whose JAX
    backends exist (this one) it is a command-line error naming the option."""
    from jaxmoe.host_memory import glibc_malloc_available

    p = _write(tmp_path, dict(TINY, impls=["auto"], tokens=[3], plots=False))
    out = tmp_path / "run"
    code = "import sys; from jaxmoe.cli import main; sys.exit(main(sys.argv[1:]))"
    args = ["eval", str(p), "--keep-freed-memory", "--no-progress", "--out", str(out)]
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    env = json.loads((out / "results.json").read_text())["environment"]
    want = "kept (jaxmoe.keep_freed_host_memory)" if glibc_malloc_available() else "default"
    assert env["host_memory"] == want
    assert f"host memory: {want}" in (out / "report.md").read_text()
    if glibc_malloc_available():
        jnp.arange(3).block_until_ready()
        assert cli_main([str(p), "--keep-freed-memory", "--no-progress", "--out", str(tmp_path / "x")]) == 2
        assert not (tmp_path / "x").exists()


def test_eval_ggml_entry_is_gated_against_its_own_oracle(tmp_path):
    """An entry with ``activations: ggml`` is gated against the float64 forward that converts
    the activations as ggml does (tight: only rounding-boundary flips), while its error
    against the float-activation forward (ggml's ~1% arithmetic error on quantized experts)
    is reported as ``quantization_error``; ``auto`` names a strategy that has the mode."""
    from jaxmoe.impls import registry

    ggml = "auto,activations=ggml"
    model = dict(TINY["model"], shrink={"d_model": 64, "expert_dim": 64, "num_experts": 16})
    data = dict(
        TINY,
        model=model,
        impls=["xla", {"impl": "auto", "activations": "ggml"}],
        tokens=[7],
        quantize=["none", "int8"],
        plots=False,
        tolerance={"default": 1e-4},
        min_routing_agreement=0.0,
    )
    out = tmp_path / "run"
    assert cli_main([str(_write(tmp_path, data)), "--no-progress", "--out", str(out)]) == 0
    by = {(r["impl"], r["quantize"]): r for r in json.loads((out / "results.json").read_text())["layers"][0]["results"]}
    assert "ggml" in registry.get_impl(by[(ggml, "int8")]["resolved_impl"]).activations
    assert _q(by[(ggml, "int8")]["rel_error"]) < 1e-4
    # against the float-activation forward of the float weights: the Q8_0 activation error
    # on top of the weights' own, more than the float mode's weight error alone
    assert _q(by[(ggml, "int8")]["quantization_error"]) > 1.2 * _q(by[("xla", "int8")]["quantization_error"])
    # float weights: the mode converts nothing (f32 weights take f32 activations)
    assert _q(by[(ggml, "none")]["quantization_error"]) < 1e-5

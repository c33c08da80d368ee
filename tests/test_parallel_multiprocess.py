"""Expert parallelism across processes: two `jax.distributed` workers on 127.0.0.1 (gloo
CPU collectives, 4 host devices each) run `moe_apply_ep` on one 8-device mesh and match
the single-device layer (`jaxmoe eval expert-parallel --set processes=2`, the runner in
jaxmoe/evaluation/expert_parallel.py). Time is bounded by ``timeout_s``: the workers are
killed past it.
"""

import json

import pytest

from jaxmoe.evaluation.cli import cli_main as eval_cli_main
from jaxmoe.evaluation.expert_parallel import config_from_mapping, free_port, run_expert_parallel, worker_env


def _mapping(seed, **kw):
    return {
        "kind": "expert-parallel",
        "name": "ep-2proc",
        "model": {
            "preset": "qwen3.6-35b-a3b",
            "shrink": {"d_model": 64, "expert_dim": 32, "shared_expert_dim": 32, "num_experts": 16},
            "seed": seed,
        },
        "inputs": {"kind": "random", "seed": seed},
        "impls": ["xla"],
        "tokens": [13],  # padded to the 8 devices
        "mesh": [{"expert": 8}, {"expert": 4, "data": 2}, {"expert": 2}],
        "capacity_factors": [None],
        "repeats": 1,
        "tolerance": 1e-5,
        "timeout_s": 420,
        **kw,
    }


@pytest.mark.slow
def test_two_processes_match_single_device(tmp_path, rng):
    seed = int(rng.integers(1000))
    path = tmp_path / "ep.json"  # JSON is YAML
    path.write_text(json.dumps(_mapping(seed)))
    out = tmp_path / "out"
    assert eval_cli_main([str(path), "--set", "processes=2", "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["processes"] == 2 and res["devices"] == 8 and res["gate"]["passed"]
    assert res["config"]["processes"] == 2
    c8, c42, c2 = res["cases"]
    for c in (c8, c42):
        assert c["status"] == "pass" and c["dropped_pairs"] == 0 and c["max_rel_err"] <= 1e-5, c
        assert c["pairs"] == 13 * 8
    assert (c8["expert"], c8["data"], c42["expert"], c42["data"]) == (8, 1, 4, 2)
    assert c2["status"] == "skipped" and "must span all 8 devices" in c2["reason"]
    assert "8 devices in 2 process(es)" in (out / "report.md").read_text()


def test_workers_past_timeout_are_killed(rng):
    cfg = config_from_mapping(_mapping(int(rng.integers(1000)), processes=2, timeout_s=0.5))
    with pytest.raises(RuntimeError, match=r"workers \[0, 1\] outlived timeout_s=0.5"):
        run_expert_parallel(cfg)


def test_config_checks_and_helpers():
    for key, bad in (("processes", 0), ("devices_per_process", 0), ("timeout_s", 0)):
        with pytest.raises(Exception, match=key):
            config_from_mapping(_mapping(0, **{key: bad}))
    port = free_port()
    assert 1024 <= port < 65536
    env = worker_env(4)
    assert env["JAX_PLATFORMS"] == "cpu"
    assert env["XLA_FLAGS"].count("xla_force_host_platform_device_count") == 1
    assert "--xla_force_host_platform_device_count=4" in env["XLA_FLAGS"]

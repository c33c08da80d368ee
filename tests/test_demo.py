"""``jaxmoe demo`` on a tiny model YAML: the table it prints and its exit codes."""

import jax.numpy as jnp

from jaxmoe import demo
from jaxmoe.impls.cpu import cpu_kernel_available

TINY = """name: tiny-demo
d_model: 32
expert_dim: 16
shared_expert_dim: 16
num_shared_experts: 1
shared_expert_gate: true
router: {num_experts: 8, top_k: 2}
"""


def test_demo_prints_the_layer_and_exits_0(tmp_path, capsys):
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY)
    assert demo.cli_main(["--preset", str(path), "--tokens", "1", "6", "--repeats", "1", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "tiny-demo d=32 E=8 k=2 F=16 shared=16" in out
    rows = [line for line in out.splitlines() if line.strip().startswith("│ 1 ") or line.strip().startswith("│ 6 ")]
    assert len(rows) == 2, out
    # auto resolves to the C++ kernel on the CPU where it built, else gather (<= 8 pairs) / xla
    want = ("cpu", "cpu") if cpu_kernel_available() else ("gather", "xla")
    assert [r.split("│")[2].strip() for r in rows] == list(want), out
    hit = [int(r.split("│")[5].strip().split("/")[0]) for r in rows]
    assert 1 <= hit[0] <= 2 and hit[0] <= hit[1] <= 8 and all(r.split("│")[5].strip().endswith("/8") for r in rows)


def test_demo_exits_1_on_a_non_finite_output(tmp_path, monkeypatch, capsys):
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY)
    real = demo.jax.random.normal

    def normal(key, shape, *a, **k):  # the tokens [3, d] get a NaN; the weights' init is untouched
        x = real(key, shape, *a, **k)
        return x.at[0, 0].set(jnp.nan) if tuple(shape) == (3, 32) else x

    monkeypatch.setattr(demo.jax.random, "normal", normal)
    assert demo.cli_main(["--preset", str(path), "--tokens", "3", "--repeats", "1"]) == 1
    assert "non-finite output" in capsys.readouterr().out

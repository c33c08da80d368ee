"""``jaxmoe inspect`` on GGUF files and HF / MLX directories written in the test.

Expected bytes are computed here from the block sizes (Q8_0: 34 bytes per 32 values) and
dtype widths, not taken from the inspected files.
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import safetensors.numpy
from gguf import GGMLQuantizationType as QT

from jaxmoe import cli
from jaxmoe.io.inspect import inspect_path

E, D, F = 8, 64, 32


def _gguf(tmp_path, rng):
    """deepseek2: layer 0 dense (F32 ffn), layer 1 MoE with Q8_0 experts and an F16 shared expert."""
    p = tmp_path / "ds.gguf"
    w = gguf.GGUFWriter(str(p), "deepseek2")
    for k, v in (
        ("block_count", 2),
        ("embedding_length", D),
        ("expert_count", E),
        ("expert_used_count", 2),
        ("expert_feed_forward_length", F),
        ("expert_shared_count", 1),
        ("leading_dense_block_count", 1),
        ("feed_forward_length", 96),
    ):
        w.add_uint32(f"deepseek2.{k}", v)
    w.add_float32("deepseek2.expert_weights_scale", 1.0)
    r = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    for n, s in (("ffn_gate", (96, D)), ("ffn_up", (96, D)), ("ffn_down", (D, 96))):
        w.add_tensor(f"blk.0.{n}.weight", r(*s))
    w.add_tensor("blk.1.ffn_gate_inp.weight", r(E, D))
    for n, s in (("gate", (E, F, D)), ("up", (E, F, D)), ("down", (E, D, F))):
        w.add_tensor(f"blk.1.ffn_{n}_exps.weight", gguf.quants.quantize(r(*s), QT.Q8_0), raw_dtype=QT.Q8_0)
    for n, s in (("gate", (F, D)), ("up", (F, D)), ("down", (D, F))):
        w.add_tensor(f"blk.1.ffn_{n}_shexp.weight", r(*s).astype(np.float16))
    w.add_tensor("blk.1.attn_norm.weight", r(D))  # not an MoE tensor: left out
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return p


def _json(capsys, *argv):
    assert cli.main(["inspect", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_inspect_gguf(tmp_path, rng, capsys):
    p = _gguf(tmp_path, rng)
    rep = _json(capsys, str(p))
    assert rep["format"] == "gguf" and rep["arch"] == "deepseek2"
    assert rep["layers"] == {"0": "dense", "1": "moe"}
    assert rep["fields"]["router.num_experts"] == E and rep["fields"]["expert_dim"] == F
    assert rep["fields"]["shared_expert_dim"] == F and rep["fields"]["dense_layers"] == [0]
    rows = {(t["layer"], t["name"]): t for t in rep["tensors"]}
    gate = rows[(1, "ffn_gate_exps.weight")]
    assert (gate["dtype"], gate["shape"], gate["nbytes"]) == ("Q8_0", [E, F, D], E * F * (D // 32) * 34)
    down = rows[(1, "ffn_down_exps.weight")]
    assert (down["shape"], down["nbytes"]) == ([E, D, F], E * D * (F // 32) * 34)
    sh = rows[(1, "ffn_up_shexp.weight")]
    assert (sh["dtype"], sh["shape"], sh["nbytes"]) == ("F16", [F, D], F * D * 2)
    assert rows[(1, "ffn_gate_inp.weight")]["nbytes"] == E * D * 4
    # the bytes from_pretrained holds: Q8_0's as the file's, F16 as float32
    assert gate["held"] == gate["nbytes"] and sh["held"] == F * D * 4
    assert rows[(0, "ffn_up.weight")]["shape"] == [96, D]
    assert (1, "attn_norm.weight") not in rows
    # The human table names the same things.
    assert cli.main(["inspect", str(p)]) == 0
    out = capsys.readouterr().out
    for s in ("deepseek2", "ffn_gate_exps.weight", "Q8_0", f"{E}x{F}x{D}", str(E * F * (D // 32) * 34), "dense"):
        assert s in out, s
    assert cli.main(["inspect", str(p), "--layer", "0"]) == 0
    assert "ffn_gate_exps" not in capsys.readouterr().out


def _hf_dir(tmp_path, rng, sharded: bool):
    d = tmp_path / ("hf_sharded" if sharded else "hf")
    d.mkdir()
    cfg = {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": D,
        "num_hidden_layers": 2,
        "num_experts": E,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": F,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "intermediate_size": 96,
    }
    (d / "config.json").write_text(json.dumps(cfg))
    shards = [{}, {}]
    for layer in range(2):
        pre = f"model.layers.{layer}."
        s = shards[layer if sharded else 0]
        s[pre + "mlp.gate.weight"] = rng.standard_normal((E, D)).astype(np.float32)
        s[pre + "self_attn.q_proj.weight"] = rng.standard_normal((D, D)).astype(np.float16)
        for j in range(E):
            for n, shape in (("gate_proj", (F, D)), ("up_proj", (F, D)), ("down_proj", (D, F))):
                s[f"{pre}mlp.experts.{j}.{n}.weight"] = rng.standard_normal(shape).astype(np.float16)
    if sharded:
        names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
        for s, n in zip(shards, names):
            safetensors.numpy.save_file(s, str(d / n))
        wm = {k: n for s, n in zip(shards, names) for k in s}
        (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    else:
        safetensors.numpy.save_file(shards[0], str(d / "model.safetensors"))
    return d


@pytest.mark.parametrize("sharded", [False, True])
def test_inspect_hf_dir(tmp_path, rng, capsys, sharded):
    d = _hf_dir(tmp_path, rng, sharded)
    rep = _json(capsys, str(d))
    assert rep["format"] == "hf" and rep["arch"] == "qwen3_moe"
    assert rep["fields"]["num_experts"] == E and rep["fields"]["moe_intermediate_size"] == F
    assert rep["layers"] == {"0": "moe", "1": "moe"}
    rows = {(t["layer"], t["name"]): t for t in rep["tensors"]}
    assert len(rows) == 2 * 4 and all("self_attn" not in n for _, n in rows)
    g = rows[(1, "mlp.experts.*.gate_proj.weight")]
    assert (g["count"], g["dtype"], g["shape"], g["nbytes"]) == (E, "F16", [F, D], E * F * D * 2)
    dn = rows[(0, "mlp.experts.*.down_proj.weight")]
    assert (dn["count"], dn["shape"]) == (E, [D, F])
    assert rows[(0, "mlp.gate.weight")]["nbytes"] == E * D * 4
    assert cli.main(["inspect", str(d)]) == 0
    out = capsys.readouterr().out
    for s in ("qwen3_moe", "mlp.experts.*.gate_proj.weight", "F16", f"{F}x{D}", str(E * F * D * 2)):
        assert s in out, s


def test_inspect_fused_bf16_and_mlx_dirs(tmp_path, rng, capsys):
    # Fused HF layout in bfloat16 (written with torch: numpy has no bfloat16).
    import safetensors.torch
    import torch

    d = tmp_path / "fused"
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps(
            {
                "text_config": {"model_type": "qwen3_5_moe_text", "num_experts": E, "num_hidden_layers": 1},
                "model_type": "qwen3_5_moe",
            }
        )
    )
    gu = torch.from_numpy(rng.standard_normal((E, 2 * F, D)).astype(np.float32)).to(torch.bfloat16)
    safetensors.torch.save_file(
        {"model.language_model.layers.0.mlp.experts.gate_up_proj": gu}, str(d / "model.safetensors")
    )
    rep = _json(capsys, str(d))
    assert rep["arch"] == "qwen3_5_moe_text" and rep["fields"]["num_experts"] == E
    (row,) = rep["tensors"]
    assert (row["name"], row["dtype"], row["shape"], row["nbytes"]) == (
        "mlp.experts.gate_up_proj",
        "BF16",
        [E, 2 * F, D],
        E * 2 * F * D * 2,
    )
    # mlx-lm switch_mlp layout: 4-bit codes in uint32 words, group-64 scales / biases.
    m = tmp_path / "mlx"
    m.mkdir()
    (m / "config.json").write_text(
        json.dumps(
            {
                "model_type": "qwen3_moe",
                "num_experts": E,
                "num_hidden_layers": 1,
                "quantization": {"group_size": 64, "bits": 4},
            }
        )
    )
    pre = "model.layers.0.mlp.switch_mlp.gate_proj."
    safetensors.numpy.save_file(
        {
            pre + "weight": rng.integers(0, 2**32, (E, F, D // 8), dtype=np.uint32),
            pre + "scales": rng.standard_normal((E, F, D // 64)).astype(np.float16),
            pre + "biases": rng.standard_normal((E, F, D // 64)).astype(np.float16),
        },
        str(m / "model.safetensors"),
    )
    rep = _json(capsys, str(m))
    assert rep["format"] == "mlx" and rep["fields"]["quantization"] == {"group_size": 64, "bits": 4}
    rows = {t["name"]: t for t in rep["tensors"]}
    assert (rows["mlp.switch_mlp.gate_proj.weight"]["dtype"], rows["mlp.switch_mlp.gate_proj.weight"]["nbytes"]) == (
        "U32",
        E * F * D // 8 * 4,
    )
    assert rows["mlp.switch_mlp.gate_proj.scales"]["nbytes"] == E * F * (D // 64) * 2


def test_inspect_bad_input(tmp_path, capsys):
    assert cli.main(["inspect", str(tmp_path / "nope.gguf")]) == 2
    assert "not found" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert cli.main(["inspect", str(tmp_path / "empty")]) == 2
    assert "config.json" in capsys.readouterr().err
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    assert cli.main(["inspect", str(bad)]) == 2
    assert "magic" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError):
        inspect_path(tmp_path / "missing")

"""HF safetensors checkpoints: tiny random transformers models saved with ``save_pretrained``,
loaded with `jaxmoe.from_pretrained` (`jaxmoe.io.hf.load_layer` underneath), compared with
the HF layer's own MoE module.

These are also the whole-module parity tests of the routing rule of each family: the
reference is transformers' module output (float32) and its router's selected experts.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers as T
from helpers import assert_same_params
from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

import jaxmoe
from jaxmoe import io as jio
from jaxmoe.io import hf as hf_io
from jaxmoe.io.hf_config import moe_config_from_hf
from jaxmoe.io.safetensors_dir import SafetensorsDir

D, E, F, FS, K, T_TOK = 64, 16, 32, 48, 4, 12
_ATT = dict(vocab_size=32, hidden_size=D, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)


def _qwen3():
    return T.Qwen3MoeForCausalLM(
        T.Qwen3MoeConfig(
            **_ATT,
            head_dim=16,
            intermediate_size=64,
            moe_intermediate_size=F,
            num_experts=E,
            num_experts_per_tok=K,
            norm_topk_prob=True,
        )
    )


def _qwen3_nonorm():
    return T.Qwen3MoeForCausalLM(
        T.Qwen3MoeConfig(
            **_ATT,
            head_dim=16,
            intermediate_size=64,
            moe_intermediate_size=F,
            num_experts=E,
            num_experts_per_tok=K,
            norm_topk_prob=False,
        )
    )


def _qwen2():
    return T.Qwen2MoeForCausalLM(
        T.Qwen2MoeConfig(
            **_ATT,
            intermediate_size=64,
            moe_intermediate_size=F,
            shared_expert_intermediate_size=FS,
            num_experts=E,
            num_experts_per_tok=K,
        )
    )


def _qwen35():
    return Qwen3_5MoeForCausalLM(
        Qwen3_5MoeTextConfig(
            **_ATT,
            head_dim=16,
            moe_intermediate_size=F,
            shared_expert_intermediate_size=FS,
            num_experts=E,
            num_experts_per_tok=K,
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
        )
    )


def _mixtral():
    return T.MixtralForCausalLM(
        T.MixtralConfig(**_ATT, head_dim=16, intermediate_size=F, num_local_experts=8, num_experts_per_tok=2)
    )


def _gptoss():
    return T.GptOssForCausalLM(
        T.GptOssConfig(
            **_ATT,
            head_dim=16,
            intermediate_size=F,
            num_local_experts=8,
            num_experts_per_tok=K,
            layer_types=["sliding_attention", "full_attention"],
        )
    )


def _olmoe():
    return T.OlmoeForCausalLM(
        T.OlmoeConfig(**_ATT, intermediate_size=F, num_experts=E, num_experts_per_tok=K, pad_token_id=0, eos_token_id=1)
    )


_MLA = dict(q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)


def _dsv3():
    return T.DeepseekV3ForCausalLM(
        T.DeepseekV3Config(
            **{**_ATT, "num_key_value_heads": 2},
            **_MLA,
            intermediate_size=96,
            moe_intermediate_size=F,
            n_routed_experts=E,
            num_experts_per_tok=K,
            n_group=4,
            topk_group=2,
            n_shared_experts=2,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
        )
    )


def _dsv2():
    return T.DeepseekV2ForCausalLM(
        T.DeepseekV2Config(
            **{**_ATT, "num_key_value_heads": 2},
            **_MLA,
            intermediate_size=96,
            moe_intermediate_size=F,
            n_routed_experts=E,
            num_experts_per_tok=K,
            n_shared_experts=2,
            first_k_dense_replace=1,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=1.5,
        )
    )


def _glm4():
    return T.Glm4MoeForCausalLM(
        T.Glm4MoeConfig(
            **_ATT,
            head_dim=16,
            intermediate_size=96,
            moe_intermediate_size=F,
            n_routed_experts=E,
            num_experts_per_tok=K,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            routed_scaling_factor=1.8,
            norm_topk_prob=False,
        )
    )


def _qwen3_next():
    return T.Qwen3NextForCausalLM(
        T.Qwen3NextConfig(
            **_ATT,
            head_dim=16,
            intermediate_size=64,
            moe_intermediate_size=F,
            shared_expert_intermediate_size=FS,
            num_experts=E,
            num_experts_per_tok=K,
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
        )
    )


def _bailing_hybrid():
    return T.BailingHybridForCausalLM(
        T.BailingHybridConfig(
            **{**_ATT, "num_key_value_heads": 2},
            **_MLA,
            head_dim=16,
            intermediate_size=96,
            moe_intermediate_size=F,
            num_local_experts=E,
            num_experts_per_tok=K,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            layer_group_size=2,
            pad_token_id=0,
            eos_token_id=1,
        )
    )


BUILDERS = {
    "qwen3_moe": _qwen3,
    "qwen3_moe_nonorm": _qwen3_nonorm,
    "qwen2_moe": _qwen2,
    "qwen3_5_moe": _qwen35,
    "mixtral": _mixtral,
    "gpt_oss": _gptoss,
    "olmoe": _olmoe,
    "deepseek_v3": _dsv3,
    "deepseek_v2": _dsv2,
    "glm4_moe": _glm4,
    "qwen3_next": _qwen3_next,
    "bailing_hybrid": _bailing_hybrid,
}


def _randomize(mlp: torch.nn.Module, rng: np.random.Generator) -> None:
    """Fresh random values for every parameter and buffer of the MoE module (HF init leaves
    biases and the selection bias at zero, which would hide a missing tensor)."""
    with torch.no_grad():
        for name, t in list(mlp.named_parameters()) + list(mlp.named_buffers()):
            std = 1.0 if ("gate.weight" in name or "router" in name) else 0.3 if "bias" in name else 0.15
            if "e_score_correction_bias" in name:
                std = 0.05
            t.copy_(torch.from_numpy(rng.standard_normal(tuple(t.shape)) * std).to(t.dtype))


def _hf_moe(model):
    return model.model.layers[1].mlp


def _hf_reference(mlp, x: np.ndarray):
    """HF module output ``[T, d]`` and its router's selected ids / weights ``[T, k]``."""
    xt = torch.from_numpy(x)[None]
    with torch.no_grad():
        y = mlp(xt)
        if isinstance(y, tuple):  # gpt-oss returns (hidden, router_scores)
            y = y[0]
        router = mlp.router if hasattr(mlp, "router") else mlp.gate
        _, w, ids = router(xt.reshape(-1, x.shape[-1]))
    return y.reshape(x.shape).numpy(), ids.numpy(), w.float().numpy()


def _save(model, path: Path, rng, **kw) -> None:
    _randomize(_hf_moe(model), rng)
    model.save_pretrained(path, **kw)


def _check_block(block, mlp, rng):
    x = rng.standard_normal((T_TOK, D)).astype(np.float32)
    y_ref, ids_ref, w_ref = _hf_reference(mlp, x)
    y, r = block(jnp.asarray(x), return_routing=True)
    y = np.asarray(y, np.float64)
    rel = np.linalg.norm(y - y_ref) / np.linalg.norm(y_ref)
    assert rel < 1e-5, rel
    ids = np.asarray(r.expert_ids)
    np.testing.assert_array_equal(np.sort(ids, 1), np.sort(ids_ref, 1))
    w = np.take_along_axis(np.asarray(r.weights), np.argsort(ids, 1), 1)
    w_hf = np.take_along_axis(w_ref, np.argsort(ids_ref, 1), 1)
    np.testing.assert_allclose(w, w_hf, rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("family", sorted(BUILDERS))
@pytest.mark.slow
def test_hf_layer_matches_transformers(family, tmp_path, rng):
    torch.manual_seed(int(rng.integers(2**31)))
    model = BUILDERS[family]().eval()
    _save(model, tmp_path, rng)
    block = jaxmoe.from_pretrained(tmp_path, layer=1, impl="dense")  # the oracle: isolates the loader
    assert isinstance(block, jaxmoe.MoEBlock)
    assert jaxmoe.load_config(tmp_path) == block.cfg
    _check_block(block, _hf_moe(model), rng)


def test_sharded_bf16_checkpoint_reads_only_its_layer(tmp_path, rng, monkeypatch):
    torch.manual_seed(int(rng.integers(2**31)))
    model = _qwen2().eval()
    _randomize(_hf_moe(model), rng)
    model.to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    model = model.float()  # the reference: the same bf16-rounded weights in float32
    reads = []
    orig = SafetensorsDir.get

    def spy(self, name, shape=None):
        reads.append(name)
        return orig(self, name, shape)

    monkeypatch.setattr(SafetensorsDir, "get", spy)
    block = jaxmoe.from_pretrained(tmp_path, layer=1)
    assert reads and all(n.startswith("model.layers.1.mlp.") for n in reads), reads
    assert len(reads) == 3 * E + 1 + 3 + 1  # experts, router, shared expert, shared gate
    _check_block(block, _hf_moe(model), rng)


def test_bf16_compute_dtype(tmp_path, rng):
    torch.manual_seed(int(rng.integers(2**31)))
    model = _mixtral().eval()
    _save(model, tmp_path, rng)
    block = jaxmoe.from_pretrained(tmp_path, layer=1, dtype=jnp.bfloat16, impl="dense")
    assert block.params().experts.w_gate.dtype == jnp.bfloat16
    assert block.params().w_router.dtype == jnp.float32  # routing stays float32
    x = rng.standard_normal((T_TOK, D)).astype(np.float32)
    y_ref, _, _ = _hf_reference(_hf_moe(model), x)
    y = np.asarray(block(jnp.asarray(x)).astype(jnp.float32))
    assert np.linalg.norm(y - y_ref) / np.linalg.norm(y_ref) < 3e-2


def test_load_layer_returns_config_and_params(tmp_path, rng):
    """`jaxmoe.io.hf.load_layer` and the path dispatch give the (cfg, params) from_pretrained wraps,
    with dtype= reaching the loader."""
    torch.manual_seed(int(rng.integers(2**31)))
    _save(_qwen2().eval(), tmp_path, rng)
    assert jio.checkpoint_format(tmp_path) == "hf"
    cfg, params = hf_io.load_layer(tmp_path, layer=1, dtype=jnp.bfloat16)
    assert cfg == hf_io.load_config(tmp_path) == jio.load_config(tmp_path)
    assert params.experts.w_gate.dtype == jnp.bfloat16 and params.w_router.dtype == jnp.float32
    cfg2, params2 = jio.load_layer(tmp_path, layer=1, dtype=jnp.bfloat16)
    block = jaxmoe.from_pretrained(tmp_path, layer=1, dtype=jnp.bfloat16)
    assert cfg2 == cfg and block.cfg == cfg and block.dtype == jnp.bfloat16
    assert_same_params(params, params2, block.params())
    with pytest.raises(ValueError, match=r"layer 2 is outside \[0, 2\)"):
        hf_io.load_layer(tmp_path, layer=2)


def _fused_copy(src: Path, dst: Path, family_key: str = "mlp") -> None:
    """Rewrites a per-expert checkpoint in the fused layout transformers 5 keeps in memory
    (experts.gate_up_proj (E, 2F, d), experts.down_proj (E, d, F))."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    with SafetensorsDir(src) as st:
        tensors = {k: st.get(k) for k in st.keys()}
    out = {}
    for k, v in tensors.items():
        if ".experts." in k and ".experts.0." not in k:
            continue
        if ".experts.0.gate_proj.weight" in k:
            base = k.split(".experts.0.")[0]
            g = np.stack([tensors[f"{base}.experts.{j}.gate_proj.weight"] for j in range(E)])
            u = np.stack([tensors[f"{base}.experts.{j}.up_proj.weight"] for j in range(E)])
            dn = np.stack([tensors[f"{base}.experts.{j}.down_proj.weight"] for j in range(E)])
            out[f"{base}.experts.gate_up_proj"] = np.concatenate([g, u], axis=1)
            out[f"{base}.experts.down_proj"] = dn
        elif ".experts.0." not in k:
            out[k] = v
    safetensors.numpy.save_file(out, str(dst / "model.safetensors"))


def test_fused_gate_up_layout_and_vl_prefix(tmp_path, rng):
    """Fused experts (the Qwen3.5 Hub layout) under the multimodal ``model.language_model.`` prefix
    with the config nested in ``text_config``."""
    torch.manual_seed(int(rng.integers(2**31)))
    model = _qwen35().eval()
    _save(model, tmp_path / "a", rng)
    _fused_copy(tmp_path / "a", tmp_path / "b")
    # move to the multimodal wrapper layout
    with SafetensorsDir(tmp_path / "b") as st:
        tensors = {k.replace("model.", "model.language_model.", 1): st.get(k) for k in st.keys()}
    c = tmp_path / "c"
    c.mkdir()
    safetensors.numpy.save_file(tensors, str(c / "model.safetensors"))
    text = json.loads((tmp_path / "a" / "config.json").read_text())
    (c / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe", "text_config": text}))
    with SafetensorsDir(c) as st:
        assert "model.language_model.layers.1.mlp.experts.gate_up_proj" in st
    block = jaxmoe.from_pretrained(c, layer=1, impl="dense")
    _check_block(block, _hf_moe(model), rng)


def test_gpt_oss_mxfp4_checkpoint(tmp_path, rng):
    """The gpt-oss Hub layout: MXFP4 ``*_blocks`` / ``*_scales`` experts, dequantized at load exactly as
    transformers' ``convert_moe_packed_tensors`` does."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    torch.manual_seed(int(rng.integers(2**31)))
    model = _gptoss().eval()
    mlp = _hf_moe(model)
    _randomize(mlp, rng)
    e = mlp.experts.num_experts
    packed = {}
    for name, (out, n_in) in (("gate_up_proj", (2 * F, D)), ("down_proj", (D, F))):
        blocks = rng.integers(0, 256, (e, out, n_in // 32, 16), dtype=np.uint8)
        scales = rng.integers(122, 129, (e, out, n_in // 32), dtype=np.uint8)
        packed[name] = (blocks, scales)
        w = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
        with torch.no_grad():
            getattr(mlp.experts, name).copy_(w)  # (E, in, out): the layout the HF module computes with
    model.save_pretrained(tmp_path / "float")
    with SafetensorsDir(tmp_path / "float") as st:
        tensors = {k: st.get(k) for k in st.keys()}
    for i in range(2):
        for name in ("gate_up_proj", "down_proj"):
            del tensors[f"model.layers.{i}.mlp.experts.{name}"]
            (
                tensors[f"model.layers.{i}.mlp.experts.{name}_blocks"],
                tensors[f"model.layers.{i}.mlp.experts.{name}_scales"],
            ) = packed[name]
    q = tmp_path / "mxfp4"
    q.mkdir()
    safetensors.numpy.save_file(tensors, str(q / "model.safetensors"))
    config = json.loads((tmp_path / "float" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router"]}
    (q / "config.json").write_text(json.dumps(config))
    block = jaxmoe.from_pretrained(q, layer=1, impl="dense")
    _check_block(block, mlp, rng)
    _rewrite(q, drop="model.layers.1.mlp.experts.down_proj_scales")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.down_proj_scales"):
        jaxmoe.from_pretrained(q, layer=1)


def test_deepseek_v3_fp8_block_scaled_checkpoint(tmp_path, rng):
    """The DeepSeek-V3 Hub layout: F8_E4M3 ``*.weight`` with ``*.weight_scale_inv`` per (16, 24) block
    (a block that does not divide the widths), dequantized at load; the reference is torch's float8
    conversion times the repeated scales, run through the HF module."""
    torch.manual_seed(int(rng.integers(2**31)))
    model = _dsv3().eval()
    mlp = _hf_moe(model)
    _randomize(mlp, rng)
    bo, bi = 16, 24
    fp8 = {}

    def make(out, n_in):
        w8 = torch.from_numpy(rng.standard_normal((out, n_in)).astype(np.float32) * 3).to(torch.float8_e4m3fn)
        si = torch.from_numpy(rng.uniform(0.01, 0.1, (-(-out // bo), -(-n_in // bi))).astype(np.float32))
        w = w8.float() * si.repeat_interleave(bo, 0)[:out].repeat_interleave(bi, 1)[:, :n_in]
        return w8, si, w

    with torch.no_grad():
        for j in range(E):
            parts = {}
            for n, shp in (("gate_proj", (F, D)), ("up_proj", (F, D)), ("down_proj", (D, F))):
                w8, si, parts[n] = make(*shp)
                fp8[f"model.layers.1.mlp.experts.{j}.{n}"] = (w8, si)
            mlp.experts.gate_up_proj[j] = torch.cat([parts["gate_proj"], parts["up_proj"]])
            mlp.experts.down_proj[j] = parts["down_proj"]
        for n, shp in (("gate_proj", (2 * F, D)), ("up_proj", (2 * F, D)), ("down_proj", (D, 2 * F))):
            w8, si, w = make(*shp)
            fp8[f"model.layers.1.mlp.shared_experts.{n}"] = (w8, si)
            getattr(mlp.shared_experts, n).weight.copy_(w)
    model.save_pretrained(tmp_path / "float")
    from safetensors.torch import load_file, save_file

    tensors = {}
    for f in (tmp_path / "float").glob("*.safetensors"):
        tensors.update(load_file(str(f)))
    for name, (w8, si) in fp8.items():
        tensors[f"{name}.weight"], tensors[f"{name}.weight_scale_inv"] = w8, si
    q = tmp_path / "fp8"
    q.mkdir()
    save_file(tensors, str(q / "model.safetensors"))
    config = json.loads((tmp_path / "float" / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [bo, bi],
    }
    (q / "config.json").write_text(json.dumps(config))
    with SafetensorsDir(q) as st:
        assert st.dtype("model.layers.1.mlp.experts.3.up_proj.weight") == "F8_E4M3"
    block = jaxmoe.from_pretrained(q, layer=1, impl="dense")
    _check_block(block, mlp, rng)
    _rewrite(q, drop="model.layers.1.mlp.experts.5.down_proj.weight_scale_inv")
    with pytest.raises(ValueError, match=r"FP8 but 'model\.layers\.1\.mlp\.experts\.5\.down_proj\.weight_scale_inv'"):
        jaxmoe.from_pretrained(q, layer=1)


# ----------------------------------------------------------------------------- bad input


@pytest.fixture
def qwen2_dir(tmp_path, rng):
    torch.manual_seed(int(rng.integers(2**31)))
    model = _qwen2().eval()
    _save(model, tmp_path / "ck", rng)
    return tmp_path / "ck"


def _rewrite(path: Path, drop: str | None = None, replace: dict | None = None) -> None:
    with SafetensorsDir(path) as st:
        tensors = {k: st.get(k) for k in st.keys() if k != drop}
    tensors.update(replace or {})
    for f in path.glob("*.safetensors"):
        f.unlink()
    safetensors.numpy.save_file(tensors, str(path / "model.safetensors"))


def _edit_config(path: Path, **kw) -> None:
    c = json.loads((path / "config.json").read_text())
    c.update(kw)
    (path / "config.json").write_text(json.dumps(c))


def test_missing_expert_tensor_names_the_key(qwen2_dir):
    _rewrite(qwen2_dir, drop="model.layers.1.mlp.experts.7.up_proj.weight")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.7\.up_proj\.weight"):
        jaxmoe.from_pretrained(qwen2_dir, layer=1)
    jaxmoe.from_pretrained(qwen2_dir, layer=0)  # the other layer is intact


def test_missing_shared_gate_names_the_key(qwen2_dir):
    _rewrite(qwen2_dir, drop="model.layers.0.mlp.shared_expert_gate.weight")
    with pytest.raises(ValueError, match=r"shared_expert_gate\.weight"):
        jaxmoe.from_pretrained(qwen2_dir, layer=0)


def test_shape_mismatch_names_tensor_and_both_shapes(qwen2_dir):
    _edit_config(qwen2_dir, moe_intermediate_size=F * 2)
    with pytest.raises(ValueError, match=rf"experts\.0\.gate_proj\.weight.*\({F}, {D}\).*\({2 * F}, {D}\)"):
        jaxmoe.from_pretrained(qwen2_dir, layer=1)


def test_more_experts_stored_than_configured_is_an_error(qwen2_dir):
    """Never silently use the first experts of a bigger layer."""
    _edit_config(qwen2_dir, num_experts=E // 2)
    with pytest.raises(ValueError, match=rf"mlp\.gate\.weight.*\({E}, {D}\).*\({E // 2}, {D}\)"):
        jaxmoe.from_pretrained(qwen2_dir, layer=1)
    with SafetensorsDir(qwen2_dir) as st:
        router = st.get("model.layers.1.mlp.gate.weight")
    _rewrite(qwen2_dir, replace={"model.layers.1.mlp.gate.weight": np.ascontiguousarray(router[: E // 2])})
    with pytest.raises(ValueError, match=rf"more experts than num_experts={E // 2}"):
        jaxmoe.from_pretrained(qwen2_dir, layer=1)


def test_fewer_experts_stored_than_configured_is_an_error(qwen2_dir, rng):
    _edit_config(qwen2_dir, num_experts=E * 2)
    with SafetensorsDir(qwen2_dir) as st:
        router = st.get("model.layers.1.mlp.gate.weight")
    bigger = np.concatenate([router, rng.standard_normal(router.shape).astype(router.dtype)])
    _rewrite(qwen2_dir, replace={"model.layers.1.mlp.gate.weight": bigger})
    with pytest.raises(ValueError, match=rf"experts\.{E}\.gate_proj\.weight"):
        jaxmoe.from_pretrained(qwen2_dir, layer=1)


def test_dense_and_out_of_range_layers(tmp_path, rng):
    torch.manual_seed(int(rng.integers(2**31)))
    model = _dsv3().eval()
    _save(model, tmp_path, rng)
    with pytest.raises(ValueError, match="layer 0 is a dense layer"):
        jaxmoe.from_pretrained(tmp_path, layer=0)
    with pytest.raises(ValueError, match=r"layer 2 is outside \[0, 2\)"):
        jaxmoe.from_pretrained(tmp_path, layer=2)
    # a dense MLP stored where the config promises experts
    _edit_config(tmp_path, first_k_dense_replace=0)
    with pytest.raises(ValueError, match="dense MLP"):
        jaxmoe.from_pretrained(tmp_path, layer=0)


def test_unknown_model_type_and_missing_keys():
    with pytest.raises(ValueError, match="unsupported model_type 'llama'"):
        moe_config_from_hf({"model_type": "llama", "hidden_size": 8})
    with pytest.raises(ValueError, match="needs key 'num_experts_per_tok'"):
        moe_config_from_hf(
            {
                "model_type": "mixtral",
                "hidden_size": 8,
                "num_hidden_layers": 2,
                "num_local_experts": 4,
                "intermediate_size": 8,
            }
        )
    with pytest.raises(ValueError, match="topk_method 'noaux_tc'"):
        moe_config_from_hf(
            {
                "model_type": "deepseek_v2",
                "hidden_size": 8,
                "num_hidden_layers": 2,
                "num_experts_per_tok": 2,
                "n_routed_experts": 4,
                "moe_intermediate_size": 8,
                "topk_method": "noaux_tc",
            }
        )


@pytest.mark.parametrize(
    "family,preset",
    [
        ("qwen3_moe", "qwen3-30b-a3b"),
        ("qwen2_moe", "qwen2-57b-a14b"),
        ("mixtral", "mixtral-8x7b"),
        ("deepseek_v3", "deepseek-v3"),
        ("deepseek_v2", "deepseek-v2-lite"),
        ("olmoe", "olmoe-1b-7b"),
        ("gpt_oss", "gpt-oss-20b"),
        ("qwen3_5_moe", "qwen3.6-35b-a3b"),
        ("bailing_moe_v2", "edge0-8b"),
    ],
)
def test_hub_config_json_matches_preset(family, preset):
    """The routing fields of each family's published config.json (values quoted in the preset
    comments) map to the shipped preset's router and widths."""
    hub = {
        "qwen3-30b-a3b": dict(
            model_type="qwen3_moe",
            hidden_size=2048,
            num_hidden_layers=48,
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=768,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        ),
        "qwen2-57b-a14b": dict(
            model_type="qwen2_moe",
            hidden_size=3584,
            num_hidden_layers=28,
            num_experts=64,
            num_experts_per_tok=8,
            moe_intermediate_size=2560,
            shared_expert_intermediate_size=20480,
            norm_topk_prob=False,
        ),
        "mixtral-8x7b": dict(
            model_type="mixtral",
            hidden_size=4096,
            num_hidden_layers=32,
            intermediate_size=14336,
            num_local_experts=8,
            num_experts_per_tok=2,
        ),
        "deepseek-v3": dict(
            model_type="deepseek_v3",
            hidden_size=7168,
            num_hidden_layers=61,
            intermediate_size=18432,
            moe_intermediate_size=2048,
            n_routed_experts=256,
            num_experts_per_tok=8,
            n_shared_experts=1,
            n_group=8,
            topk_group=4,
            routed_scaling_factor=2.5,
            scoring_func="sigmoid",
            topk_method="noaux_tc",
            norm_topk_prob=True,
            first_k_dense_replace=3,
        ),
        "deepseek-v2-lite": dict(
            model_type="deepseek_v2",
            hidden_size=2048,
            num_hidden_layers=27,
            intermediate_size=10944,
            moe_intermediate_size=1408,
            n_routed_experts=64,
            num_experts_per_tok=6,
            n_shared_experts=2,
            n_group=1,
            topk_group=1,
            topk_method="greedy",
            scoring_func="softmax",
            norm_topk_prob=False,
            routed_scaling_factor=1.0,
            first_k_dense_replace=1,
        ),
        "olmoe-1b-7b": dict(
            model_type="olmoe",
            hidden_size=2048,
            num_hidden_layers=16,
            intermediate_size=1024,
            num_experts=64,
            num_experts_per_tok=8,
            norm_topk_prob=False,
        ),
        "gpt-oss-20b": dict(
            model_type="gpt_oss",
            hidden_size=2880,
            num_hidden_layers=24,
            intermediate_size=2880,
            num_local_experts=32,
            num_experts_per_tok=4,
            swiglu_limit=7.0,
        ),
        "edge0-8b": dict(
            model_type="bailing_moe_v2",
            hidden_size=2048,
            num_hidden_layers=24,
            intermediate_size=5120,
            moe_intermediate_size=512,
            num_experts=128,
            num_experts_per_tok=8,
            num_shared_experts=1,
            n_group=8,
            topk_group=4,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            first_k_dense_replace=1,
        ),
        "qwen3.6-35b-a3b": dict(
            model_type="qwen3_5_moe",
            text_config=dict(
                model_type="qwen3_5_moe_text",
                hidden_size=2048,
                num_hidden_layers=40,
                num_experts=256,
                num_experts_per_tok=8,
                moe_intermediate_size=512,
                shared_expert_intermediate_size=512,
            ),
        ),
    }[preset]
    got = moe_config_from_hf(hub)
    want = jaxmoe.load_config(preset)
    assert got.family == want.family or (preset.startswith("qwen3.6") and got.family == "qwen3_5_moe")
    assert got.router == want.router
    for f in (
        "d_model",
        "expert_dim",
        "shared_expert_dim",
        "num_shared_experts",
        "shared_expert_gate",
        "activation",
        "expert_bias",
        "num_layers",
        "dense_layers",
        "dense_dim",
    ):
        assert getattr(got, f) == getattr(want, f), f


def test_qwen_sparse_step_and_mlp_only_layers():
    c = moe_config_from_hf(
        dict(
            model_type="qwen3_moe",
            hidden_size=8,
            num_hidden_layers=6,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=8,
            decoder_sparse_step=2,
            mlp_only_layers=[3],
        )
    )
    assert c.dense_layers == (0, 2, 3, 4)
    assert (
        hf_io.moe_prefix(["model.layers.5.mlp.gate.weight", "model.layers.5.self_attn.q.weight"], 5, "x")
        == "model.layers.5.mlp"
    )


def test_fused_fp8_experts_are_refused(tmp_path, rng):
    """FP8 codes in the fused expert layout have no known scale tensors: a named error, not
    codes read as values."""
    import ml_dtypes

    torch.manual_seed(int(rng.integers(2**31)))
    model = _qwen35().eval()
    _save(model, tmp_path / "a", rng)
    _fused_copy(tmp_path / "a", tmp_path / "b")
    with SafetensorsDir(tmp_path / "b") as st:
        tensors = {k: st.get(k) for k in st.keys()}
    name = "model.layers.1.mlp.experts.gate_up_proj"
    tensors[name] = tensors[name].astype(ml_dtypes.float8_e4m3fn)
    safetensors.numpy.save_file(tensors, str(tmp_path / "b" / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"{name} holds float8_e4m3fn codes in a fused expert layout"):
        hf_io.load_layer(tmp_path / "b", layer=1)

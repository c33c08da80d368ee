"""Parity with the Hugging Face MoE modules (transformers 5.x, torch CPU, float32).

For each family the HF MoE module is built from a tiny config, every parameter is drawn
at random (selection biases included, negative ones too), copied into `MoEParams`, and
the outputs and selected expert sets compared.
"""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxmoe
from jaxmoe import MoEBlock, MoEConfig, RouterConfig
from jaxmoe.experts import ExpertWeights, SharedWeights
from jaxmoe.layer import MoEParams

torch.set_num_threads(1)
D, F, FS, E = 64, 32, 48, 16


def _np(t):
    return t.detach().to(torch.float32).numpy()


def _fused(experts, interleaved=False):
    """HF fused experts -> (w_gate, w_up, w_down) in the x @ W convention."""
    gu, dn = _np(experts.gate_up_proj), _np(experts.down_proj)
    if interleaved:  # gpt-oss: (E, d, 2F), gate = even columns, up = odd; down (E, F, d)
        return gu[..., ::2], gu[..., 1::2], dn
    f = gu.shape[1] // 2  # (E, 2F, d): rows [0:F] gate, [F:2F] up; down (E, d, F)
    return gu[:, :f].transpose(0, 2, 1), gu[:, f:].transpose(0, 2, 1), dn.transpose(0, 2, 1)


def _mlp(m):
    return SharedWeights(_np(m.gate_proj.weight).T, _np(m.up_proj.weight).T, _np(m.down_proj.weight).T)


def _randomize(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _name, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if p.ndim > 1 else 0.3))
        for name, b in module.named_buffers():
            if "bias" in name:  # DeepSeek e_score_correction_bias: negative and positive values
                b.copy_(torch.randn(b.shape, generator=g) * 0.5 - 0.2)


def qwen3_moe():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    c = Qwen3MoeConfig(
        hidden_size=D, moe_intermediate_size=F, num_experts=E, num_experts_per_tok=4, norm_topk_prob=True
    )
    m = Qwen3MoeSparseMoeBlock(c)
    cfg = MoEConfig(d_model=D, expert_dim=F, router=RouterConfig(num_experts=E, top_k=4, renorm="sum"))
    return m, cfg, lambda: MoEParams(_np(m.gate.weight).T, ExpertWeights(*_fused(m.experts)))


def qwen2_moe():
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    c = Qwen2MoeConfig(
        hidden_size=D,
        moe_intermediate_size=F,
        shared_expert_intermediate_size=FS,
        num_experts=E,
        num_experts_per_tok=4,
        norm_topk_prob=False,
    )
    m = Qwen2MoeSparseMoeBlock(c)
    cfg = MoEConfig(
        d_model=D,
        expert_dim=F,
        shared_expert_dim=FS,
        num_shared_experts=1,
        shared_expert_gate=True,
        router=RouterConfig(num_experts=E, top_k=4, renorm="none"),
    )

    def conv():
        sw = _mlp(m.shared_expert)
        sw = SharedWeights(sw.w_gate, sw.w_up, sw.w_down, _np(m.shared_expert_gate.weight)[0])
        return MoEParams(_np(m.gate.weight).T, ExpertWeights(*_fused(m.experts)), shared=sw)

    return m, cfg, conv


def qwen3_5_moe():
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    c = Qwen3_5MoeTextConfig(
        hidden_size=D, moe_intermediate_size=F, shared_expert_intermediate_size=FS, num_experts=E, num_experts_per_tok=8
    )
    m = Qwen3_5MoeSparseMoeBlock(c)
    base = jaxmoe.load_config("qwen3.6-35b-a3b")
    import dataclasses

    cfg = dataclasses.replace(
        base, d_model=D, expert_dim=F, shared_expert_dim=FS, router=dataclasses.replace(base.router, num_experts=E)
    )

    def conv():
        sw = _mlp(m.shared_expert)
        sw = SharedWeights(sw.w_gate, sw.w_up, sw.w_down, _np(m.shared_expert_gate.weight)[0])
        return MoEParams(_np(m.gate.weight).T, ExpertWeights(*_fused(m.experts)), shared=sw)

    return m, cfg, conv


def deepseek_v3():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    c = DeepseekV3Config(
        hidden_size=D,
        moe_intermediate_size=F,
        n_routed_experts=E,
        num_experts_per_tok=4,
        n_shared_experts=2,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )
    m = DeepseekV3MoE(c)
    cfg = MoEConfig(
        d_model=D,
        expert_dim=F,
        shared_expert_dim=2 * F,
        num_shared_experts=2,
        router=RouterConfig(
            num_experts=E,
            top_k=4,
            score_fn="sigmoid",
            use_selection_bias=True,
            n_group=4,
            topk_group=2,
            renorm="add",
            renorm_eps=1e-20,
            routed_scaling_factor=2.5,
        ),
    )

    def conv():
        return MoEParams(
            _np(m.gate.weight).T,
            ExpertWeights(*_fused(m.experts)),
            selection_bias=_np(m.gate.e_score_correction_bias),
            shared=_mlp(m.shared_experts),
        )

    return m, cfg, conv


def mixtral():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    c = MixtralConfig(hidden_size=D, intermediate_size=F, num_local_experts=8, num_experts_per_tok=2)
    m = MixtralSparseMoeBlock(c)
    cfg = MoEConfig(d_model=D, expert_dim=F, router=RouterConfig(num_experts=8, top_k=2, renorm="sum"))
    return m, cfg, lambda: MoEParams(_np(m.gate.weight).T, ExpertWeights(*_fused(m.experts)))


def gpt_oss():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    c = GptOssConfig(hidden_size=D, intermediate_size=F, num_local_experts=E, num_experts_per_tok=4)
    m = GptOssMLP(c)
    base = jaxmoe.load_config("gpt-oss-20b")
    import dataclasses

    cfg = dataclasses.replace(base, d_model=D, expert_dim=F, router=dataclasses.replace(base.router, num_experts=E))

    def conv():
        wg, wu, wd = _fused(m.experts, interleaved=True)
        b = _np(m.experts.gate_up_proj_bias)
        ew = ExpertWeights(wg, wu, wd, b[:, ::2], b[:, 1::2], _np(m.experts.down_proj_bias))
        return MoEParams(_np(m.router.weight).T, ew, b_router=_np(m.router.bias))

    return m, cfg, conv


FAMILIES = dict(
    qwen3_moe=qwen3_moe,
    qwen2_moe=qwen2_moe,
    qwen3_5_moe=qwen3_5_moe,
    deepseek_v3=deepseek_v3,
    mixtral=mixtral,
    gpt_oss=gpt_oss,
)


def _hf_router_ids(m, x2):
    router = getattr(m, "gate", None) or m.router
    out = router(x2)
    ids = out[-1] if not isinstance(out, torch.Tensor) else out
    if isinstance(out, tuple) and len(out) == 2:  # DeepSeek: (indices, weights) or gpt-oss (scores, indices)
        a, b = out
        ids = a if a.dtype in (torch.int64, torch.int32) else b
    return np.sort(ids.numpy(), axis=1)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("impl", ["dense", "gather"])
def test_matches_hf_module(family, impl, rng):
    torch.manual_seed(int(rng.integers(1 << 30)))
    m, cfg, conv = FAMILIES[family]()
    _randomize(m, int(rng.integers(1 << 30)))
    m.eval()
    x = rng.normal(size=(2, 9, D)).astype(np.float32)
    with torch.no_grad():
        out = m(torch.from_numpy(x))
        ref = _np(out[0] if isinstance(out, tuple) else out).reshape(-1, D)
        hf_ids = _hf_router_ids(m, torch.from_numpy(x.reshape(-1, D)))
    block = MoEBlock(cfg, params=conv(), impl=impl)
    y, r = block(jnp.asarray(x), return_routing=True)
    np.testing.assert_array_equal(np.sort(np.asarray(r.expert_ids), axis=1), hf_ids)
    y = np.asarray(y).reshape(-1, D)
    rel = np.abs(y - ref).max() / np.abs(ref).max()
    assert rel < 1e-5, f"{family}: relative error {rel:.2e}"


def test_qwen35_moe_block_computes_the_jaxmoe_layer(rng):
    """`jaxmoe.evaluation.hf_block.qwen35_moe_block` (the HF peer that ``jaxmoe eval train``
    and the CPU benchmarks time against): transformers' block filled from a jaxmoe layer's
    params computes that layer, against the float64 reference."""
    from helpers import np_moe, params_to_numpy, random_params, shrink

    from jaxmoe.evaluation.hf_block import qwen35_moe_block

    cfg = shrink(jaxmoe.load_config("qwen3.6-35b-a3b"), d=32, f=16, e=8)
    p = random_params(cfg, rng)
    blk = qwen35_moe_block(p, cfg, threads=torch.get_num_threads()).eval()
    x = rng.standard_normal((7, cfg.d_model)).astype(np.float32)
    with torch.no_grad():
        out = blk(torch.from_numpy(x[None]))
    y = _np(out[0] if isinstance(out, tuple) else out).reshape(-1, cfg.d_model)
    ref, _, _ = np_moe(x, params_to_numpy(p), cfg)
    np.testing.assert_allclose(y, ref, rtol=0, atol=1e-5 * np.abs(ref).max())

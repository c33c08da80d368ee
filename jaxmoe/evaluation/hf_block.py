"""The Hugging Face ``Qwen3_5MoeSparseMoeBlock`` (torch, CPU) holding a jaxmoe layer's weights.

The peer the CPU benchmarks and ``jaxmoe eval train`` time against: transformers'
Qwen3.5/3.6 MoE block with its per-expert ``eager`` loop (its default expert path), the
router, the routed experts and the sigmoid-gated shared expert filled from `MoEParams`.
torch and transformers are imported on call (the ``test`` extra installs them).
"""

from __future__ import annotations

import warnings

import numpy as np

from jaxmoe.config import MoEConfig
from jaxmoe.params import MoEParams


def qwen35_moe_block(p: MoEParams, cfg: MoEConfig, threads: int):
    """The HF block for a Qwen3.6-shaped ``cfg`` holding ``p``'s weights (float32).

    Args:
      p: the layer's parameters: ``w_router [d, E]``, experts ``w_gate, w_up [E, d, F]``,
        ``w_down [E, F, d]`` (float arrays), a shared expert with its sigmoid gate ``[d]``.
      cfg: the layer's config (``d_model``, ``num_experts``, ``top_k``, ``expert_dim``,
        ``shared_expert_dim``).
      threads: torch's intra-op threads (set process-wide).

    Returns the ``torch.nn.Module`` (train mode; parameters of their own, one copy of the
    weights: each tensor is read in place from the jax buffer into torch's).
    """
    import torch
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

    sh = p.shared
    if sh is None or sh.gate is None:
        raise ValueError("qwen35_moe_block: the layer needs a shared expert with a sigmoid gate (Qwen3.5/3.6 shape)")
    torch.set_num_threads(threads)
    hc = Qwen3_5MoeTextConfig(
        hidden_size=cfg.d_model,
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.top_k,
        moe_intermediate_size=cfg.expert_dim,
        shared_expert_intermediate_size=cfg.shared_expert_dim,
        hidden_act="silu",
    )
    hc._experts_implementation = "eager"  # the per-expert loop of modeling_qwen3_5_moe (the default)
    blk = hf.Qwen3_5MoeSparseMoeBlock(hc)  # torch.empty parameters: untouched until filled
    f, ew = cfg.expert_dim, p.experts

    def t(a):  # a zero-copy view of the jax buffer, only read by copy_
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return torch.from_numpy(np.asarray(a))

    with torch.no_grad():
        blk.experts.gate_up_proj[:, :f, :].copy_(t(ew.w_gate).transpose(1, 2))
        blk.experts.gate_up_proj[:, f:, :].copy_(t(ew.w_up).transpose(1, 2))
        blk.experts.down_proj.copy_(t(ew.w_down).transpose(1, 2))
        blk.gate.weight.copy_(t(p.w_router).T)
        blk.shared_expert.gate_proj.weight.copy_(t(sh.w_gate).T)
        blk.shared_expert.up_proj.weight.copy_(t(sh.w_up).T)
        blk.shared_expert.down_proj.weight.copy_(t(sh.w_down).T)
        blk.shared_expert_gate.weight.copy_(t(sh.gate)[None, :])
    return blk

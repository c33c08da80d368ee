"""The ``pallas`` execution strategy: routed experts through the Pallas/Triton kernels.

``experts_pallas(x [T, d], routing, experts, cfg) -> [T, d] float32`` supports all that
`jaxmoe.experts.experts_dense` does (biases, ``swiglu_oai``, ``weight_on_input``,
int8 / int4 quantized weights). Few pairs (``T * k <= tuning.DECODE_MAX_PAIRS``) take
the per-pair decode kernels; otherwise the plan is built (`jaxmoe.dispatch`) and the
fused gate/up and down grouped kernels run over it, then `down.combine` sums each
token's slots. Importing this module registers it as ``impl="pallas"``.

Off GPU the kernels run in Pallas interpret mode (same kernel bodies, slow); set
``JAXMOE_PALLAS_INTERPRET=0`` to demand compiled kernels, which then fails with a
ValueError on a platform where Pallas's Triton backend does not lower.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmoe import backends
from jaxmoe.dispatch import plan_dispatch
from pallas_kernels import tuning
from pallas_kernels.common import activation_of, default_interpret
from pallas_kernels.decode import combine_pairs, decode_down, decode_gate_up
from pallas_kernels.down import combine, down_project
from pallas_kernels.swiglu import gate_up_swiglu

TRITON_PLATFORMS = ("gpu", "cuda", "rocm")


def _launch(b: tuning.Blocks, grouped: bool) -> dict:
    kw = dict(block_n=b.block_n, block_k=b.block_k, num_warps=b.num_warps, num_stages=b.num_stages)
    if grouped:
        kw["block_m"] = b.block_m
    return kw


def experts_pallas(
    x: jax.Array,
    routing,
    experts,
    cfg,
    *,
    interpret: bool | None = None,
    config: tuning.KernelConfig | None = None,
    debug: bool = False,
) -> jax.Array:
    """Routed experts with the Pallas kernels. ``x [T, d]`` -> ``[T, d]`` float32.

    Args:
      x: ``[T, d]`` activations (their dtype is the compute dtype).
      routing: `jaxmoe.Routing` with ``expert_ids, weights [T, k]``.
      experts: `jaxmoe.ExpertWeights` (arrays or `QuantizedTensor`s).
      cfg: the `jaxmoe.MoEConfig`.
      interpret: Pallas interpret mode; default `common.default_interpret` (an explicit
        False skips the platform check, e.g. to lower for CUDA from a CPU host).
      config: block sizes; default ``tuning.choose(T * k, d, F)``.
    """
    if x.ndim != 2 or x.shape[1] != cfg.d_model:
        raise ValueError(f"experts_pallas: x must be [T, {cfg.d_model}], got shape {x.shape}")
    t, d = x.shape
    k = cfg.top_k
    if routing.expert_ids.shape != (t, k):
        raise ValueError(f"experts_pallas: routing.expert_ids {routing.expert_ids.shape} must be {(t, k)}")
    if interpret is None:
        interpret = default_interpret()
        if not interpret and jax.default_backend() not in TRITON_PLATFORMS:
            raise ValueError(
                f"impl='pallas' compiles Triton kernels, which do not lower on platform "
                f"{jax.default_backend()!r}; use impl='xla' there (or JAXMOE_PALLAS_INTERPRET=1 to "
                "run the kernels in the slow interpreter)"
            )
    kc = config or tuning.choose(t * k, d, cfg.expert_dim)
    act = activation_of(cfg)
    akw = dict(activation=act.kind, alpha=act.alpha, limit=act.limit)
    ids = routing.expert_ids.astype(jnp.int32)
    w = routing.weights.reshape(-1).astype(jnp.float32)  # [P] pair order
    woi = cfg.weight_on_input
    ew = experts
    if t == 0:
        return jnp.zeros((0, d), jnp.float32)
    if kc.decode:
        with jax.named_scope("pallas_decode"):
            h = decode_gate_up(
                x,
                ids,
                ew.w_gate,
                ew.w_up,
                ew.b_gate,
                ew.b_up,
                w if woi else None,
                **akw,
                **_launch(kc.gate_up, False),
                interpret=interpret,
                debug=debug,
            )
            y = decode_down(
                h,
                ids,
                ew.w_down,
                ew.b_down,
                None if woi else w,
                **_launch(kc.down, False),
                interpret=interpret,
                debug=debug,
            )
            return combine_pairs(y, k)
    with jax.named_scope("pallas_grouped"):
        plan = plan_dispatch(ids, cfg.num_experts, kc.gate_up.block_m)
        ws = w[plan.sort_idx]  # [P] sorted order
        meta = (plan.group_offsets, plan.tile_group, plan.tile_row, plan.num_tiles)
        h = gate_up_swiglu(
            x,
            plan.token_idx,
            *meta,
            ew.w_gate,
            ew.w_up,
            ew.b_gate,
            ew.b_up,
            ws if woi else None,
            **akw,
            **_launch(kc.gate_up, True),
            interpret=interpret,
            debug=debug,
        )
        y = down_project(
            h,
            *meta,
            ew.w_down,
            ew.b_down,
            None if woi else ws,
            **_launch(kc.down, True),
            interpret=interpret,
            debug=debug,
        )
        return combine(y, plan.inv, k)


backends.register_impl("pallas", experts_pallas)

"""The ``pallas`` execution strategy: routed experts through the Pallas/Triton kernels.

``experts_pallas(x [T, d], routing, experts, cfg) -> [T, d] float32`` supports all that
`jaxmoe.experts.experts_dense` does (biases, ``swiglu_oai``, ``weight_on_input``,
int8 / int4 quantized weights and the GGUF block kinds). It is the adapter between jaxmoe's types and the
standalone `pallas_kernels` package, which takes plain arrays: each expert weight
becomes a kernel operand (`kernel_weight`: a float array as is, a
`jaxmoe.quant.QuantizedTensor` as a `pallas_kernels.quant.QuantWeight`). Few pairs
(``T * k <= tuning.DECODE_MAX_PAIRS``) take the per-pair decode kernels; otherwise the
plan is built (`jaxmoe.dispatch.plan_dispatch`) and the fused gate/up and down grouped
kernels run over it, then `pallas_kernels.down.combine` sums each token's slots.
`jaxmoe.impls.registry` lists it as ``impl="pallas"``. Expert ids outside ``[0, E)``
are a ValueError when concrete; under ``jit`` such a pair adds exactly zero (the decode
kernels read expert 0 for it and the result is masked; the plan drops it).

Interpret mode follows the platform group the branch is lowered for (``ex.platform``,
set by `jaxmoe.impls.policy.run_experts`): lowered for CUDA / ROCm the kernels are
compiled Triton kernels, even when the program is traced on a CPU host
(``jax.jit(f).lower(lowering_platforms=("cuda",))``, ``jax.export``); lowered anywhere
else they run in Pallas interpret mode (same kernel bodies, slow).
``ExecConfig(interpret=True / False)`` forces interpret / compiled mode on every platform
(compiled mode then fails to lower where Pallas's Triton backend does not exist: "MLIR
translation rule for primitive 'pallas_call' not found").

Reverse mode (a `jax.custom_vjp`, issue 13): the backward runs in Pallas over a dispatch
plan (the decode bucket's too, with ``tuning.fixed`` blocks), `pallas_kernels.backward`:
`gate_up_backward` recomputes ``g, u`` and ``dh = w dy Wd^T`` per sorted row (``Wd`` read
in place as its transpose) and fuses the SwiGLU / gpt-oss derivative (biases included);
`gmm_transposed` gives the input gradient ``dg Wg^T + du Wu^T``, summed per token in slot
order; `tgmm` / `group_sum` the weight and bias gradients (per expert, float32,
deterministic). The routing weights' gradient is ``<dy_t, z_pair>`` from the saved
unweighted expert outputs ``z [T * k, d]`` float32 (the only residual besides the inputs;
with ``weight_on_input`` it comes from the gate/up kernel and nothing is saved).
Quantized experts (`jaxmoe.experts.experts_frozen`) are frozen: the input and routing
gradients read the quantized weights tile by tile in the kernels (int8 / int4 and the GGUF
block kinds, MXFP4 and block-scaled FP8, as in the forward) and the experts get
`jaxmoe.experts.frozen_cotangent`. The GGUF IQ1-3 / TQ kinds reach the kernels as float
weights decoded by XLA (`kernel_weight`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxmoe.config import MoEConfig
from jaxmoe.dispatch import check_expert_ids, id_valid, plan_dispatch, replace_invalid
from jaxmoe.execution import ExecConfig
from jaxmoe.experts import ExpertWeights, experts_frozen, frozen_cotangent, zero_cotangent
from jaxmoe.quant import GGUF_BLOCKS, QuantizedTensor, materialize
from jaxmoe.routing import Routing
from pallas_kernels import tuning
from pallas_kernels.backward import backward_blocks, gate_up_backward, gmm_transposed, group_sum, tgmm
from pallas_kernels.common import Activation
from pallas_kernels.decode import combine_pairs, decode_down, decode_gate_up
from pallas_kernels.down import combine, down_project
from pallas_kernels.launch import DecodeLaunch, Launch, Plan
from pallas_kernels.quant import QUANT_KINDS, QuantWeight
from pallas_kernels.swiglu import gate_up_swiglu


def kernel_weight(w: jax.Array | QuantizedTensor, dtype=jnp.float32) -> jax.Array | QuantWeight:
    """An expert weight ``[E, K, N]`` as the kernels take it: a float array unchanged, a
    `QuantizedTensor` as the `QuantWeight` of the same arrays (int8 / int4 codes with their
    scales; a GGUF block kind the kernels decode in-kernel (`pallas_kernels.gguf.TILE_KINDS`,
    MXFP4 included) as the file's block bytes; block-scaled FP8 (``fp8_e4m3``) as its codes'
    bytes with its block scales: decoded tile by tile, no float copy of any expert). A kind
    without an in-kernel decode, FP8 with a block edge that is not a multiple of 32, or
    MXFP4 whose expert holds an odd number of bytes is decoded with XLA
    (`jaxmoe.quant.materialize`) into a float ``[E, K, N]`` array in ``dtype`` (the compute
    dtype) before the kernels: a transient float copy of every expert of that weight."""
    if not isinstance(w, QuantizedTensor):
        return w
    odd_mxfp4 = w.kind == "mxfp4" and w.qdata.shape[-2] * w.qdata.shape[-1] % 2
    if w.kind not in QUANT_KINDS or odd_mxfp4 or (w.kind == "fp8_e4m3" and w.group_size % 32):
        return materialize(w, dtype)
    if w.kind == "fp8_e4m3":
        assert w.scales is not None
        codes = jax.lax.bitcast_convert_type(jnp.asarray(w.qdata), jnp.uint8)
        return QuantWeight(codes, jnp.asarray(w.scales), None, kind=w.kind, group_size=w.group_size)
    if w.kind in GGUF_BLOCKS:
        return QuantWeight(jnp.asarray(w.qdata), None, None, kind=w.kind, group_size=w.group_size)
    if w.scales is None:
        raise ValueError(f"kernel_weight: a {w.kind} QuantizedTensor needs its scales, got None")
    biases = None if w.biases is None else jnp.asarray(w.biases)
    return QuantWeight(jnp.asarray(w.qdata), jnp.asarray(w.scales), biases, kind=w.kind, group_size=w.group_size)


def _launch(b: tuning.Blocks, interpret: bool, debug: bool, mma: bool | None = None) -> Launch:
    """The `pallas_kernels.launch.Launch` of table entry ``b``: the grouped kernels', or with
    ``mma`` given the decode kernels' `DecodeLaunch` (which do not read ``block_m``)."""
    lc = Launch(block_m=b.block_m, block_n=b.block_n, block_k=b.block_k, num_warps=b.num_warps, num_stages=b.num_stages)
    lc = dataclasses.replace(lc, interpret=interpret, debug=debug)
    return lc if mma is None else DecodeLaunch(**dataclasses.asdict(lc), mma=mma)


def experts_pallas(
    x: jax.Array,
    routing: Routing,
    experts: ExpertWeights,
    cfg: MoEConfig,
    ex: ExecConfig | None = None,
    *,
    debug: bool = False,
) -> jax.Array:
    """Routed experts with the Pallas kernels. ``x [T, d]`` -> ``[T, d]`` float32.

    Args:
      x: ``[T, d]`` activations (their dtype is the compute dtype).
      routing: `jaxmoe.routing.Routing` with ``expert_ids, weights [T, k]``.
      experts: `jaxmoe.experts.ExpertWeights` (arrays or `QuantizedTensor`s).
      cfg: the `jaxmoe.config.MoEConfig`.
      ex: ``interpret`` (default: compiled when ``ex.platform``, the lowering platform
        group, is ``triton``, interpreted otherwise); ``kernel_config`` block sizes
        (default ``tuning.choose(T * k, d, F, x.dtype)``, or ``tuning.fixed(d, F,
        x.dtype)`` with ``batch_invariant``).
      debug: the Pallas ``debug`` flag (prints each kernel's jaxpr and generated code).
    """
    ex = ex or ExecConfig()
    if x.ndim != 2 or x.shape[1] != cfg.d_model:
        raise ValueError(f"experts_pallas: x must be [T, {cfg.d_model}], got shape {x.shape}")
    t, d = x.shape
    k = cfg.top_k
    check_expert_ids(routing.expert_ids, experts.num_experts, "experts_pallas", shape=(t, k), weights=routing.weights)
    interpret = ex.interpret if ex.interpret is not None else ex.group != "triton"
    config = ex.kernel_config
    if config is None:  # batch-invariant: one tile program whatever T is, no decode switch
        config = (
            tuning.fixed(d, cfg.expert_dim, x.dtype)
            if ex.batch_invariant
            else tuning.choose(t * k, d, cfg.expert_dim, x.dtype)
        )
    return _experts_vjp(x, routing, experts, cfg, config, interpret, debug)


def _forward(x, routing, experts, cfg, kc, interpret, debug, save: bool):
    """``(y [T, d] float32, z or None)``; with ``save`` (and the routing weight on the
    output) ``z [T * k, d]`` float32 are the unweighted expert outputs in pair order
    (zero for dropped pairs): the residual of the routing weights' gradient."""
    t, d = x.shape
    k = cfg.top_k
    act = Activation(cfg.activation, float(cfg.swiglu_alpha), float(cfg.swiglu_limit))
    ok = id_valid(routing.expert_ids, experts.num_experts)  # [T, k]
    ids = replace_invalid(routing.expert_ids, experts.num_experts, 0).astype(jnp.int32)  # never past the weights
    w = routing.weights.reshape(-1).astype(jnp.float32)  # [P] pair order
    woi = cfg.weight_on_input
    keep_z = save and not woi  # scale applied here, not in the down kernel
    w_gate, w_up, w_down = (kernel_weight(a, x.dtype) for a in (experts.w_gate, experts.w_up, experts.w_down))
    if t == 0:
        return jnp.zeros((0, d), jnp.float32), (jnp.zeros((0, d), jnp.float32) if keep_z else None)
    if kc.decode:
        with jax.named_scope("pallas_decode"):
            gu, dn = (_launch(b, interpret, debug, kc.decode_mma) for b in (kc.gate_up, kc.down))
            h = decode_gate_up(
                x, ids, w_gate, w_up, experts.b_gate, experts.b_up, w if woi else None, act=act, launch=gu
            )
            y = decode_down(h, ids, w_down, experts.b_down, None if woi or keep_z else w, launch=dn)
            okp = ok.reshape(-1, 1)
            if keep_z:
                z = jnp.where(okp, y, 0.0)
                return combine_pairs(z * w[:, None], k), z
            return combine_pairs(jnp.where(okp, y, 0.0), k), None
    with jax.named_scope("pallas_grouped"):
        plan = plan_dispatch(routing.expert_ids, cfg.num_experts, kc.gate_up.block_m)  # drops invalid ids
        ws = w[plan.sort_idx]  # [P] sorted order
        kp = Plan(plan.group_offsets, plan.tile_group, plan.tile_row, plan.num_tiles)
        gu, dn = (_launch(b, interpret, debug) for b in (kc.gate_up, kc.down))
        h = gate_up_swiglu(
            x, plan.token_idx, kp, w_gate, w_up, experts.b_gate, experts.b_up, ws if woi else None, act=act, launch=gu
        )
        y = down_project(h, kp, w_down, experts.b_down, None if woi or keep_z else ws, launch=dn)
        rv = plan.row_valid()[:, None]
        if keep_z:
            z = jnp.where(rv, y, 0.0)
            return combine(z * ws[:, None], plan.inv, k), z[plan.inv]
        return combine(jnp.where(rv, y, 0.0), plan.inv, k), None


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _experts_vjp(x, routing, experts, cfg, kc, interpret, debug):
    return _forward(x, routing, experts, cfg, kc, interpret, debug, save=False)[0]


def _vjp_fwd(x, routing, experts, cfg, kc, interpret, debug):
    y, z = _forward(x, routing, experts, cfg, kc, interpret, debug, save=True)
    return y, (x, routing, experts, z)


def _vjp_bwd(cfg, kc, interpret, debug, res, dy):
    """The backward in Pallas over a dispatch plan (the decode bucket's too; see the module doc)."""
    x, routing, ew, z = res
    t, d = x.shape
    k = cfg.top_k
    frozen = experts_frozen(ew)
    ids_ct: Any = np.zeros(routing.expert_ids.shape, jax.dtypes.float0)  # no cotangent
    if t == 0:
        return jnp.zeros_like(x), Routing(ids_ct, jnp.zeros_like(routing.weights)), zero_cotangent(ew)
    f = cfg.expert_dim
    bkc = tuning.fixed(d, f, x.dtype) if kc.decode else kc  # the backward always runs grouped
    bm = bkc.gate_up.block_m
    bb = backward_blocks(bm, d, f)
    base = Launch(block_m=bm, num_warps=bb.num_warps, num_stages=bb.num_stages, interpret=interpret, debug=debug)
    woi = cfg.weight_on_input
    dy = dy.astype(jnp.float32)
    with jax.named_scope("pallas_backward"):
        plan = plan_dispatch(routing.expert_ids, cfg.num_experts, bm)
        kp = Plan(plan.group_offsets, plan.tile_group, plan.tile_row, plan.num_tiles)
        ws = routing.weights.reshape(-1).astype(jnp.float32)[plan.sort_idx]
        w_gate, w_up, w_down = (kernel_weight(a, x.dtype) for a in (ew.w_gate, ew.w_up, ew.w_down))
        act = Activation(cfg.activation, float(cfg.swiglu_alpha), float(cfg.swiglu_limit))
        biases = None if ew.b_gate is None else (ew.b_gate, ew.b_up)
        gu = dataclasses.replace(base, block_n=bb.gate_up[0], block_k=bb.gate_up[1], num_warps=bb.gate_up_warps)
        dg, du, h, dscale = gate_up_backward(
            x,
            dy,
            plan.token_idx,
            kp,
            (w_gate, w_up, w_down),
            biases,
            ws,
            scale="input" if woi else "output",
            act=act,
            want_h=not frozen,
            launch=gu,
        )
        rv = plan.row_valid()
        dx_launch = dataclasses.replace(base, block_n=bb.input[0], block_k=bb.input[1])
        dxs = gmm_transposed((dg, du), (w_gate, w_up), kp, ws if woi else None, launch=dx_launch)
        dx = combine(jnp.where(rv[:, None], dxs, 0.0), plan.inv, k).astype(x.dtype)
        if woi:
            dw = jnp.where(rv, dscale, 0.0)[plan.inv].reshape(t, k)
        else:  # <dy_t, z_pair>; z is zero for dropped pairs
            dw = jnp.sum(dy[:, None, :] * z.reshape(t, k, d), axis=-1)
        d_routing = Routing(ids_ct, dw.astype(routing.weights.dtype))
        if frozen:
            return dx, d_routing, frozen_cotangent(ew)
        tm, tk, tn = bb.tgmm
        off = plan.group_offsets
        sin, sout = (ws, None) if woi else (None, ws)

        def tg(lhs, rhs, lmap, rmap, s, like):
            n = rhs.shape[1]
            lc = dataclasses.replace(base, block_m=tm, block_k=tuning.fit(tk, lhs.shape[1]), block_n=tuning.fit(tn, n))
            return tgmm(lhs, rhs, off, lmap, rmap, s, launch=lc).astype(like.dtype)

        grads = dict(
            w_gate=tg(x, dg, plan.token_idx, None, sin, ew.w_gate),
            w_up=tg(x, du, plan.token_idx, None, sin, ew.w_up),
            w_down=tg(h, dy, None, plan.token_idx, sout, ew.w_down),
        )
        if ew.b_gate is not None:

            def gs(rhs, rmap, s, like):
                lc = dataclasses.replace(base, block_m=tm, block_n=tuning.fit(tn, rhs.shape[1]))
                return group_sum(rhs, off, rmap, s, launch=lc).astype(like.dtype)

            grads.update(
                b_gate=gs(dg, None, None, ew.b_gate),
                b_up=gs(du, None, None, ew.b_up),
                b_down=gs(dy, plan.token_idx, sout, ew.b_down),
            )
        return dx, d_routing, dataclasses.replace(zero_cotangent(ew), **grads)


_experts_vjp.defvjp(_vjp_fwd, _vjp_bwd)

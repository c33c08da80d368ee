"""The backward pass of ``impl="cpu"``: a second C++ XLA FFI call (``grouped_swiglu_bwd.cc``).

`cpu_vjp` is the ``bwd`` of the forward's `jax.custom_vjp` (`jaxmoe.impls.cpu.kernel`).
The forward saves ``(x, routing, experts, gate_up)``, ``gate_up [T * k, 2F]`` float32 the
gate | up products of each pair in sorted order (the one residual that grows with ``T``;
nothing of size ``[T, E, ...]``); the backward re-plans the dispatch, gathers the upstream
gradient into sorted pair order and runs one custom call that, per expert and block of
``F`` columns, takes gate/up from ``gate_up`` (recomputing them when it is absent: two
of the eight matmul-sized products of a recomputing backward), and returns

- ``dxs [P, d]``: the gradient w.r.t. each sorted row's expert input,
- ``dot [P]``: ``<g_t, y_pair>``, the routing-weight gradient (computed as
  ``<h, g_t W_d^T> + <g_t, b_down>`` from quantities the input gradient needs anyway),
- ``dW_gate, dW_up [E, d, F]``, ``dW_down [E, F, d]`` in the weights' dtype (float32
  accumulation; zero for experts with no rows) and the bias gradients.

Everything around the call (sorting, the per-token sum of ``dxs``, ``weight_on_input``'s
chain rule) stays in XLA. Every output element is one sequential float32 accumulation in
a fixed order, so the gradients are deterministic whatever the thread count.

Experts: float32 / bfloat16 arrays get weight gradients; `QuantizedTensor`s (``int8``,
``int4`` and the GGUF block kinds ``q4_1`` ... ``q6_k``, every kind the forward reads) are
frozen (`jaxmoe.experts.frozen_cotangent`: no weight gradient) and the kernel dequantizes
them block by block for the input gradient (GGUF blocks with the forward's decoder,
``kernel_common.h``). Where the backward library did not build, `cpu_vjp` takes
`jaxmoe.experts.gather_vjp` (per-pair loop, frozen experts): `backward_supports` says why.
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxmoe.config import MoEConfig
from jaxmoe.dispatch import plan_dispatch
from jaxmoe.experts import ExpertWeights, experts_frozen, frozen_cotangent, gather_vjp, zero_cotangent
from jaxmoe.impls.common import sorted_inputs
from jaxmoe.impls.cpu.build import load_handler
from jaxmoe.impls.cpu.kinds import QUANT_KINDS, operands
from jaxmoe.quant import GGUF_BLOCKS, QuantizedTensor
from jaxmoe.routing import Routing

BWD_TARGET = "jaxmoe_grouped_swiglu_bwd"
BWD_SOURCE = Path(__file__).parent / "grouped_swiglu_bwd.cc"
#: Quantized kinds the backward kernel reads (all the forward's); `backward_supports` checks it.
BWD_KINDS = dict(QUANT_KINDS)
#: Columns of F per phase-A task and of d per phase-B task (measured on the Qwen3.6 layer).
BWD_UP_BLOCK = 64
BWD_DOWN_BLOCK = 64

_lock = threading.Lock()
_status: tuple[bool, str] | None = None


def backward_kernel_status() -> tuple[bool, str]:
    """``(available, message)`` of the backward library: built, loaded and registered on
    the first call (its own cached library: a failure leaves the forward working)."""
    global _status
    if _status is not None:
        return _status
    ok, msg, capsule = load_handler(BWD_SOURCE, "JaxmoeGroupedSwigluBwd")
    with _lock:
        if _status is None:
            if ok:
                jax.ffi.register_ffi_target(BWD_TARGET, capsule, platform="cpu")
            _status = (ok, msg)
        return _status


def backward_supports(ew: ExpertWeights) -> str | None:
    """None when the C++ backward reads these experts, else why not (then `cpu_vjp`
    takes `gather_vjp`): float arrays and every `QuantizedTensor` kind the forward reads."""
    for name in ("w_gate", "w_up", "w_down"):
        w = getattr(ew, name)
        if isinstance(w, QuantizedTensor) and w.kind not in BWD_KINDS:
            return f"the C++ backward reads quantized kinds {sorted(BWD_KINDS)}; {name} is {w.kind!r}"
    return None


#: Columns of ``in`` per task at least, for int8 / int4 weights: each stored row's slice is
#: then 128 (int4) or 256 (int8) contiguous bytes, whole cache lines (at 64 columns, half a
#: line of each row per task, the Q4_0 backward step was slower; docs/training.md).
INT_SLICE = 256


def _block_of(w) -> int:
    """Columns of ``w``'s input axis a backward task's slice is a multiple of: a GGUF
    block's elements (a slice decodes whole blocks), `INT_SLICE` for int8 / int4, 1 for
    float weights."""
    if not isinstance(w, QuantizedTensor):
        return 1
    return GGUF_BLOCKS[w.kind][0] if w.kind in GGUF_BLOCKS else INT_SLICE


def grouped_swiglu_bwd(
    xs: jax.Array,
    gs: jax.Array,
    scale: jax.Array | None,
    offsets: jax.Array,
    sizes: jax.Array,
    ew: ExpertWeights,
    cfg: MoEConfig,
    *,
    round_h: bool = False,
    weight_grads: bool = True,
    up_block: int = BWD_UP_BLOCK,
    down_block: int = BWD_DOWN_BLOCK,
    gate_up: jax.Array | None = None,
):
    """The backward custom call. ``xs, gs [P, d]`` float32 in sorted pair order (the
    expert inputs and the unscaled upstream gradient of each row's token), ``scale [P]``
    the row's routing weight (None: 1), ``offsets, sizes [E]`` as `grouped_swiglu`.

    Returns ``(dxs [P, d], dot [P], (dW_gate, dW_up, dW_down) | None, (db_gate, db_up,
    db_down) | None)``: weight gradients in the weights' dtype when ``weight_grads`` (float
    experts only), bias gradients float32 when the experts have biases and ``weight_grads``.
    ``gate_up [P, 2F]``: the forward's gate | up products before the biases
    (`jaxmoe.impls.cpu.kernel.grouped_swiglu_saving`); None recomputes them from ``xs``
    and the weights.
    """
    p, d = xs.shape
    f = ew.w_gate.shape[-1]
    ops = [operands(w) for w in (ew.w_gate, ew.w_up, ew.w_down)]
    biases = ew.biases_f32()
    empty = jax.ShapeDtypeStruct((0,), jnp.float32)
    wshapes = [(ew.num_experts, d, f), (ew.num_experts, d, f), (ew.num_experts, f, d)]
    if weight_grads:
        dw_out = [jax.ShapeDtypeStruct(s, w.dtype) for s, w in zip(wshapes, (ew.w_gate, ew.w_up, ew.w_down))]
    else:
        dw_out = [empty] * 3
    if weight_grads and biases is not None:
        e = ew.num_experts
        db_out = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((e, f), (e, f), (e, d))]
    else:
        db_out = [empty] * 3
    # a task's slice of a quantized weight's `in` axis: whole GGUF blocks, whole lines of int codes
    up_block = max(up_block, _block_of(ew.w_down))  # phase A reads W_down[c0 : c0 + up_block, :]
    down_block = max(down_block, _block_of(ew.w_gate), _block_of(ew.w_up))  # phase B: W_g/W_u[i0 : ...]
    nb = -(-f // up_block)
    call = jax.ffi.ffi_call(
        BWD_TARGET,
        (
            jax.ShapeDtypeStruct((p, d), jnp.float32),
            jax.ShapeDtypeStruct((p,), jnp.float32),
            *dw_out,
            *db_out,
            jax.ShapeDtypeStruct((p, 2 * f), jnp.float32),
            jax.ShapeDtypeStruct((nb, p), jnp.float32),
        ),
        vmap_method="sequential",
    )
    zero = jnp.zeros((0,), jnp.float32)
    dxs, dot, dwg, dwu, dwd, dbg, dbu, dbd, _, _ = call(
        xs.astype(jnp.float32),
        gs.astype(jnp.float32),
        zero if scale is None else scale.astype(jnp.float32),
        offsets.astype(jnp.int32),
        sizes.astype(jnp.int32),
        *ops[0][0],
        *ops[1][0],
        *ops[2][0],
        *(biases or (zero,) * 3),
        zero if gate_up is None else gate_up.astype(jnp.float32),
        act=np.int32(0 if cfg.activation == "swiglu" else 1),
        alpha=np.float32(cfg.swiglu_alpha),
        limit=np.float32(cfg.swiglu_limit),
        round_h=np.int32(round_h),
        kind_gate=np.int32(ops[0][1]),
        kind_up=np.int32(ops[1][1]),
        kind_down=np.int32(ops[2][1]),
        group_gate=np.int32(ops[0][2]),
        group_up=np.int32(ops[1][2]),
        group_down=np.int32(ops[2][2]),
        up_block=np.int32(up_block),
        down_block=np.int32(down_block),
    )
    dws = (dwg, dwu, dwd) if weight_grads else None
    dbs = (dbg, dbu, dbd) if weight_grads and biases is not None else None
    return dxs, dot, dws, dbs


def cpu_vjp(cfg: MoEConfig, res, g):
    """``bwd`` of the ``impl="cpu"`` custom_vjp: ``res = (x, routing, experts[, gate_up])``,
    ``g [T, d]`` -> cotangents of ``(x, routing, experts)``. ``gate_up [T k, 2F]`` is the
    forward's residual (`jaxmoe.impls.cpu.kernel`; without it the kernel recomputes gate/up).
    Falls back to `gather_vjp` when `backward_supports` refuses the experts or the backward
    library did not build."""
    x, routing, ew = res[:3]
    gate_up = res[3] if len(res) > 3 else None
    if backward_supports(ew) is not None or not backward_kernel_status()[0]:
        return gather_vjp(cfg, (x, routing, ew), g)
    return _backward(x, routing, ew, g, cfg, gate_up)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _backward(
    x: jax.Array, routing: Routing, ew: ExpertWeights, g: jax.Array, cfg: MoEConfig, gate_up: jax.Array | None = None
):
    e = ew.num_experts
    t, k = routing.expert_ids.shape
    p = t * k
    frozen = experts_frozen(ew)
    plan = plan_dispatch(routing.expert_ids, e, 1)
    xs = sorted_inputs(x, routing, plan, cfg).astype(jnp.float32)  # [P, d]
    gs = g.astype(jnp.float32)[plan.token_idx]  # [P, d], unscaled
    w = routing.weights
    scale = None if cfg.weight_on_input else w.reshape(p)[plan.sort_idx]
    dxs, dot, dws, dbs = grouped_swiglu_bwd(
        xs,
        gs,
        scale,
        plan.group_offsets[:e],
        plan.group_sizes,
        ew,
        cfg,
        round_h=bool(x.dtype == jnp.bfloat16),
        weight_grads=not frozen,
        gate_up=gate_up,
    )
    valid = plan.pair_valid().reshape(t, k)  # a dropped pair gets exactly zero
    dxp = jnp.where(valid[..., None], dxs[plan.inv].reshape(t, k, -1), 0.0)  # [T, k, d]
    if cfg.weight_on_input:  # expert(w x): d/dw = <dxs, x>, d/dx = sum_k w dxs
        dw = jnp.einsum("tkd,td->tk", dxp, x.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
        dxp = dxp * w.astype(jnp.float32)[..., None]
    else:
        dw = dot[plan.inv].reshape(t, k)
    dw = jnp.where(valid, dw, 0.0)
    dx = dxp.sum(axis=1)
    d_routing = Routing(zero_cotangent(routing.expert_ids), dw.astype(w.dtype))
    if frozen:
        d_ew = frozen_cotangent(ew)
    else:
        assert dws is not None
        bias = (None, None, None)
        if dbs is not None:
            bias = tuple(db.astype(jnp.result_type(b)) for db, b in zip(dbs, (ew.b_gate, ew.b_up, ew.b_down)))
        d_ew = ExpertWeights(*dws, *bias)
    return dx.astype(x.dtype), d_routing, d_ew

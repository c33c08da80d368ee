"""Grouped execution of the routed experts in plain XLA ops (``impl="xla"``).

``xla`` (``auto``'s choice on the CPU when the C++ kernel is not available, and on
platforms without a strategy of their own; on Intel GPUs ``xla`` lowers to
`jaxmoe.impls.xla_tiled`): the ``P = T * k`` (token, slot) pairs are
sorted by expert (`jaxmoe.dispatch.plan_dispatch`); a loop runs over the experts that
received at least one pair, in increasing id order; for each it takes that expert's
weights once (dequantizing a `QuantizedTensor` expert there, so only selected experts
are ever dequantized) and runs plain 2-D dots over its sorted rows in chunks of
``block_m`` rows. The work grows with ``T * k`` (plus one weight read per selected
expert), never with ``E * T``. Rows are written back in sorted order; a chunk that runs
past its expert's rows writes rows of later experts, which those experts overwrite,
so no masking is needed and every row is written exactly by its own expert last.
Finally each pair's row is weighted and summed back to its token in a fixed order
(deterministic).

docs/log/2026-11-29-xla-path.md has the layouts measured on the CPU and why this one won.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxmoe.config import MoEConfig
from jaxmoe.dispatch import DispatchPlan, plan_dispatch
from jaxmoe.execution import ExecConfig
from jaxmoe.experts import ExpertWeights, experts_frozen, frozen_cotangent, mm, swiglu, zero_cotangent
from jaxmoe.ggml_activations import prepare
from jaxmoe.impls.backward import rows_vjp
from jaxmoe.impls.common import check_inputs, combine, sorted_inputs
from jaxmoe.invariance import ROW_BLOCK
from jaxmoe.quant import materialize
from jaxmoe.routing import Routing

#: Largest row chunk of one expert dot.
MAX_BLOCK_M = 256


def choose_block_m(num_pairs: int, num_experts: int) -> int:
    """Row chunk for the expert dots: the power of two at or above the mean rows per
    expert ``P / E``, within ``[1, MAX_BLOCK_M]``."""
    mean = -(-num_pairs // num_experts)
    return int(min(MAX_BLOCK_M, 1 << max(0, (mean - 1).bit_length())))


def experts_xla(
    x: jax.Array, routing: Routing, ew: ExpertWeights, cfg: MoEConfig, ex: ExecConfig | None = None
) -> jax.Array:
    """Sorted grouped SwiGLU in plain XLA ops. ``x [T, d]`` -> ``[T, d]`` float32.

    Args:
      x: ``[T, d]`` activations (compute dtype).
      routing: ``expert_ids, weights [T, k]``.
      ew: `ExpertWeights` ``[E, ...]``, arrays or `QuantizedTensor`.
      cfg: the layer config (activation, biases, ``weight_on_input``).
      ex: ``block_m`` rows per expert dot (default `choose_block_m`;
        `jaxmoe.invariance.ROW_BLOCK` with ``batch_invariant``), ``batch_invariant``,
        ``platform`` the lowering platform group (`jaxmoe.experts.dot_f32`).
    """
    ex = ex or ExecConfig()
    check_inputs(x, routing, ew, "experts_xla")
    t, k = routing.expert_ids.shape
    block_m = ex.block_m
    if block_m is None:  # batch-invariant: one chunk shape whatever T is (jaxmoe.invariance)
        block_m = ROW_BLOCK if ex.batch_invariant else choose_block_m(t * k, ew.num_experts)
    return _xla_jit(x, routing, ew, cfg, (block_m, ex.batch_invariant, ex.group, ex.activations))


def loop_take(ew: ExpertWeights, ex: jax.Array) -> ExpertWeights:
    """``ew.take(ex)`` inside a loop body, behind an optimization barrier on ``(ew, ex)``.

    Without it XLA:CPU rewrites the float32 upcast of a bfloat16 expert slice
    (`jaxmoe.experts.dot_f32`) into one of the whole ``[E, ...]`` operand and hoists that
    out of the loop as loop-invariant: every call then converted all ``E`` experts (two
    orders of magnitude slower at ``T = 1``; quantized experts were not affected). The barrier makes the weights opaque inside the body, so only the taken
    expert is read and converted.
    """
    ew, ex = jax.lax.optimization_barrier((ew, ex))
    return ew.take(ex)


def _active(plan: DispatchPlan, p: int) -> tuple[jax.Array, jax.Array]:
    """The experts with at least one row, in increasing id order (``[min(E, P)]``, padded
    with 0), and their count."""
    n_slots = min(plan.num_experts, p)
    active = jnp.nonzero(plan.group_sizes > 0, size=n_slots, fill_value=0)[0].astype(jnp.int32)
    return active, jnp.sum(plan.group_sizes > 0, dtype=jnp.int32)


def _forward(x: jax.Array, routing: Routing, ew: ExpertWeights, cfg: MoEConfig, how: tuple[int, bool, str, str]):
    bm, invariant, platform, activations = how
    t, d = x.shape
    k = routing.expert_ids.shape[1]
    e = ew.num_experts
    p = t * k
    dt = x.dtype
    with jax.named_scope("dispatch"):
        plan = plan_dispatch(routing.expert_ids, e, bm)
        xs = sorted_inputs(x, routing, plan, cfg)
        xs = jnp.pad(xs, ((0, bm), (0, 0)))  # [P + bm, d]: the last chunk may run past P
        active, n_active = _active(plan, p)

    def expert_body(i, ys):
        ex = active[i]
        start = plan.group_offsets[ex]
        n = plan.group_sizes[ex]
        one = loop_take(ew, ex)  # this expert only: the sole read (and dequantization) of its weights
        wg, wu, wd = (prepare(w, dt, activations) for w in (one.w_gate, one.w_up, one.w_down))  # [d,F] [d,F] [F,d]
        bias = one.biases_f32()

        def chunk_body(j, ys):
            r0 = start + j * bm
            xb = jax.lax.dynamic_slice_in_dim(xs, r0, bm)  # [bm, d]
            y = swiglu(xb, wg, wu, wd, cfg, lambda a, w: mm("mk,kn->mn", a, w, platform), bias)  # [bm, d]
            return jax.lax.dynamic_update_slice_in_dim(ys, y, r0, axis=0)

        return jax.lax.fori_loop(0, (n + bm - 1) // bm, chunk_body, ys)

    with jax.named_scope("grouped_swiglu"):
        ys = jax.lax.fori_loop(0, n_active, expert_body, jnp.zeros((p + bm, d), jnp.float32))
    with jax.named_scope("combine"):
        return combine(ys[:p], routing, plan, cfg, invariant=invariant), plan


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _xla_vjp(x: jax.Array, routing: Routing, ew: ExpertWeights, cfg: MoEConfig, how: tuple) -> jax.Array:
    return _forward(x, routing, ew, cfg, how)[0]


def _xla_fwd(x, routing, ew, cfg, how):
    y, plan = _forward(x, routing, ew, cfg, how)
    return y, (x, routing, ew, plan)  # the inputs and the O(T k) plan: nothing [rows, F], nothing [T, E]


def _xla_bwd(cfg: MoEConfig, how: tuple, res, gy: jax.Array):
    x, routing, ew, plan = res
    with jax.named_scope("xla_backward"):
        dx, dw, dew = experts_xla_backward(x, routing, ew, plan, gy, cfg, platform=how[2])
    return dx, Routing(zero_cotangent(routing.expert_ids), dw), dew


_xla_vjp.defvjp(_xla_fwd, _xla_bwd)
_xla_jit = jax.jit(_xla_vjp, static_argnums=(3, 4))


def experts_xla_backward(
    x: jax.Array,
    routing: Routing,
    ew: ExpertWeights,
    plan: DispatchPlan,
    gy: jax.Array,
    cfg: MoEConfig,
    *,
    platform: str | None = None,
) -> tuple[jax.Array, jax.Array, ExpertWeights]:
    """The reverse of `experts_xla` over its dispatch plan, in the same strategy.

    A loop over the experts that received pairs, in increasing id order; each expert's
    weights are read (and dequantized) once, its rows visited in chunks of
    ``plan.block_m`` (`jaxmoe.impls.backward.rows_vjp`: ``g, u`` recomputed, the input
    gradient against the transposed weights, the weight gradient ``x^T dy`` accumulated
    in float32 per expert and written once). Chunk rows of later experts are written
    with zeros and overwritten by their own expert, as in the forward.

    Args:
      x: ``[T, d]``; routing: ``[T, k]``; ew: the experts; plan: the forward's plan.
      gy: ``[T, d]`` float32 cotangent of the output.
      cfg: the layer config.
      platform: the lowering platform group (`jaxmoe.experts.dot_f32`).

    Returns:
      ``(dx [T, d] in x.dtype, d routing.weights [T, k], d experts)``; frozen (quantized)
      experts get `jaxmoe.experts.frozen_cotangent` and no weight gradient is computed;
      an expert with no rows gets exactly zero.
    """
    t, d = x.shape
    k = routing.expert_ids.shape[1]
    e = ew.num_experts
    p = t * k
    bm = plan.block_m
    dt = x.dtype
    frozen = experts_frozen(ew)
    f32 = jnp.float32
    xs = jnp.pad(sorted_inputs(x, routing, plan, cfg), ((0, bm), (0, 0)))  # [P + bm, d]
    gt = jnp.pad(gy.astype(f32)[plan.token_idx], ((0, bm), (0, 0)))  # [P + bm, d] token cotangent per row
    wr = None
    if not cfg.weight_on_input:
        wr = jnp.pad(routing.weights.astype(f32).reshape(p)[plan.sort_idx], (0, bm))  # [P + bm]
    active, n_active = _active(plan, p)
    f = ew.w_gate.shape[-1]
    has_bias = ew.biases_f32() is not None
    shapes = [(d, f), (d, f), (f, d)] + ([(f,), (f,), (d,)] if has_bias else [])
    leaves = [ew.w_gate, ew.w_up, ew.w_down] + ([ew.b_gate, ew.b_up, ew.b_down] if has_bias else [])
    dtypes = [jnp.dtype(getattr(a, "dtype", f32)) for a in leaves]
    dws_init = () if frozen else tuple(jnp.zeros((e, *s), dtp) for s, dtp in zip(shapes, dtypes))

    def expert_body(i, carry):
        dxs, dwr, dws = carry
        ex = active[i]
        start = plan.group_offsets[ex]
        n = plan.group_sizes[ex]
        one = loop_take(ew, ex)  # the sole read (and dequantization) of this expert's weights
        w = (materialize(one.w_gate, dt), materialize(one.w_up, dt), materialize(one.w_down, dt))
        bias = one.biases_f32()

        def chunk_body(j, carry):
            dxs, dwr, acc = carry
            r0 = start + j * bm
            valid = r0 + jnp.arange(bm, dtype=jnp.int32) < start + n
            sl = lambda a: jax.lax.dynamic_slice_in_dim(a, r0, bm)  # noqa: E731
            r = rows_vjp(
                sl(xs),
                sl(gt),
                None if wr is None else sl(wr),
                valid,
                w,
                bias,
                cfg,
                weight_grads=not frozen,
                platform=platform,
            )
            dxs = jax.lax.dynamic_update_slice_in_dim(dxs, r.dx, r0, axis=0)
            if r.dw is not None:
                dwr = jax.lax.dynamic_update_slice_in_dim(dwr, r.dw, r0, axis=0)
            if r.weights is not None:
                acc = tuple(a + b for a, b in zip(acc, r.weights[: len(acc)]))
            return dxs, dwr, acc

        acc0 = () if frozen else tuple(jnp.zeros(s, f32) for s in shapes)
        dxs, dwr, acc = jax.lax.fori_loop(0, (n + bm - 1) // bm, chunk_body, (dxs, dwr, acc0))
        dws = tuple(jax.lax.dynamic_update_index_in_dim(a, b.astype(a.dtype), ex, 0) for a, b in zip(dws, acc))
        return dxs, dwr, dws

    init = (jnp.zeros((p + bm, d), f32), jnp.zeros((p + bm,), f32), dws_init)
    dxs, dwr, dws = jax.lax.fori_loop(0, n_active, expert_body, init)
    ok = plan.pair_valid().reshape(t, k, 1)
    dxp = jnp.where(ok, dxs[:p][plan.inv].reshape(t, k, d), 0.0)  # [T, k, d] per pair, slot order
    w = routing.weights.astype(f32)
    if cfg.weight_on_input:  # x_in = w x: dx = sum_j w_j dx_in_j, dw_j = <x, dx_in_j>
        dx = jnp.sum(dxp * w[..., None], axis=1)
        dw = jnp.where(ok[..., 0], jnp.sum(dxp * x.astype(f32)[:, None, :], axis=-1), 0.0)
    else:
        dx = jnp.sum(dxp, axis=1)
        dw = jnp.where(ok[..., 0], dwr[:p][plan.inv].reshape(t, k), 0.0)
    if frozen:
        dew = frozen_cotangent(ew)
    else:
        names = ("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down")
        dew = ExpertWeights(**dict(zip(names, dws)))
    return dx.astype(dt), dw.astype(routing.weights.dtype), dew


__all__ = ["MAX_BLOCK_M", "choose_block_m", "experts_xla", "experts_xla_backward"]

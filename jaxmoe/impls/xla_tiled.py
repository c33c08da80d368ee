"""Routed experts in plain XLA ops shaped for a GPU (``impl="xla_tiled"``).

``xla`` (`jaxmoe.impls.xla`) loops over the touched experts: right for XLA:CPU, but on a
GPU each iteration is a few kernel launches, hundreds per layer. This formulation has
no loop: a fixed set of batched ops whose count does not depend on how many experts
the tokens touch. It is what ``impl="xla"`` and ``impl="auto"`` lower to on Intel GPUs
(`jaxmoe.impls.policy`), and the fallback for any XLA GPU without Pallas.

Two layouts, chosen statically from ``P = T * k`` and ``E``:

- **pairs** (``P <= E``, decode): every (token, slot) pair is one row; its expert's
  weights are gathered (``W[ids]``, ``[P, d, F]``: ``P`` expert reads, as many as a
  per-pair kernel does) and the three projections are batched dots over the pairs. No
  sort, no plan.
- **tiles** (larger ``P``): the pairs are sorted by expert and cut into row tiles of
  ``block_m`` (`jaxmoe.dispatch.plan_dispatch`); each (expert, tile) *visit* (a static
  bound of ``cdiv(P, block_m) + min(E, P) - 1`` of them) gathers its rows
  ``[V, block_m, d]`` and its expert's weights ``[V, d, F]`` and the projections are
  batched dots over the visits. Rows of a visit outside its expert (a tile straddling
  two experts, visits past ``num_tiles``) are dropped when the results are scattered
  back to the sorted rows, so each row is written once, by its own expert. ``block_m``
  is the power of two at or above ``2 P / E`` (at most 256), so there are at most
  about ``2 min(E, P)`` visits: the gathered weights are at most about twice those of
  the touched experts.

A pair whose id is outside ``[0, E)`` contributes nothing (as in `jaxmoe.dispatch`).
Quantized experts (`jaxmoe.quant.QuantizedTensor`) are gathered quantized and
dequantized per visit (only the touched experts). No ``[T, E, ...]`` array is formed.
Each pair's row is weighted and summed back to its token in slot order
(`jaxmoe.impls.common.combine`), as in ``xla``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxmoe.config import MoEConfig
from jaxmoe.dispatch import plan_dispatch
from jaxmoe.experts import ExpertWeights, activation, freeze, mm
from jaxmoe.impls.common import check_inputs, combine, sorted_inputs
from jaxmoe.invariance import ROW_BLOCK, slot_sum, wants_invariance
from jaxmoe.quant import materialize
from jaxmoe.routing import Routing

#: Largest row tile.
MAX_BLOCK_M = 256


def choose_block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per tile: 1 (the pairs layout) when ``P <= E``, else the power of two at or
    above ``2 P / E``, within ``[2, MAX_BLOCK_M]``."""
    if num_pairs <= num_experts:
        return 1
    want = -(-2 * num_pairs // num_experts)
    return int(min(MAX_BLOCK_M, max(2, 1 << (want - 1).bit_length())))


def experts_xla_tiled(
    x: jax.Array, routing: Routing, ew: ExpertWeights, cfg: MoEConfig, block_m: int | None = None
) -> jax.Array:
    """Routed experts with a bounded number of batched XLA ops. ``x [T, d]`` -> ``[T, d]`` float32.

    The arguments are those of `jaxmoe.impls.xla.experts_xla`; here ``block_m`` is the rows
    per tile (default `choose_block_m`; 1 takes the pairs layout).
    """
    check_inputs(x, routing, ew, "experts_xla_tiled")
    t, k = routing.expert_ids.shape
    if block_m is not None and (not isinstance(block_m, int) or block_m < 1):
        raise ValueError(f"experts_xla_tiled: block_m must be a positive int, got {block_m!r}")
    if block_m is None:  # batch-invariant: the tiles layout with one tile shape whatever T is
        block_m = ROW_BLOCK if wants_invariance(cfg, "xla_tiled") else choose_block_m(t * k, ew.num_experts)
    bm = block_m
    if t == 0:
        return jnp.zeros((0, x.shape[1]), jnp.float32)
    return _experts_xla_tiled(x, routing, freeze(ew), cfg=cfg, block_m=bm)  # quantized experts: frozen


def _swiglu(xv: jax.Array, ids: jax.Array, ew: ExpertWeights, cfg: MoEConfig) -> jax.Array:
    """``xv [V, m, d]`` through expert ``ids[v]`` of each batch entry -> ``[V, m, d]`` float32."""
    dt = xv.dtype
    one = ew.take(ids)  # [V, ...]: the visited experts' weights, still quantized
    wg, wu, wd = (materialize(w, dt) for w in (one.w_gate, one.w_up, one.w_down))  # [V,d,F] [V,d,F] [V,F,d]
    bias = one.biases_f32()  # [V, F], [V, F], [V, d]
    g = mm("vmd,vdf->vmf", xv, wg)
    u = mm("vmd,vdf->vmf", xv, wu)
    if bias is not None:
        g, u = g + bias[0][:, None], u + bias[1][:, None]
    h = activation(g, u, cfg).astype(dt)
    y = mm("vmf,vfd->vmd", h, wd)
    if bias is not None:
        y = y + bias[2][:, None]
    return y


@functools.partial(jax.jit, static_argnames=("cfg", "block_m"))
def _experts_xla_tiled(x: jax.Array, routing: Routing, ew: ExpertWeights, cfg: MoEConfig, block_m: int) -> jax.Array:
    t, d = x.shape
    k = routing.expert_ids.shape[1]
    p = t * k
    dt = x.dtype
    ids = routing.expert_ids.astype(jnp.int32)
    if block_m == 1:  # pairs layout: one row per (token, slot), in pair order
        with jax.named_scope("pairs"):
            xin = jnp.broadcast_to(x[:, None, :], (t, k, d))
            if cfg.weight_on_input:
                xin = (xin.astype(jnp.float32) * routing.weights[..., None]).astype(dt)
            y = _swiglu(xin.reshape(p, 1, d), ids.reshape(p), ew, cfg).reshape(t, k, d)
            ok = (ids >= 0) & (ids < ew.num_experts)  # an id outside [0, E) is dropped, never clamped
        scale = None if cfg.weight_on_input else routing.weights
        return slot_sum(y, scale, ok, invariant=False)  # not taken when invariant (fixed tiles instead)
    bm = block_m
    with jax.named_scope("dispatch"):
        plan = plan_dispatch(ids, ew.num_experts, bm)
        xs = sorted_inputs(x, routing, plan, cfg)  # [P, d]
        v = plan.max_tiles
        rows = plan.tile_row[:, None] * bm + jnp.arange(bm, dtype=jnp.int32)  # [V, bm] sorted rows
        g = plan.tile_group
        valid = (
            (rows >= plan.group_offsets[g][:, None])
            & (rows < plan.group_offsets[g + 1][:, None])
            & (jnp.arange(v, dtype=jnp.int32) < plan.num_tiles)[:, None]
        )  # [V, bm]: the visit's own rows
        xv = xs.at[rows].get(mode="fill", fill_value=0)  # [V, bm, d]; rows past P read 0
    with jax.named_scope("grouped_swiglu"):
        y = _swiglu(xv, g, ew, cfg)  # [V, bm, d]
    with jax.named_scope("combine"):
        dest = jnp.where(valid, rows, p)  # others out of range: dropped
        ys = jnp.zeros((p, d), jnp.float32).at[dest.reshape(-1)].set(y.reshape(-1, d), mode="drop")
        return combine(ys, routing, plan, cfg, invariant=wants_invariance(cfg, "xla_tiled"))


__all__ = ["MAX_BLOCK_M", "choose_block_m", "experts_xla_tiled"]

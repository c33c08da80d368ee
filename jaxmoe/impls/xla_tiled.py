"""Routed experts in plain XLA ops shaped for a GPU (``impl="xla_tiled"``).

``xla`` (`jaxmoe.impls.xla`) loops over the touched experts: right for XLA:CPU, but on a
GPU each iteration is a few kernel launches, hundreds per layer. This formulation has
no loop: a fixed set of batched ops whose count does not depend on how many experts
the tokens touch. It is what ``impl="xla"`` and ``impl="auto"`` lower to on Intel GPUs
(`jaxmoe.impls.policy`), and the fallback for any XLA GPU without Pallas.

Three layouts (`LAYOUTS`); by default ``pairs`` when ``P = T * k <= E / 2``, else ``capacity``
(``tiles`` when batch invariance is on):

- **pairs** (``P <= E / 2``, decode): every (token, slot) pair is one row; its expert's
  weights are gathered (``W[ids]``, ``[P, d, F]``: ``P`` expert reads, as many as a
  per-pair kernel does) and the three projections are batched dots over the pairs. No
  sort, no plan.
- **capacity** (larger ``P``): the pairs are sorted by expert (`jaxmoe.dispatch.plan_dispatch`)
  and each expert's rows are cut into blocks of ``C = block_m`` rows. The first block of
  every expert (``[E, C, d]``, absent rows zero) goes through batched dots with the
  stored weights ``[E, d, F]`` themselves: every expert's weights are read once, none is
  copied. The further blocks of the experts that hold more than ``C`` rows are
  *overflow visits* (a static bound of `overflow_visits` ``= (P - 1) // C`` of them,
  reached when one expert takes every pair); each gathers its rows and its expert's
  weights, as a tile of the ``tiles`` layout does. The overflow part is compiled for a
  few visit counts (`overflow_buckets`: 0, 2, 8, 32, ..., the bound), one
  `jax.lax.switch` branch each, and a call runs the smallest that holds its visits: only
  the visits a call has (rounded up) copy weights, not the bound's (a usual Qwen3.6 call
  at ``T = 256`` has 0 to 3 visits, against a bound of 127). Each pair then gathers its
  result from its block (no scatter). ``C`` is the power of two at or above ``2 P / E``
  (twice the mean rows per expert), at least `MIN_CAPACITY`.
- **tiles**: the sorted pairs are cut into row tiles of ``block_m``; each (expert, tile)
  *visit* (a static bound of ``cdiv(P, block_m) + min(E, P) - 1`` of them) gathers its
  rows ``[V, block_m, d]`` and its expert's weights ``[V, d, F]`` and the projections are
  batched dots over the visits. Rows of a visit outside its expert (a tile straddling two
  experts, visits past ``num_tiles``) are dropped when the results are scattered back to
  the sorted rows, so each row is written once, by its own expert. It keeps one tile
  shape whatever ``T`` is (``block_m = ROW_BLOCK``), so it is the batch-invariant layout.

A pair whose id is outside ``[0, E)`` contributes nothing (as in `jaxmoe.dispatch`).
Quantized experts (`jaxmoe.quant.QuantizedTensor`) are gathered quantized and
dequantized per visit (``capacity``: all ``E`` experts for the first blocks). No
``[T, E, ...]`` array is formed. Each pair's row is weighted and summed back to its
token in slot order (`jaxmoe.invariance.slot_sum`), as in ``xla``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxmoe.config import MoEConfig
from jaxmoe.dispatch import id_valid, plan_dispatch, replace_invalid, sort_pairs
from jaxmoe.execution import XLA_TILED_LAYOUTS, ExecConfig
from jaxmoe.experts import ExpertWeights, freeze, mm, swiglu
from jaxmoe.ggml_activations import prepare
from jaxmoe.impls.common import check_inputs, combine, sorted_inputs
from jaxmoe.invariance import ROW_BLOCK, slot_sum
from jaxmoe.platforms import host_group
from jaxmoe.routing import Routing

#: Largest row tile.
MAX_BLOCK_M = 256

#: The layouts (module docstring).
LAYOUTS = XLA_TILED_LAYOUTS


#: Smallest capacity / row tile of the capacity layout.
MIN_CAPACITY = 8


def choose_block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per expert and per tile: 1 (the pairs layout) when ``P <= E / 2``, else the
    power of two at or above ``2 P / E`` (twice the mean rows per expert), within
    ``[MIN_CAPACITY, MAX_BLOCK_M]``.

    The pairs layout copies ``P`` experts' weights, the capacity layout reads all ``E``
    in place (plus its overflow visits' copies), so past about ``E / 2`` pairs the
    capacity layout reads less (docs/intel.md has the measurements). A smaller capacity
    makes more overflow visits, each a copy of its expert's weights; a larger one more
    padded rows in the dot over all experts.
    """
    if 2 * num_pairs <= num_experts:
        return 1
    want = -(-2 * num_pairs // num_experts)
    return int(min(MAX_BLOCK_M, max(MIN_CAPACITY, 1 << (want - 1).bit_length())))


def experts_xla_tiled(
    x: jax.Array, routing: Routing, ew: ExpertWeights, cfg: MoEConfig, ex: ExecConfig | None = None
) -> jax.Array:
    """Routed experts with a bounded number of batched XLA ops. ``x [T, d]`` -> ``[T, d]`` float32.

    The arguments are those of `jaxmoe.impls.xla.experts_xla`; here ``ex.block_m`` is the
    rows per tile or per capacity block (default `choose_block_m`; 1 takes the pairs
    layout unless ``ex.layout`` says otherwise) and ``ex.layout`` one of `LAYOUTS`
    (default: ``pairs`` for ``block_m == 1``, else ``tiles`` when batch-invariant, else
    ``capacity``). ``ex.platform``: the lowering platform group (`batched_mm`).
    """
    ex = ex or ExecConfig()
    check_inputs(x, routing, ew, "experts_xla_tiled")
    t, k = routing.expert_ids.shape
    invariant = ex.batch_invariant
    block_m = ex.block_m
    if block_m is None:  # batch-invariant: the tiles layout with one tile shape whatever T is
        block_m = ROW_BLOCK if invariant else choose_block_m(t * k, ew.num_experts)
    layout = ex.layout
    if layout is None:
        layout = "pairs" if block_m == 1 else ("tiles" if invariant else "capacity")
    if layout == "pairs":
        block_m = 1
    if t == 0:
        return jnp.zeros((0, x.shape[1]), jnp.float32)
    how = _How(block_m, layout, invariant, ex.group, ex.activations)
    return _experts_xla_tiled(x, routing, freeze(ew), cfg, how)  # quantized experts: frozen


class _How(NamedTuple):
    """The static choices of one call: rows per tile, layout, invariance, platform group,
    activation arithmetic."""

    block_m: int
    layout: str
    invariant: bool
    platform: str
    activations: str


def batched_mm(a: jax.Array, b: jax.Array, platform: str | None = None) -> jax.Array:
    """``a [V, m, K] @ b [V, K, N]`` -> ``[V, m, N]`` float32, one product per batch entry.

    Off the CPU this is `jaxmoe.experts.mm` (operands as stored, float32 accumulation).
    On the CPU (``platform``, the lowering platform group) the operands are given in the
    form XLA:CPU's batched dot is fastest on (docs/intel.md, "`xla_tiled` on the CPU"):

    - float32 with ``m > 1``: ``a`` transposed to ``[V, K, m]`` behind an optimization
      barrier (else XLA folds the transpose back into the dot), so the product is a
      plain dot rather than a YNNPACK fusion, which packs each ``[K, N]`` weight again;
    - bfloat16 operands with ``m > 1`` go in as they are: XLA:CPU's YNNPACK dot takes
      ``bf16 x bf16 -> f32`` (exact products, float32 sums), where upcasting first wrote
      a float32 copy of every expert's weights;
    - ``m = 1`` (the pairs layout's matrix-vector products), and other mixes, are
      upcast to float32, as `jaxmoe.experts.mm` does on the CPU.

    The sums are float32 in every branch; only their order differs.
    """
    if (platform or host_group()) != "cpu":
        return mm("vmk,vkn->vmn", a, b, platform)
    f32 = jnp.float32

    def plain(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:  # the dot on operands as given
        return jnp.einsum(spec, a, b, preferred_element_type=f32, precision=jax.lax.Precision.HIGHEST)

    if a.shape[1] > 1 and a.dtype == b.dtype == jnp.bfloat16:
        return plain("vmk,vkn->vmn", a, b)
    a, b = a.astype(f32), b.astype(f32)
    if a.shape[1] == 1:  # a matrix-vector product per entry: nothing to pack
        return plain("vmk,vkn->vmn", a, b)
    return plain("vkm,vkn->vmn", jax.lax.optimization_barrier(jnp.swapaxes(a, 1, 2)), b)  # a as [V, K, m]


def _swiglu(xv: jax.Array, one: ExpertWeights, cfg: MoEConfig, platform: str, activations: str) -> jax.Array:
    """``xv [V, m, d]`` through the experts ``one`` (``[V, ...]``, one per batch entry) ->
    ``[V, m, d]`` float32."""
    dt = xv.dtype
    wg, wu, wd = (prepare(w, dt, activations) for w in (one.w_gate, one.w_up, one.w_down))  # [V,d,F] [V,d,F] [V,F,d]
    bias = one.biases_f32()  # [V, F], [V, F], [V, d]
    if bias is not None:
        bias = tuple(b[:, None] for b in bias)
    return swiglu(xv, wg, wu, wd, cfg, lambda a, w: batched_mm(a, w, platform), bias)


@functools.partial(jax.jit, static_argnums=(3, 4))
def _experts_xla_tiled(x: jax.Array, routing: Routing, ew: ExpertWeights, cfg: MoEConfig, how: _How) -> jax.Array:
    if how.layout == "capacity":
        return _capacity(x, routing, ew, cfg, how)
    t, d = x.shape
    k = routing.expert_ids.shape[1]
    p = t * k
    dt = x.dtype
    ids = routing.expert_ids.astype(jnp.int32)
    if how.layout == "pairs":  # one row per (token, slot), in pair order
        with jax.named_scope("pairs"):
            xin = jnp.broadcast_to(x[:, None, :], (t, k, d))
            if cfg.weight_on_input:
                xin = (xin.astype(jnp.float32) * routing.weights[..., None]).astype(dt)
            y = _swiglu(xin.reshape(p, 1, d), ew.take(ids.reshape(p)), cfg, how.platform, how.activations).reshape(
                t, k, d
            )
            ok = id_valid(ids, ew.num_experts)  # an id outside [0, E) is dropped, never clamped
        scale = None if cfg.weight_on_input else routing.weights
        return slot_sum(y, scale, ok, invariant=False)  # not taken when invariant (fixed tiles instead)
    bm = how.block_m
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
        y = _swiglu(xv, ew.take(g), cfg, how.platform, how.activations)  # [V, bm, d]
    with jax.named_scope("combine"):
        dest = jnp.where(valid, rows, p)  # others out of range: dropped
        ys = jnp.zeros((p, d), jnp.float32).at[dest.reshape(-1)].set(y.reshape(-1, d), mode="drop")
        return combine(ys, routing, plan, cfg, invariant=how.invariant)


def overflow_buckets(num_pairs: int, capacity: int) -> tuple[int, ...]:
    """The overflow visit counts the capacity layout compiles, one `jax.lax.switch` branch
    each: 0, then 2, 8, 32, ... (powers of 4 from 2) below `overflow_visits`, then that
    bound; ``(0,)`` when nothing can overflow. A call takes the smallest count that holds
    its visits, so only those gather weights (the bound is reached only when one expert
    takes every pair; at Qwen3.6's T = 256 it is 127 visits, a usual call has 0 to 3).
    """
    bound = overflow_visits(num_pairs, capacity)
    sizes = [0]
    s = 2
    while s < bound:
        sizes.append(s)
        s *= 4
    return (*sizes, bound) if bound else (0,)


def overflow_branch(visits: jax.Array) -> jax.Array:
    """Index into `overflow_buckets` of the smallest count ``>= visits`` (an int32 scalar;
    `jax.lax.switch` clamps it to the last, the bound): 0 for none, else
    ``1 + ceil(log4(ceil(visits / 2)))``, in elementwise ops (one small kernel with the clamp)."""
    m = (visits + 1) // 2 - 1  # ceil(visits / 2) - 1 >= 0 when visits > 0
    bits = 32 - jax.lax.clz(jnp.maximum(m, 0))  # bit length of m
    return jnp.where(visits > 0, 1 + (bits + 1) // 2, 0).astype(jnp.int32)


def overflow_visits(num_pairs: int, capacity: int) -> int:
    """Static bound on the overflow visits of the capacity layout (0: none can overflow).

    An expert with ``n > capacity`` rows has ``cdiv(n, capacity) - 1`` overflow tiles, at
    most ``(n - 1) / capacity``; over all experts (``sum n <= P``) that is at most
    ``(P - 1) // capacity``.
    """
    return max(0, (num_pairs - 1) // capacity)


def _capacity(x: jax.Array, routing: Routing, ew: ExpertWeights, cfg: MoEConfig, how: _How) -> jax.Array:
    """The capacity layout: ``x [T, d]`` -> ``[T, d]`` float32.

    Each expert's sorted rows are cut into blocks of ``cap``. Every expert's first block
    goes through one batched dot over all ``E`` experts with their own weights (no copy:
    ``[E, cap, d]`` rows, absent ones zero); the further blocks of the experts holding
    more than ``cap`` rows (at most `overflow_visits` of them) gather their expert's
    weights. Each pair then gathers its result row from its block: no scatter.
    """
    cap = how.block_m
    t, d = x.shape
    k = routing.expert_ids.shape[1]
    e, p, dt = ew.num_experts, t * k, x.dtype
    ids = routing.expert_ids.astype(jnp.int32)
    j = jnp.arange(cap, dtype=jnp.int32)

    def rows_in(rows: jax.Array) -> jax.Array:  # sorted rows [..., cap] (p: none) -> inputs [..., cap, d]
        tok = token_idx.at[rows].get(mode="fill", fill_value=t)
        xr = x.at[tok].get(mode="fill", fill_value=0)
        if cfg.weight_on_input:
            w = routing.weights.reshape(p).at[sort_idx.at[rows].get(mode="fill", fill_value=0)].get()
            xr = (xr.astype(jnp.float32) * w[..., None]).astype(dt)
        return xr

    with jax.named_scope("dispatch"):
        sort_idx, token_idx, inv, sizes = sort_pairs(ids, e)
        n_over = jnp.maximum(-(-sizes // cap) - 1, 0)  # [E] blocks past the first
        ends = jnp.cumsum(jnp.stack([sizes, n_over], axis=1), axis=0, dtype=jnp.int32)  # [E, 2]: one scan
        starts, vis_end = ends[:, 0] - sizes, ends[:, 1]
        rows_a = jnp.where(j < sizes[:, None], starts[:, None] + j, p)  # [E, cap]; p: no row
        xa = rows_in(rows_a)  # [E, cap, d]
    with jax.named_scope("grouped_swiglu"):
        ya = _swiglu(xa, ew, cfg, how.platform, how.activations)  # every expert's own weights, not gathered
    # the sorted row of each pair, its expert and its place in the expert's rows
    grp = replace_invalid(ids.reshape(p), e, 0)  # [P]; dropped pairs are masked in slot_sum
    pos = inv - starts[grp]  # [P]
    with jax.named_scope("combine"):
        y = ya.reshape(e * cap, d).at[grp * cap + jnp.minimum(pos, cap - 1)].get()  # [P, d]

    def overflow(n_b: int) -> jax.Array:
        """The results ``[P, d]`` of the pairs past their expert's first block, from ``n_b``
        overflow visits (at least this call's). It reads from outside only arrays already
        in memory (the inputs, the sort's outputs, ``ends``): a derived array it closed
        over would be written out as an operand of the switch, a kernel of its own."""
        with jax.named_scope("overflow"):
            # starts, visit ends, the pairs' experts recomputed here (`starts`, `grp` outside
            # are fused into their consumers there)
            st, ve = ends[:, 0] - sizes, ends[:, 1]
            first = ve - jnp.maximum(-(-sizes // cap) - 1, 0)  # [E]: each expert's first visit
            v = jnp.arange(n_b, dtype=jnp.int32)
            g = jnp.minimum(jnp.searchsorted(ve, v, side="right", method="compare_all"), e - 1).astype(jnp.int32)
            blk = (v - first[g] + 1)[:, None]  # [Vb, 1]: block of expert g
            jb = jnp.arange(cap, dtype=jnp.int32)
            ok = (v < ve[-1])[:, None] & (blk * cap + jb < sizes[g][:, None])
            xb = rows_in(jnp.where(ok, st[g][:, None] + blk * cap + jb, p))  # [Vb, cap, d]
        with jax.named_scope("grouped_swiglu"):
            yb = _swiglu(xb, ew.take(g), cfg, how.platform, how.activations)  # [Vb, cap, d]
        with jax.named_scope("combine"):
            gp = replace_invalid(ids.reshape(p), e, 0)
            ps = inv - st[gp]
            vb = jnp.clip(first[gp] + ps // cap - 1, 0, n_b - 1)  # [P] the pair's overflow visit
            return yb.reshape(n_b * cap, d).at[vb * cap + ps % cap].get()

    buckets = overflow_buckets(p, cap)
    if len(buckets) > 1:
        # the smallest compiled visit count that holds this call's visits (0: none, the
        # first blocks held every row): only those visits gather weights
        yo = jax.lax.switch(
            overflow_branch(vis_end[-1]),
            [lambda: jnp.zeros((p, d), jnp.float32), *(functools.partial(overflow, n) for n in buckets[1:])],
        )
        y = jnp.where((pos >= cap)[:, None], yo, y)
    with jax.named_scope("combine"):
        scale = None if cfg.weight_on_input else routing.weights
        ok = id_valid(ids, e)  # an id outside [0, E) is dropped, never clamped
        return slot_sum(y.reshape(t, k, d), scale, ok, invariant=how.invariant)


__all__ = [
    "LAYOUTS",
    "MAX_BLOCK_M",
    "MIN_CAPACITY",
    "batched_mm",
    "choose_block_m",
    "experts_xla_tiled",
    "overflow_branch",
    "overflow_buckets",
    "overflow_visits",
]

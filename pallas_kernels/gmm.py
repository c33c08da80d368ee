"""Grouped matmul (GMM) over a dispatch plan: the core every grouped kernel runs on.

The rows of the left operand are the ``P = T * k`` (token, slot) pairs sorted by
expert; the caller's dispatch plan (`launch.Plan`) delimits them (``group_offsets [E + 1]``)
and lists the ``block_m``-row tile visits (``tile_group``, ``tile_row [V]``,
``num_tiles``). The grid is ``(tile visits, column blocks)``;
visit ``v`` reads its expert ``e = tile_group[v]`` and row tile ``tile_row[v]`` from
int32 arrays (``ids_ref[pid]``: the Triton backend has no scalar prefetch), keeps the
rows of the tile that belong to ``e`` (``group_offsets[e] <= row < group_offsets[e+1]``)
with masked loads and stores, and accumulates ``lhs_tile @ W[e]`` over K in float32.
A tile that straddles two experts is visited once per expert, each visit writing only
its own rows; visits past ``num_tiles`` do nothing. Nothing is ever atomically added.

`grouped_call` builds the fused variants (row gather prologue, two weights with a
SwiGLU epilogue, biases, a per-row scale); `gmm` is the plain grouped matmul and
`gmm_reference` its pure-jnp reference.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import common
from pallas_kernels.launch import (
    EpilogueSpec,
    Launch,
    Plan,
    RowTileSpec,
    TileVisit,
    call,
    check_plan,
    epilogue_fields,
    epilogue_operands,
    kernel_jit,
    on_tile_visit,
    plan_operands,
    row_tile,
    weight_refs,
)
from pallas_kernels.quant import dequantize_reference, load_tile, tile_matmul, weight_operands

SCALES = ("none", "input", "output")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupedSpec(EpilogueSpec, RowTileSpec):
    """Static description of one grouped launch (the fields of `launch.EpilogueSpec` and
    `launch.RowTileSpec`)."""


def _grouped_kernel(*refs, spec: GroupedSpec, aliased: bool):
    # refs: tile_group [V] i32, tile_row [V] i32, group_offsets [E+1] i32, num_tiles [1] i32,
    #       (row_map [P] i32), (row_scale [P] f32), lhs [T or P, K],
    #       weight arrays (see quant.WeightLayout), (biases [E, N] per weight),
    #       (aliased out buffer, unused), out [P, N].
    it = iter(refs)
    plan_refs = [next(it) for _ in range(4)]
    map_ref = next(it) if spec.gather else None
    scale_ref = next(it) if spec.scale != "none" else None
    lhs_ref = next(it)
    w_refs, b_refs, out_ref = weight_refs(it, spec, aliased)
    bk = spec.block_k
    cdt = jnp.dtype(spec.compute_dtype)

    def visit(t: TileVisit):
        e, rows, valid, src, n0, ns = t.e, t.rows, t.valid, t.src, t.n0, t.ns

        def step(i, accs):
            k0 = i * bk
            ks = k0 + jnp.arange(bk, dtype=jnp.int32)
            xm = valid[:, None] & (ks < spec.k)[None, :]
            xt = plgpu.load(lhs_ref.at[src[:, None], ks[None, :]], mask=xm, other=0).astype(cdt)  # [bm, bk]
            return tuple(
                acc + tile_matmul(xt, *load_tile(lay, wr, e, k0, n0, bk, t.bn, cdt), tf32=spec.tf32)
                for acc, lay, wr in zip(accs, spec.layouts, w_refs)
            )

        zero = jnp.zeros((t.bm, t.bn), jnp.float32)
        accs = jax.lax.fori_loop(0, pl.cdiv(spec.k, bk), step, tuple(zero for _ in spec.layouts))
        if spec.scale != "none":
            rs = plgpu.load(scale_ref.at[rows], mask=valid, other=0).astype(jnp.float32)[:, None]
        if spec.scale == "input":
            accs = tuple(a * rs for a in accs)
        if spec.has_bias:
            accs = tuple(
                a + plgpu.load(b.at[e, pl.ds(n0, t.bn)], mask=ns < spec.n, other=0).astype(jnp.float32)[None, :]
                for a, b in zip(accs, b_refs)
            )
        y = spec.act(*accs) if len(accs) == 2 else accs[0]
        if spec.scale == "output":
            y = y * rs
        t.store(out_ref, y, t.mask(spec.n))

    on_tile_visit(plan_refs, spec.n, spec.block_m, spec.block_n, visit, map_ref)


def grouped_call(
    where,
    plan: Plan,
    launch: Launch,
    lhs,
    weights,
    out,
    out_dtype,
    *,
    row_map=None,
    row_scale=None,
    scale="none",
    biases=None,
    act=None,
):
    """Checks the plan, tile sizes and ``out``, then launches `_grouped_kernel` (the other
    arguments already checked by the public wrappers).

    ``weights``: ``(layout, arrays)`` per weight; ``row_map``: rows gathered from ``lhs``
    (else ``lhs`` is sorted); ``scale``: where a given ``row_scale`` applies (`SCALES`).
    Returns ``[P, N]`` in ``out_dtype``; ``out`` (same shape and dtype) is aliased to the
    result, so rows the kernel never writes keep ``out``'s values.
    """
    layouts = tuple(lay for lay, _ in weights)
    check_plan(where, layouts[0].num_experts, plan)
    block_m = row_tile(where, launch)
    rows = lhs.shape[0] if row_map is None else row_map.shape[0]
    odt = jnp.dtype(out_dtype)
    common.check_out(where, out, (rows, layouts[0].n), odt)
    fields = epilogue_fields(lhs, layouts, row_map is not None, scale, row_scale, biases, act, odt, launch)
    bk = fit_block_k(launch.block_k, layouts)
    spec = GroupedSpec(rows=rows, block_m=block_m, block_n=launch.block_n, block_k=bk, **fields)
    args = plan_operands(plan)
    if spec.gather:
        args.append(row_map.astype(jnp.int32))
    args, aliases = epilogue_operands(args, spec, row_scale, lhs, [arrs for _, arrs in weights], biases, out)
    kernel = functools.partial(_grouped_kernel, spec=spec, aliased=out is not None)
    grid = (plan.tile_group.shape[0] * pl.cdiv(spec.n, spec.block_n),)  # common.grouped_order
    out_shape = jax.ShapeDtypeStruct((spec.rows, spec.n), odt)
    return call("moe_gmm", kernel, out_shape, grid, args, launch, aliases)


def fit_block_k(block_k: int, layouts) -> int:
    """``block_k`` raised to a whole quantization group of every weight layout."""
    need = max(lay.min_block_k() for lay in layouts)
    return max(block_k, need)


@kernel_jit("out_dtype")
def gmm(lhs, rhs, plan: Plan, out=None, *, launch: Launch, out_dtype=None):
    """Grouped matmul: row ``r`` of ``lhs`` times the weight of its expert.

    Args:
      lhs: ``[P, K]`` rows sorted by expert (``plan.group_offsets`` delimit each expert's rows).
      rhs: ``[E, K, N]`` float array or `quant.QuantWeight` (int8 / int4).
      plan: the `launch.Plan`, built with ``launch.block_m``.
      out: optional ``[P, N]`` buffer aliased to the output (rows no visit writes keep it).
      launch: the `launch.Launch` (``block_m`` required).
    Returns:
      ``[P, N]`` in ``out_dtype`` (default ``lhs.dtype``), float32 accumulation.
    """
    common.check_array("gmm: lhs", lhs, (None, None), kinds="float")
    weight = weight_operands(rhs, "gmm: rhs", k=lhs.shape[1], word_loads=launch.word_loads)
    return grouped_call("gmm", plan, launch, lhs, [weight], out, out_dtype or lhs.dtype)


def row_experts(group_offsets: jax.Array, rows: int) -> jax.Array:
    """``[P]`` int32 expert of each sorted row, from ``group_offsets [E + 1]``."""
    return (jnp.searchsorted(group_offsets[1:], jnp.arange(rows), side="right")).astype(jnp.int32)


def gmm_reference(lhs, rhs, group_offsets, out_dtype=None):
    """Pure-jnp reference of `gmm`: ``[P, K]`` rows times their expert's ``[K, N]`` weight."""
    lay, arrs = weight_operands(rhs, "gmm_reference: rhs", k=lhs.shape[1])
    w = dequantize_reference(lay, arrs, lhs.dtype)[row_experts(group_offsets, lhs.shape[0])]  # [P, K, N]
    y = jnp.einsum("pk,pkn->pn", lhs, w, preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)
    return y.astype(out_dtype or lhs.dtype)

"""Backward kernels of the grouped SwiGLU experts, over the forward's dispatch plan.

Forward, per sorted row ``r`` of expert ``e`` (token ``t = token_idx[r]``, row scale
``w = row_scale[r]``, the routing weight)::

    g = s_in * (x[t] @ Wg[e]) + bg[e]      u = s_in * (x[t] @ Wu[e]) + bu[e]
    h = act(g, u)                          z = h @ Wd[e] + bd[e]       y[r] = s_out * z

with ``s_in = w`` (Llama 4, routing weight on the input) or ``s_out = w`` (everyone
else). Given the cotangent ``dy [T, d]`` of the combined output:

- `gate_up_backward`: one program per (tile visit, F block) recomputes ``g, u`` and
  ``dh = s_out * dy[t] @ Wd[e]^T`` in one loop over ``d`` (three float32
  accumulators; ``dy`` and ``x`` rows gathered in-kernel, ``Wd [E, F, d]`` read in place
  as its transpose, no transposed copy), then the SwiGLU derivative in the epilogue:
  ``dg = dh * dact/dg``, ``du = dh * dact/du`` (plain SwiGLU or gpt-oss's clamped form,
  biases included). Optionally also writes ``h`` (for ``Wd``'s gradient) and, with the
  scale on the input, the per-F-block partial sums of ``dg * (x @ Wg) + du * (x @ Wu)``
  whose row sum is the routing weight's gradient.
- `gmm_transposed`: ``dx_rows[r] = s * sum_i lhs_i[r] @ W_i[e]^T`` (the input gradient
  ``dg Wg^T + du Wu^T``), weights read in place as their transposes.
- `tgmm`: per expert ``lhs_e^T @ (s * rhs_e)`` over that expert's rows, the weight
  gradient: one program per (expert, K block, N block) loops over the expert's row
  tiles in order with a float32 accumulator: deterministic, no atomics; an expert with
  no rows gets exact zeros.
- `group_sum`: per expert ``sum_r s * rhs_e[r]`` (bias gradients), same loop.

Weights are float arrays or `pallas_kernels.quant.QuantWeight` (int8 / int4,
dequantized tile by tile with `pallas_kernels.quant.load_tile`, so a frozen quantized
expert's input gradient reads the quantized bytes, no float copy). Rows outside every
group (dropped pairs, past ``group_offsets[-1]``) are never written: mask them.
Each kernel has its pure-jnp reference below it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import common, gguf
from pallas_kernels.common import Activation
from pallas_kernels.gguf import GGUF_BLOCKS
from pallas_kernels.gmm import row_experts
from pallas_kernels.launch import (
    EpilogueSpec,
    Launch,
    RowTileSpec,
    TileVisit,
    call,
    check_plan,
    check_row_scale,
    epilogue_fields,
    gate_up_operands,
    kernel_jit,
    on_tile_visit,
    plan_operands,
    row_tile,
)
from pallas_kernels.quant import WeightLayout, dequantize_reference, load_tile, tile_matmul, weight_operands

_HI = jax.lax.Precision.HIGHEST
SCALES = ("none", "input", "output")


def activation_grads(act: Activation, g: jax.Array, u: jax.Array):
    """``(act(g, u), dact/dg, dact/du)`` elementwise in float32 (in-kernel and in XLA).

    SwiGLU: ``h = g s u`` with ``s = sigmoid(g)``: ``dh/dg = u s (1 + g (1 - s))``,
    ``dh/du = g s``. gpt-oss: ``h = (uc + 1) gc sigmoid(a gc)`` with ``gc = min(g, L)``,
    ``uc = clip(u, -L, L)``: the derivatives are zero where the clamp is active.
    """
    g = g.astype(jnp.float32)
    u = u.astype(jnp.float32)
    if act.kind == "swiglu":
        s = jax.nn.sigmoid(g)
        gs = g * s
        return gs * u, u * s * (1.0 + g * (1.0 - s)), gs
    lim = act.limit
    gc = jnp.minimum(g, lim)
    uc = jnp.clip(u, -lim, lim)
    s = jax.nn.sigmoid(act.alpha * gc)
    gs = gc * s
    dg = jnp.where(g < lim, (uc + 1.0) * s * (1.0 + act.alpha * gc * (1.0 - s)), 0.0)
    du = jnp.where((u > -lim) & (u < lim), gs, 0.0)
    return (uc + 1.0) * gs, dg, du


def _opt(it, present: bool) -> Any:
    """The next kernel ref when the operand is present, else None (untyped: a ref)."""
    return next(it) if present else None


def _raise_block(block: int, lay: WeightLayout) -> int:
    return max(block, lay.min_block_k())


def _gguf_cap(block: int, layouts) -> int:
    """``block`` capped at `gguf.MIN_BLOCK_K` when a layout is a GGUF block kind: with the
    tiles decoded from per-element gathers, the gate/up backward's three 64 x 64 tiles spilled
    registers on sm_90 (benchmarks/gpu_compile_check.py); 32-wide K-quant tiles also take
    `gguf.load_tile`'s contiguous loads."""
    if any(lay.kind in GGUF_BLOCKS for lay in layouts):
        return min(block, gguf.MIN_BLOCK_K)
    return block


def _t_tile(lay: WeightLayout, refs, e, n0, k0, bn: int, bk: int, cdt):
    """Tile of ``W[e]^T`` (logical ``[N, K]``) rows ``n0:n0+bn``, columns ``k0:k0+bk``,
    read from the stored weight in place, and the ``k_major`` flag `tile_matmul` needs
    for ``x [bm, bn] @ tile`` -> ``[bm, bk]``."""
    t, km = load_tile(lay, refs, e, k0, n0, bk, bn, cdt)  # [bk, bn] when km else [bn, bk]
    return t, not km


# ----------------------------------------------------------------------------- gate/up backward


@dataclasses.dataclass(frozen=True, kw_only=True)
class BackwardSpec(EpilogueSpec, RowTileSpec):
    """Static description of a `gate_up_backward` launch (fields as `gmm.GroupedSpec`;
    ``k``: d, ``n``: F; ``layouts``: gate, up, down; ``out_dtype``: the gradients';
    ``want_h``: also write ``h``)."""

    want_h: bool
    num_stages: int = 2


def _gate_up_bwd_kernel(*refs, spec: BackwardSpec):
    # refs: tile_group, tile_row, group_offsets, num_tiles, token_idx, (row_scale), x, dy,
    #       gate / up / down weight arrays, (b_gate, b_up), dg, du, (h), (dscale_part).
    it = iter(refs)
    plan_refs = [next(it) for _ in range(4)]
    map_ref = next(it)
    scale_ref = _opt(it, spec.scale != "none")
    x_ref, dy_ref = next(it), next(it)
    lg, lu, ld = spec.layouts
    wg = tuple(next(it) for _ in range(lg.num_arrays))
    wu = tuple(next(it) for _ in range(lu.num_arrays))
    wd = tuple(next(it) for _ in range(ld.num_arrays))
    bg_ref, bu_ref = _opt(it, spec.has_bias), _opt(it, spec.has_bias)
    dg_ref, du_ref = next(it), next(it)
    h_ref = _opt(it, spec.want_h)
    ds_ref = _opt(it, spec.scale == "input")
    bk = spec.block_k
    cdt = jnp.dtype(spec.compute_dtype)

    def visit(t: TileVisit):
        e, rows, valid, src, n0, ns, bn = t.e, t.rows, t.valid, t.src, t.n0, t.ns, t.bn

        def step(i, accs):
            ag, au, ad = accs
            k0 = i * bk
            ks = k0 + jnp.arange(bk, dtype=jnp.int32)
            m = valid[:, None] & (ks < spec.k)[None, :]
            xt = plgpu.load(x_ref.at[src[:, None], ks[None, :]], mask=m, other=0).astype(cdt)
            dt = plgpu.load(dy_ref.at[src[:, None], ks[None, :]], mask=m, other=0).astype(cdt)
            ag = ag + tile_matmul(xt, *load_tile(lg, wg, e, k0, n0, bk, bn, cdt), tf32=spec.tf32)
            au = au + tile_matmul(xt, *load_tile(lu, wu, e, k0, n0, bk, bn, cdt), tf32=spec.tf32)
            ad = ad + tile_matmul(dt, *_t_tile(ld, wd, e, k0, n0, bk, bn, cdt), tf32=spec.tf32)
            return ag, au, ad

        zero = jnp.zeros((t.bm, bn), jnp.float32)
        gx, ux, dh = jax.lax.fori_loop(0, pl.cdiv(spec.k, bk), step, (zero, zero, zero))
        g, u = gx, ux
        if spec.scale != "none":
            rs = plgpu.load(scale_ref.at[rows], mask=valid, other=0).astype(jnp.float32)[:, None]
            if spec.scale == "input":
                g, u = g * rs, u * rs
            else:
                dh = dh * rs
        nm = ns < spec.n
        if spec.has_bias:
            g = g + plgpu.load(bg_ref.at[e, pl.ds(n0, bn)], mask=nm, other=0).astype(jnp.float32)[None, :]
            u = u + plgpu.load(bu_ref.at[e, pl.ds(n0, bn)], mask=nm, other=0).astype(jnp.float32)[None, :]
        h, dadg, dadu = activation_grads(spec.act, g, u)
        dg = dh * dadg
        du = dh * dadu
        om = valid[:, None] & nm[None, :]
        t.store(dg_ref, dg, om)
        t.store(du_ref, du, om)
        if spec.want_h:
            t.store(h_ref, h, om)
        if spec.scale == "input":
            part = jnp.sum(jnp.where(nm[None, :], dg * gx + du * ux, 0.0), axis=1)  # [bm]
            plgpu.store(ds_ref.at[rows, t.j], part, mask=valid)

    on_tile_visit(plan_refs, spec.n, spec.block_m, spec.block_n, visit, map_ref)


def _check_bwd(where, x, dy, token_idx, weights, biases, row_scale, scale, word_loads=False):
    """The operands checked: ``((gate, up, down) as (layout, arrays), (b_gate, b_up))``."""
    if not isinstance(weights, tuple | list) or len(weights) != 3:
        raise ValueError(f"{where}: weights must be (w_gate, w_up, w_down), got {type(weights).__name__}")
    if biases is not None and (not isinstance(biases, tuple | list) or len(biases) != 2):
        raise ValueError(f"{where}: biases must be (b_gate, b_up) or None, got {type(biases).__name__}")
    w_gate, w_up, w_down = weights
    b_gate, b_up = (None, None) if biases is None else biases
    common.check_array(f"{where}: x", x, (None, None), kinds="float")
    t, d = x.shape
    common.check_array(f"{where}: dy", dy, (t, d), kinds="float")
    common.check_array(f"{where}: token_idx", token_idx, (None,), kinds="int")
    (lg, ag), (lu, au) = gate_up_operands(where, d, w_gate, w_up, b_gate, b_up, word_loads)
    ld, ad = weight_operands(w_down, f"{where}: w_down", lg.num_experts, lg.n, d, word_loads=word_loads)
    if scale not in SCALES:
        raise ValueError(f"{where}: scale must be one of {SCALES}, got {scale!r}")
    if (scale == "none") != (row_scale is None):
        raise ValueError(f"{where}: row_scale is required exactly when scale != 'none' (scale={scale!r})")
    check_row_scale(where, row_scale, token_idx.shape[0])
    return ((lg, ag), (lu, au), (ld, ad)), (b_gate, b_up)


@kernel_jit("scale", "act", "want_h")
def gate_up_backward(
    x,
    dy,
    token_idx,
    plan,
    weights,
    biases=None,
    row_scale=None,
    *,
    scale="output",
    act=Activation(),
    want_h=False,
    launch,
):
    """Cotangents of the SwiGLU pre-activations of every sorted row.

    Args:
      x: ``[T, d]`` forward input (its dtype is the compute dtype).
      dy: ``[T, d]`` cotangent of the combined output (any float dtype).
      token_idx: ``[P]`` int32 token of each sorted row.
      plan: the `launch.Plan`, built with ``launch.block_m``.
      weights: ``(w_gate, w_up, w_down)``: ``[E, d, F]``, ``[E, d, F]``, ``[E, F, d]``
        arrays or `quant.QuantWeight`.
      biases: ``(b_gate, b_up)`` ``[E, F]`` each, or None (``b_down`` does not enter).
      row_scale: ``[P]`` float32 routing weight of each sorted row; ``scale``: where the
        forward applied it (``input``: on both projections; ``output``: on ``z``; ``none``).
      act: the forward's `common.Activation`.
      want_h: also return ``h = act(g, u)`` (``x.dtype``) for the down weight's gradient.
      launch: the `launch.Launch` (``block_m`` required).
    Returns:
      ``(dg, du, h or None, dscale or None)``: ``dg, du [P, F]`` in ``x.dtype`` (cotangents
      of ``g, u`` after bias and scale); ``dscale [P]`` float32 with ``scale="input"``:
      the row scale's gradient through ``g`` and ``u``. Rows outside every group are
      unspecified.
    """
    where = "gate_up_backward"
    checked, (b_gate, b_up) = _check_bwd(where, x, dy, token_idx, weights, biases, row_scale, scale, launch.word_loads)
    (lg, ag), (lu, au), (ld, ad) = checked
    p = token_idx.shape[0]
    f = lg.n
    check_plan(where, lg.num_experts, plan)
    block_m = row_tile(where, launch)
    layouts = (lg, lu, ld)
    biases = None if b_gate is None else (b_gate, b_up)  # both or neither (gate_up_operands)
    fields = epilogue_fields(x, layouts, True, scale, row_scale, biases, act, x.dtype, launch)
    spec = BackwardSpec(
        rows=p,
        block_m=block_m,
        block_n=_raise_block(_gguf_cap(launch.block_n, layouts), ld),  # F is the down weight's K
        block_k=max(_raise_block(_gguf_cap(launch.block_k, layouts), lg), lu.min_block_k()),
        want_h=want_h,
        **fields,
    )
    nb = pl.cdiv(f, spec.block_n)
    args = [*plan_operands(plan), token_idx.astype(jnp.int32)]
    if row_scale is not None:
        args.append(row_scale.astype(jnp.float32))
    args += [x, dy, *ag, *au, *ad]
    if b_gate is not None:
        args += [b_gate, b_up]
    shapes = [jax.ShapeDtypeStruct((p, f), x.dtype)] * 2
    if want_h:
        shapes.append(jax.ShapeDtypeStruct((p, f), x.dtype))
    if scale == "input":
        shapes.append(jax.ShapeDtypeStruct((p, nb), jnp.float32))
    kernel = functools.partial(_gate_up_bwd_kernel, spec=spec)
    grid = (plan.tile_group.shape[0] * nb,)  # common.grouped_order
    outs = call("moe_gate_up_bwd", kernel, tuple(shapes), grid, args, launch)
    dg, du = outs[0], outs[1]
    h = outs[2] if want_h else None
    ds = jnp.sum(outs[-1], axis=1) if scale == "input" else None  # fixed order: deterministic
    return dg, du, h, ds


def gate_up_backward_reference(
    x, dy, token_idx, group_offsets, weights, biases=None, row_scale=None, *, scale="output", act=Activation()
):
    """Pure-jnp reference of `gate_up_backward` (``jax.vjp`` of the activation; materializes
    ``[P, d, F]``). Returns ``(dg, du, h, dscale or None)``, all float32."""
    where = "gate_up_backward_reference"
    checked, (b_gate, b_up) = _check_bwd(where, x, dy, token_idx, weights, biases, row_scale, scale)
    ex = row_experts(group_offsets, token_idx.shape[0])
    f32 = jnp.float32
    xs = x[token_idx].astype(f32)
    dys = dy[token_idx].astype(f32)
    wg, wu, wd = (dequantize_reference(lay, a, f32)[ex] for lay, a in checked)
    gx = jnp.einsum("pd,pdf->pf", xs, wg, precision=_HI)
    ux = jnp.einsum("pd,pdf->pf", xs, wu, precision=_HI)
    dh = jnp.einsum("pd,pfd->pf", dys, wd, precision=_HI)
    rs = jnp.ones((xs.shape[0], 1), f32) if row_scale is None else row_scale.astype(f32)[:, None]
    if scale == "output":
        dh = dh * rs

    bias = None if b_gate is None or b_up is None else (b_gate.astype(f32)[ex], b_up.astype(f32)[ex])

    def pre(gx, ux, rs):
        g, u = (gx * rs, ux * rs) if scale == "input" else (gx, ux)
        if bias is not None:
            g, u = g + bias[0], u + bias[1]
        return g, u

    g, u = pre(gx, ux, rs)
    h, vjp = jax.vjp(act, g, u)
    dg, du = vjp(dh)
    ds = None
    if scale == "input":
        _, vjp_pre = jax.vjp(lambda r: pre(gx, ux, r), rs)
        ds = vjp_pre((dg, du))[0][:, 0]
    return dg, du, h, ds


# ----------------------------------------------------------------------------- transposed GMM


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransposedSpec(RowTileSpec):
    """Static description of a `gmm_transposed` launch: ``out [P, N]`` with N the
    weights' K, reduction over their N (``k`` here)."""

    layouts: tuple[WeightLayout, ...]
    scaled: bool
    tf32: bool = False


def _gmm_t_kernel(*refs, spec: TransposedSpec):
    # refs: tile_group, tile_row, group_offsets, num_tiles, (row_scale), lhs_i [P, K] each,
    #       weight arrays of each W_i (logical [E, N, K]), out [P, N] f32.
    it = iter(refs)
    plan_refs = [next(it) for _ in range(4)]
    scale_ref = _opt(it, spec.scaled)
    lhs_refs = [next(it) for _ in spec.layouts]
    w_refs = [tuple(next(it) for _ in range(lay.num_arrays)) for lay in spec.layouts]
    out_ref = next(it)
    bk = spec.block_k
    cdt = jnp.dtype(spec.compute_dtype)

    def visit(t: TileVisit):
        def step(i, acc):
            k0 = i * bk
            ks = k0 + jnp.arange(bk, dtype=jnp.int32)
            m = t.valid[:, None] & (ks < spec.k)[None, :]
            for lay, lr, wr in zip(spec.layouts, lhs_refs, w_refs):
                lt = plgpu.load(lr.at[pl.ds(t.start, t.bm), pl.ds(k0, bk)], mask=m, other=0).astype(cdt)
                acc = acc + tile_matmul(lt, *_t_tile(lay, wr, t.e, k0, t.n0, bk, t.bn, cdt), tf32=spec.tf32)
            return acc

        acc = jax.lax.fori_loop(0, pl.cdiv(spec.k, bk), step, jnp.zeros((t.bm, t.bn), jnp.float32))
        if spec.scaled:
            acc = acc * plgpu.load(scale_ref.at[t.rows], mask=t.valid, other=0).astype(jnp.float32)[:, None]
        t.store(out_ref, acc, t.mask(spec.n))

    on_tile_visit(plan_refs, spec.n, spec.block_m, spec.block_n, visit)


@kernel_jit()
def gmm_transposed(lhs, weights, plan, row_scale=None, *, launch):
    """``out[r] = s[r] * sum_i lhs_i[r] @ W_i[e]^T`` over sorted rows, float32.

    Args:
      lhs: tuple of ``[P, F]`` sorted rows (one per weight; same dtype: the compute dtype).
      weights: tuple of ``[E, D, F]`` arrays or `quant.QuantWeight`s, read transposed in
        place (``D`` is the output width).
      plan: the `launch.Plan`, built with ``launch.block_m``.
      row_scale: ``[P]`` float or None, multiplies each output row.
      launch: the `launch.Launch` (``block_m`` required).
    Returns:
      ``[P, D]`` float32 (rows outside every group unspecified).
    """
    if not isinstance(lhs, tuple | list) or not isinstance(weights, tuple | list) or len(lhs) != len(weights):
        raise ValueError("gmm_transposed: lhs and weights must be sequences of the same length")
    if not lhs:
        raise ValueError("gmm_transposed: need at least one (lhs, weight) pair")
    common.check_array("gmm_transposed: lhs[0]", lhs[0], (None, None), kinds="float")
    p, f = lhs[0].shape
    lays, arrs = [], []
    for i, (a, w) in enumerate(zip(lhs, weights)):
        common.check_array(f"gmm_transposed: lhs[{i}]", a, (p, f), dtype=lhs[0].dtype)
        e = lays[0].num_experts if lays else None
        lay, ar = weight_operands(w, f"gmm_transposed: weights[{i}]", e, n=f, word_loads=launch.word_loads)
        if lays and lay.k != lays[0].k:
            raise ValueError(f"gmm_transposed: weights[{i}] has D={lay.k}, weights[0] D={lays[0].k}")
        lays.append(lay)
        arrs.append(ar)
    check_row_scale("gmm_transposed", row_scale, p)
    check_plan("gmm_transposed", lays[0].num_experts, plan)
    block_m = row_tile("gmm_transposed", launch)
    bn = max(_raise_block(launch.block_n, lay) for lay in lays)  # D is the weights' K
    spec = TransposedSpec(
        rows=p,
        k=f,
        n=lays[0].k,
        block_m=block_m,
        block_n=bn,
        block_k=launch.block_k,
        layouts=tuple(lays),
        scaled=row_scale is not None,
        compute_dtype=lhs[0].dtype.name,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
        tf32=launch.tf32,
    )
    args = plan_operands(plan)
    if row_scale is not None:
        args.append(row_scale.astype(jnp.float32))
    args += list(lhs)
    for ar in arrs:
        args += list(ar)
    kernel = functools.partial(_gmm_t_kernel, spec=spec)
    grid = (plan.tile_group.shape[0] * pl.cdiv(spec.n, bn),)  # common.grouped_order
    out_shape = jax.ShapeDtypeStruct((p, spec.n), jnp.float32)
    return call("moe_gmm_t", kernel, out_shape, grid, args, launch)


def gmm_transposed_reference(lhs, weights, group_offsets, row_scale=None):
    """Pure-jnp reference of `gmm_transposed` (materializes ``[P, D, F]``)."""
    ex = row_experts(group_offsets, lhs[0].shape[0])
    out = 0.0
    for i, (a, w) in enumerate(zip(lhs, weights)):
        lay, ar = weight_operands(w, f"gmm_transposed_reference: weights[{i}]")
        wt = dequantize_reference(lay, ar, jnp.float32)[ex]  # [P, D, F]
        out = out + jnp.einsum("pf,pdf->pd", a.astype(jnp.float32), wt, precision=_HI)
    if row_scale is not None:
        out = out * row_scale.astype(jnp.float32)[:, None]
    return out


# ----------------------------------------------------------------------------- tgmm / group sums


@dataclasses.dataclass(frozen=True, kw_only=True)
class TgmmSpec(RowTileSpec):
    """Static description of a `tgmm` (``k > 0``) or `group_sum` (``k == 0``) launch."""

    num_experts: int
    lhs_gather: bool
    rhs_gather: bool
    scaled: bool
    num_stages: int = 2


def _tgmm_kernel(*refs, spec: TgmmSpec):
    # refs: group_offsets, (lhs_map [P]), (rhs_map [P]), (row_scale [P]), (lhs), rhs, out.
    it = iter(refs)
    off_ref = next(it)
    lmap_ref = _opt(it, spec.lhs_gather)
    rmap_ref = _opt(it, spec.rhs_gather)
    scale_ref = _opt(it, spec.scaled)
    lhs_ref = _opt(it, spec.k > 0)
    rhs_ref, out_ref = next(it), next(it)

    bm, bk, bn = spec.block_m, spec.block_k, spec.block_n
    cdt = jnp.dtype(spec.compute_dtype)
    e = pl.program_id(0)
    lo = off_ref[e]
    hi = off_ref[e + 1]
    k0 = pl.program_id(1) * bk
    n0 = pl.program_id(2) * bn
    ks = k0 + jnp.arange(bk, dtype=jnp.int32)
    ns = n0 + jnp.arange(bn, dtype=jnp.int32)

    def step(i, acc):
        rows = lo + i * bm + jnp.arange(bm, dtype=jnp.int32)
        valid = rows < hi
        rsrc = plgpu.load(rmap_ref.at[rows], mask=valid, other=0) if spec.rhs_gather else rows
        rt = plgpu.load(rhs_ref.at[rsrc[:, None], ns[None, :]], mask=valid[:, None] & (ns < spec.n)[None, :], other=0)
        rt = rt.astype(jnp.float32)
        if spec.scaled:
            rt = rt * plgpu.load(scale_ref.at[rows], mask=valid, other=0).astype(jnp.float32)[:, None]
        if not spec.k:
            return acc + jnp.sum(rt, axis=0)
        lsrc = plgpu.load(lmap_ref.at[rows], mask=valid, other=0) if spec.lhs_gather else rows
        lt = plgpu.load(lhs_ref.at[lsrc[:, None], ks[None, :]], mask=valid[:, None] & (ks < spec.k)[None, :], other=0)
        dims = (((0,), (0,)), ((), ()))
        return acc + jax.lax.dot_general(lt.astype(cdt), rt.astype(cdt), dims, preferred_element_type=jnp.float32)

    steps = (hi - lo + bm - 1) // bm
    acc0 = jnp.zeros((bk, bn) if spec.k else (bn,), jnp.float32)
    acc = jax.lax.fori_loop(0, steps, step, acc0)
    if spec.k:
        om = (ks < spec.k)[:, None] & (ns < spec.n)[None, :]
        plgpu.store(out_ref.at[e, pl.ds(k0, bk), pl.ds(n0, bn)], acc.astype(out_ref.dtype), mask=om)
    else:
        plgpu.store(out_ref.at[e, pl.ds(n0, bn)], acc.astype(out_ref.dtype), mask=ns < spec.n)


def _tgmm_call(where, launch: Launch, lhs, rhs, group_offsets, lhs_map, rhs_map, row_scale):
    """Checks the operands and launches `_tgmm_kernel`: `tgmm`, or `group_sum` with
    ``lhs=None``."""
    for name, a in (("lhs", lhs), ("rhs", rhs)):
        if a is not None:
            common.check_array(f"{where}: {name}", a, (None, None), kinds="float")
    rows = _sorted_rows(where, lhs, rhs, lhs_map, rhs_map)
    _check_rows(where, group_offsets, rows, lhs_map, rhs_map, row_scale)
    block_m, block_k, block_n = row_tile(where, launch), launch.block_k, launch.block_n
    e = group_offsets.shape[0] - 1
    kdim = 0 if lhs is None else lhs.shape[1]
    n = rhs.shape[1]
    spec = TgmmSpec(
        rows=rows,
        num_experts=e,
        k=kdim,
        n=n,
        block_m=block_m,
        block_k=block_k,
        block_n=block_n,
        lhs_gather=lhs_map is not None,
        rhs_gather=rhs_map is not None,
        scaled=row_scale is not None,
        compute_dtype=(rhs if lhs is None else lhs).dtype.name,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
    args = [group_offsets.astype(jnp.int32)]
    args += [a.astype(jnp.int32) for a in (lhs_map, rhs_map) if a is not None]
    if row_scale is not None:
        args.append(row_scale.astype(jnp.float32))
    if lhs is not None:
        args.append(lhs)
    args.append(rhs)
    shape = (e, kdim, n) if kdim else (e, n)
    grid = (e, pl.cdiv(kdim, block_k) if kdim else 1, pl.cdiv(n, block_n))
    name = "moe_tgmm" if kdim else "moe_group_sum"
    out_shape = jax.ShapeDtypeStruct(shape, jnp.float32)
    return call(name, functools.partial(_tgmm_kernel, spec=spec), out_shape, grid, args, launch)


def _check_rows(where, group_offsets, rows, lhs_map, rhs_map, row_scale):
    common.check_array(f"{where}: group_offsets", group_offsets, (None,), kinds="int")
    if group_offsets.shape[0] < 2:
        raise ValueError(f"{where}: group_offsets must be [E + 1] with E >= 1, got shape {group_offsets.shape}")
    for name, a in (("lhs_map", lhs_map), ("rhs_map", rhs_map)):
        if a is not None:
            common.check_array(f"{where}: {name}", a, (rows,), kinds="int")
    check_row_scale(where, row_scale, rows)


@kernel_jit()
def tgmm(lhs, rhs, group_offsets, lhs_map=None, rhs_map=None, row_scale=None, *, launch):
    """Transposed grouped matmul: ``out[e] = sum_{r in group e} lhs[lm[r]]^T (s[r] * rhs[rm[r]])``.

    Args:
      lhs: ``[Tl, K]`` rows (gathered by ``lhs_map`` if given, else the sorted rows).
      rhs: ``[Tr, N]`` rows (gathered by ``rhs_map`` if given); the compute dtype is ``lhs.dtype``.
      group_offsets: ``[E + 1]`` int32 row ranges of the sorted rows (``P`` of them).
      lhs_map, rhs_map: ``[P]`` int32 source row of each sorted row, or None.
      row_scale: ``[P]`` float or None, multiplies the rhs rows (in float32).
      launch: the `launch.Launch`: ``block_m`` rows per step of an expert's loop (any
        power of two >= 16, not tied to a plan), ``block_k``, ``block_n`` the output tile
        (``word_loads`` and ``tf32`` unused: no quantized operand, the dot's default precision).
    Returns:
      ``[E, K, N]`` float32; an expert with no rows gets zeros. Each (expert, K block,
      N block) program adds its expert's row tiles in order: deterministic. float32
      operands multiply at the dot's default precision (TensorFloat-32 on the GPU; the
      forward's and the input gradient's tiles use full float32, `quant.tile_matmul`).
    """
    return _tgmm_call("tgmm", launch, lhs, rhs, group_offsets, lhs_map, rhs_map, row_scale)


def _sorted_rows(where, lhs, rhs, lhs_map, rhs_map) -> int:
    sizes = [a.shape[0] for a in (lhs_map, rhs_map) if a is not None]
    if lhs_map is None and lhs is not None:
        sizes.append(lhs.shape[0])
    if rhs_map is None:
        sizes.append(rhs.shape[0])
    if len(set(sizes)) != 1:
        raise ValueError(f"{where}: the sorted row counts of lhs / rhs / maps disagree: {sizes}")
    return sizes[0]


@kernel_jit()
def group_sum(rhs, group_offsets, rhs_map=None, row_scale=None, *, launch):
    """``out[e] = sum_{r in group e} s[r] * rhs[rm[r]]`` -> ``[E, N]`` float32 (bias
    gradients; the arguments and the deterministic loop of `tgmm`; ``launch.block_k`` is unused)."""
    return _tgmm_call("group_sum", launch, None, rhs, group_offsets, None, rhs_map, row_scale)


def tgmm_reference(lhs, rhs, group_offsets, lhs_map=None, rhs_map=None, row_scale=None):
    """Pure-jnp reference of `tgmm` (and of `group_sum` with ``lhs=None``): a float32
    one-hot ``[P, E]`` contraction."""
    rhs_rows = rhs if rhs_map is None else rhs[rhs_map]
    p = rhs_rows.shape[0]
    e = group_offsets.shape[0] - 1
    ex = row_experts(group_offsets, p)
    inside = jnp.arange(p) < group_offsets[-1]
    onehot = ((ex[:, None] == jnp.arange(e)[None, :]) & inside[:, None]).astype(jnp.float32)  # [P, E]
    r = rhs_rows.astype(jnp.float32)
    if row_scale is not None:
        r = r * row_scale.astype(jnp.float32)[:, None]
    if lhs is None:
        return jnp.einsum("pe,pn->en", onehot, r, precision=_HI)
    lhs_rows = (lhs if lhs_map is None else lhs[lhs_map]).astype(jnp.float32)
    return jnp.einsum("pe,pk,pn->ekn", onehot, lhs_rows, r, precision=_HI)


# ----------------------------------------------------------------------------- block sizes


@dataclasses.dataclass(frozen=True)
class BackwardBlocks:
    """Tiles of the backward launches of one shape (``block_m``: the plan's row tile).

    gate_up: ``(block_n over F, block_k over d)``; input: ``(block_n over d, block_k over F)``;
    tgmm: ``(block_m rows, block_k, block_n)``.
    """

    block_m: int
    gate_up: tuple[int, int] = (64, 64)
    input: tuple[int, int] = (64, 64)
    tgmm: tuple[int, int, int] = (32, 64, 64)
    num_warps: int = 4
    num_stages: int = 2
    #: warps of `gate_up_backward`: three float32 accumulators (4 warps spill at 64 x 64 x 64 in float32)
    gate_up_warps: int = 8


def _fit(block: int, dim: int) -> int:
    return max(16, min(block, 1 << max(0, int(dim) - 1).bit_length()))


def backward_blocks(block_m: int, d: int, f: int) -> BackwardBlocks:
    """`BackwardBlocks` for a ``d x F`` expert over a plan of row tile ``block_m``: tiles
    of 64 (three float32 accumulators in the gate/up backward) fitted to the shape.
    Not tuned on a GPU (benchmarks/gpu_compile_check.py checks spills and shared memory)."""
    common.check_blocks("backward_blocks", block_m=block_m)
    return BackwardBlocks(
        block_m=block_m,
        gate_up=(_fit(64, f), _fit(64, d)),
        input=(_fit(64, d), _fit(64, f)),
        tgmm=(32, 64, 64),
    )

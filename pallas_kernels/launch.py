"""What the kernel wrappers and kernel bodies share beyond `pallas_kernels.common`: how a
wrapper is launched (`Launch`, `DecodeLaunch`) and over which dispatch plan (`Plan`), the
jit decorator, the static-spec fields every launch has, the plan's operands and tile
visits, the weight and bias checks, the epilogue's operand list and the ``pallas_call``
launch itself."""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import common
from pallas_kernels.common import Activation
from pallas_kernels.quant import WeightLayout, weight_operands


@dataclasses.dataclass(frozen=True, kw_only=True)
class Launch:
    """How one kernel wrapper launches (static: a jit static argument).

    Attributes:
      block_m: rows per tile; the grouped kernels need it, and those over a `Plan` need
        the row tile the plan was built with. The decode kernels do not read it.
      block_n, block_k: output columns per program and the reduction step (powers of two
        >= 16; the wrappers raise ``block_k`` to a whole quantization group).
      num_warps, num_stages: Triton's launch parameters.
      word_loads: quantized codes loaded as int32 words (`quant.as_words`); None: only for
        a code array of >= 2^31 elements, which 32-bit offsets cannot address.
      tf32: float32 tiles multiplied as one TensorFloat-32 dot on the tensor cores (faster,
        10-bit mantissas); False: 3xTF32, float32-accurate (`quant.tile_matmul`). 16-bit
        tiles are unaffected.
      interpret: run the kernel bodies in Pallas interpret mode (any platform, slow).
      debug: Pallas's debug flag (prints each kernel's jaxpr and generated code).
    """

    block_m: int | None = None
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    word_loads: bool | None = None
    tf32: bool = False
    interpret: bool = False
    debug: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeLaunch(Launch):
    """A `Launch` of the decode kernels (`pallas_kernels.decode`, whose module doc explains
    both): ``mma``, the pair's row padded to 16 and multiplied on the tensor cores (else a
    float32 broadcast-multiply and reduction); ``split_k``, the K splits (None:
    `tuning.decode_splits`)."""

    block_k: int = 128
    mma: bool = True
    split_k: int | None = None


class Plan(NamedTuple):
    """A dispatch plan as the grouped kernels take it (a pytree of int arrays).

    Attributes:
      group_offsets: ``[E + 1]`` sorted-row range of each expert.
      tile_group, tile_row: ``[V]`` the tile visits (expert, row tile), built with the
        launch's ``block_m``.
      num_tiles: ``[]`` the valid visits.
    """

    group_offsets: jax.Array
    tile_group: jax.Array
    tile_row: jax.Array
    num_tiles: jax.Array


def kernel_jit(*static: str):
    """`jax.jit` with ``static`` and the `Launch` argument ``launch`` as its static arguments."""
    return functools.partial(jax.jit, static_argnames=(*static, "launch"))


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelSpec:
    """Fields of every launch's static description.

    Attributes:
      k, n: reduction and output widths.
      block_n, block_k: tile sizes (powers of two).
      compute_dtype: dtype the tiles are multiplied in.
      num_warps, num_stages: Triton's launch parameters.
    """

    k: int
    n: int
    block_n: int
    block_k: int
    compute_dtype: str
    num_warps: int = 4
    num_stages: int = 3


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowTileSpec(KernelSpec):
    """A launch over the sorted rows: ``rows`` (P, of the sorted order), ``block_m`` (the
    row tile)."""

    rows: int
    block_m: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class EpilogueSpec(KernelSpec):
    """A launch with the weights' epilogue fused.

    Attributes:
      layouts: one weight (plain / down) or two (gate, up: activation epilogue).
      gather: lhs rows are read through a row map (token of each row).
      scale: ``input`` multiplies the accumulators by the row's scale before the bias
        (routing weight on the expert input), ``output`` after bias and activation.
      has_bias: per-expert biases ``[E, N]`` (one per weight).
      act: the epilogue activation of two weights.
      out_dtype: dtype written.
      tf32: float32 tiles multiplied as one TensorFloat-32 dot (else 3xTF32, float32-accurate).
    """

    layouts: tuple[WeightLayout, ...]
    gather: bool
    scale: str
    has_bias: bool
    act: Activation | None
    out_dtype: str
    tf32: bool = False


def epilogue_fields(lhs, layouts, gather, scale, row_scale, biases, act, out_dtype, launch: Launch) -> dict:
    """The `EpilogueSpec` fields of a launch on ``lhs [rows, K]`` (the compute dtype) and
    ``layouts`` (the tiles aside); ``scale`` applies only when ``row_scale`` is given."""
    return dict(
        k=lhs.shape[1],
        n=layouts[0].n,
        layouts=tuple(layouts),
        gather=gather,
        scale=scale if row_scale is not None else "none",
        has_bias=biases is not None,
        act=act,
        compute_dtype=lhs.dtype.name,
        out_dtype=jnp.dtype(out_dtype).name,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
        tf32=launch.tf32,
    )


def call(name: str, kernel, out_shape, grid, args, launch: Launch, aliases=None):
    """``pl.pallas_call`` of ``kernel`` over ``grid`` on ``args``, with Triton's compiler
    params and the interpret / debug flags of ``launch``."""
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        input_output_aliases=aliases or {},
        compiler_params=common.compiler_params(launch.num_warps, launch.num_stages),
        interpret=launch.interpret,
        debug=launch.debug,
        name=name,
    )(*args)


def row_tile(where: str, launch: Launch) -> int:
    """``launch.block_m``, the row tile of a grouped kernel, after checking that it,
    ``block_n`` and ``block_k`` are powers of two >= 16 (a ValueError naming ``where``)."""
    common.check_blocks(where, block_m=launch.block_m, block_n=launch.block_n, block_k=launch.block_k)
    assert launch.block_m is not None  # check_blocks raised otherwise
    return launch.block_m


def check_plan(where: str, num_experts: int, plan: Plan) -> None:
    """ValueError unless ``plan`` holds the arrays of a plan over ``num_experts``."""
    if not isinstance(plan, Plan):
        raise ValueError(f"{where}: plan must be a pallas_kernels.launch.Plan, got {type(plan).__name__}")
    common.check_array(f"{where}: tile_group", plan.tile_group, (None,), kinds="int")
    common.check_array(f"{where}: tile_row", plan.tile_row, (plan.tile_group.shape[0],), kinds="int")
    common.check_array(f"{where}: group_offsets", plan.group_offsets, (num_experts + 1,), kinds="int")
    if jnp.size(plan.num_tiles) != 1:
        raise ValueError(f"{where}: num_tiles must be a scalar, got shape {jnp.shape(plan.num_tiles)}")


def plan_operands(plan: Plan) -> list:
    """The dispatch plan as the grouped kernels' first four int32 operands: tile_group,
    tile_row, group_offsets, num_tiles ``[1]``."""
    return [
        plan.tile_group.astype(jnp.int32),
        plan.tile_row.astype(jnp.int32),
        plan.group_offsets.astype(jnp.int32),
        jnp.reshape(plan.num_tiles, (1,)).astype(jnp.int32),
    ]


def epilogue_operands(args: list, spec: EpilogueSpec, row_scale, lhs, weight_arrays, biases, out):
    """``args`` extended with the forward kernels' operands after the row operands:
    ``(row_scale)``, lhs, the weights' arrays, ``(biases)``, ``(out)``; and the
    ``input_output_aliases`` that alias ``out`` to the output."""
    if spec.scale != "none":
        args.append(row_scale.astype(jnp.float32))
    args.append(lhs)
    for arrs in weight_arrays:
        args.extend(arrs)
    if spec.has_bias:
        args.extend(biases)
    aliases = {}
    if out is not None:
        aliases = {len(args): 0}
        args.append(out)
    return args, aliases


def weight_refs(it, spec: EpilogueSpec, aliased: bool):
    """``(weight refs per layout, bias refs or None, out ref)`` taken from the kernel's
    ref iterator ``it`` (the order of `epilogue_operands`)."""
    w_refs = [tuple(next(it) for _ in range(lay.num_arrays)) for lay in spec.layouts]
    b_refs = [next(it) for _ in spec.layouts] if spec.has_bias else None
    if aliased:
        next(it)
    return w_refs, b_refs, next(it)


@dataclasses.dataclass(frozen=True)
class TileVisit:
    """A grouped program's tile visit: expert ``e``, the ``bm`` sorted rows from ``start``
    (``valid``: those of expert ``e``; ``src``: the row each reads, through the row map if
    any), column block ``j`` (columns ``ns`` from ``n0``)."""

    e: jax.Array
    start: jax.Array
    rows: jax.Array
    valid: jax.Array
    src: jax.Array
    j: jax.Array
    n0: jax.Array
    ns: jax.Array
    bm: int
    bn: int

    def mask(self, n: int) -> jax.Array:
        """``[bm, bn]``: the valid rows' columns below ``n``."""
        return self.valid[:, None] & (self.ns < n)[None, :]

    def block(self):
        """The visit's ``[bm, bn]`` block of a ``[P, N]`` output."""
        return pl.ds(self.start, self.bm), pl.ds(self.n0, self.bn)

    def store(self, ref, y: jax.Array, mask: jax.Array) -> None:
        plgpu.store(ref.at[self.block()], y.astype(ref.dtype), mask=mask)


def on_tile_visit(plan_refs, n: int, bm: int, bn: int, body, map_ref=None) -> None:
    """Runs ``body(TileVisit)`` for this program's (tile visit, column block) in GROUP_M
    order (`common.grouped_order`) when the visit is below ``num_tiles``; ``plan_refs``:
    the refs of `plan_operands`; ``map_ref``: the row map ``[P]`` the rows are gathered
    through, or None."""
    tg_ref, tr_ref, off_ref, nt_ref = plan_refs
    v, j = common.grouped_order(tg_ref.shape[0], pl.cdiv(n, bn))

    @pl.when(v < nt_ref[0])
    def _():
        e = tg_ref[v]
        start = tr_ref[v] * bm
        lo = off_ref[e]
        hi = off_ref[e + 1]
        rows = start + jnp.arange(bm, dtype=jnp.int32)
        valid = (rows >= lo) & (rows < hi)  # [bm] rows of this expert in this tile
        src = rows if map_ref is None else plgpu.load(map_ref.at[rows], mask=valid, other=0)
        n0 = j * bn
        body(TileVisit(e, start, rows, valid, src, j, n0, n0 + jnp.arange(bn, dtype=jnp.int32), bm, bn))


def check_row_scale(where: str, row_scale, rows: int) -> None:
    """An optional ``[rows]`` float row scale."""
    if row_scale is not None:
        common.check_array(f"{where}: row_scale", row_scale, (rows,), kinds="float")


def gate_up_operands(where: str, d: int, w_gate, w_up, b_gate, b_up, word_loads=None):
    """``((gate layout, arrays), (up layout, arrays))`` of ``[E, d, F]`` weights of one
    shape, after checking that the biases ``[E, F]`` are both given or both None."""
    lg, ag = weight_operands(w_gate, f"{where}: w_gate", k=d, word_loads=word_loads)
    lu, au = weight_operands(w_up, f"{where}: w_up", lg.num_experts, d, lg.n, word_loads=word_loads)
    if (b_gate is None) != (b_up is None):
        raise ValueError(f"{where}: give both b_gate and b_up or neither")
    if b_gate is not None:
        common.check_array(f"{where}: b_gate", b_gate, (lg.num_experts, lg.n))
        common.check_array(f"{where}: b_up", b_up, (lg.num_experts, lg.n))
    return (lg, ag), (lu, au)


def down_operands(where: str, f: int, w_down, b_down, word_loads=None):
    """``(layout, arrays)`` of an ``[E, f, d]`` weight, its optional bias ``[E, d]`` checked."""
    lay, arrs = weight_operands(w_down, f"{where}: w_down", k=f, word_loads=word_loads)
    if b_down is not None:
        common.check_array(f"{where}: b_down", b_down, (lay.num_experts, lay.n))
    return lay, arrs

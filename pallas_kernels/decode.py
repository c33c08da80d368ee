"""Decode kernels for few tokens: one program per selected (token, expert) pair.

When ``T * k`` is small, a grouped tile would be mostly empty rows; instead the grid
is ``(pairs, column blocks, K splits)`` and program ``(p, j, s)`` streams its part of
column block ``j`` of its expert's weights once, the analogue of llama.cpp's
selected-expert ``MUL_MAT_ID`` matrix-vector path. No dispatch plan is needed: the pairs
stay in token order ``p = t * k + slot``.

Two ways to multiply (``mma`` of the `launch.DecodeLaunch`):

- ``mma=True`` (default): the pair's activation row is padded to the 16 rows a
  tensor-core ``dot`` needs (15 zero rows) and multiplied with each weight tile as the
  grouped kernels do (`quant.tile_matmul`: MMA, 3xTF32 for float32), so Triton pipelines
  the weight loads (``cp.async``) over ``num_stages``; the padding costs tensor-core
  cycles, which a memory-bound decode has to spare.
- ``mma=False``: a broadcast-multiply and reduction in float32 per tile (quantized
  weights by code plane, `quant.quant_matvec`), no MMA, no pipelined loads.

``split_k`` (default `tuning.decode_splits`: enough programs for the GPU's SMs when the
pairs and column blocks alone are too few, e.g. 128 programs at T = 1 on the Qwen3.6
gate/up) splits K: each split writes its float32 partial sums and the wrapper adds the
splits in order and applies the epilogue (scale, bias, activation) in XLA.

- `decode_gate_up`: ``h[p] = act(x[p // k] @ Wg[e_p] (+ bg), x[p // k] @ Wu[e_p] (+ bu))``
- `decode_down`: ``y[p] = w_p * (h[p] @ Wd[e_p] (+ bd))`` in float32; the caller sums
  the ``k`` slots of each token (`combine_pairs`), deterministically.

Expert ids outside ``[0, E)``: both wrappers raise a ValueError when ``expert_ids`` is
concrete; under ``jit`` the kernel reads expert 0 for such a pair (never past the
weights) and writes a zero row for it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import common, gguf, tuning
from pallas_kernels.common import Activation
from pallas_kernels.down import down_rows_reference
from pallas_kernels.gguf import GGUF_BLOCKS
from pallas_kernels.gmm import fit_block_k
from pallas_kernels.launch import (
    DecodeLaunch,
    EpilogueSpec,
    call,
    check_row_scale,
    down_operands,
    epilogue_fields,
    epilogue_operands,
    gate_up_operands,
    kernel_jit,
    weight_refs,
)
from pallas_kernels.quant import (
    PLANE_KINDS,
    load_tile,
    planes_of,
    quant_matvec,
    tile_matmul,
    tile_matvec,
    weight_operands,
)
from pallas_kernels.swiglu import gate_up_rows_reference


@dataclasses.dataclass(frozen=True, kw_only=True)
class PairSpec(EpilogueSpec):
    """Static description of one decode launch (the fields of `launch.EpilogueSpec`, and
    ``pairs``: P = T * k; ``top_k``: k; ``mma`` and ``split_k``: see the module doc)."""

    pairs: int
    top_k: int
    mma: bool = True
    split_k: int = 1

    @property
    def steps(self) -> int:
        """K steps of ``block_k``."""
        return -(-self.k // self.block_k)

    @property
    def steps_per_split(self) -> int:
        return -(-self.steps // self.split_k)


#: Rows of the padded activation tile of ``mma`` decode (Triton's smallest ``dot``).
MMA_ROWS = 16


def _pair_kernel(*refs, spec: PairSpec, aliased: bool):
    # refs: ids [P] i32 expert of each pair, (row_scale [P] f32), lhs [T or P, K],
    #       weight arrays, (biases [E, N] per weight), (aliased out, unused),
    #       out [P, N] (split_k > 1: partial sums [layouts, splits, P, N] float32).
    it = iter(refs)
    ids_ref = next(it)
    scale_ref = next(it) if spec.scale != "none" else None
    lhs_ref = next(it)
    w_refs, b_refs, out_ref = weight_refs(it, spec, aliased)

    bn, bk = spec.block_n, spec.block_k
    cdt = jnp.dtype(spec.compute_dtype)
    p = pl.program_id(0)
    j = pl.program_id(1)
    split = pl.program_id(2) if spec.split_k > 1 else 0
    e_raw = ids_ref[p]
    id_ok = (e_raw >= 0) & (e_raw < spec.layouts[0].num_experts)
    e = jnp.where(id_ok, e_raw, 0)  # an invalid id reads expert 0 and writes a zero row
    row = p // spec.top_k if spec.gather else p
    n0 = j * bn
    ns = n0 + jnp.arange(bn, dtype=jnp.int32)

    def load_x(start, size: int, stride: int):
        ks = start + stride * jnp.arange(size, dtype=jnp.int32)
        at = (
            lhs_ref.at[row, pl.ds(start, size)] if stride == 1 else lhs_ref.at[row, ks]
        )  # no strided ds in interpret mode
        x = plgpu.load(at, mask=ks < spec.k, other=0)
        return x.astype(cdt).astype(jnp.float32)

    def tiled(lay, wr, k0, zero, prod):
        """``zero + prod(k0, bk, tile)`` over the step's weight tile; GGUF tiles go in pieces
        of 32 columns, one after another (`gguf.load_tile` reads K-quant tiles that narrow
        from contiguous chunks; whole ``[bn, bk]`` tiles of per-element gathers spilled
        registers on sm_90)."""
        if lay.kind in GGUF_BLOCKS and bk > gguf.MIN_BLOCK_K:
            piece = gguf.MIN_BLOCK_K

            def part(c, acc):
                kc = k0 + c * piece
                return acc + prod(kc, piece, load_tile(lay, wr, e, kc, n0, piece, bn, cdt))

            return jax.lax.fori_loop(0, bk // piece, part, zero)
        return zero + prod(k0, bk, load_tile(lay, wr, e, k0, n0, bk, bn, cdt))

    def matvec(lay, wr, k0):  # [bn] float32
        if lay.kind in PLANE_KINDS and planes_of(lay) <= lay.group_size:
            return quant_matvec(lay, wr, e, k0, n0, bk, bn, load_x)
        zero = jnp.zeros((bn,), jnp.float32)
        return tiled(lay, wr, k0, zero, lambda k, size, t: tile_matvec(load_x(k, size, 1), *t))

    first = jnp.arange(MMA_ROWS, dtype=jnp.int32)[:, None] == 0

    def row_tile(k0, size: int):
        """``x[row, k0 : k0 + size]`` as row 0 of a ``[16, size]`` tile (the rest zero)."""
        return jnp.where(first, load_x(k0, size, 1)[None, :], 0.0).astype(cdt)

    def mma(lay, wr, k0):  # [16, bn] float32 (rows 1..15 zero)
        zero = jnp.zeros((MMA_ROWS, bn), jnp.float32)
        return tiled(lay, wr, k0, zero, lambda k, size, t: tile_matmul(row_tile(k, size), *t, tf32=spec.tf32))

    def step(i, accs):
        k0 = (split * spec.steps_per_split + i) * bk  # past K in the last split: masked, adds zero
        prod = mma if spec.mma else matvec
        return tuple(acc + prod(lay, wr, k0) for acc, lay, wr in zip(accs, spec.layouts, w_refs))

    zero = jnp.zeros((MMA_ROWS, bn) if spec.mma else (bn,), jnp.float32)
    accs = jax.lax.fori_loop(0, spec.steps_per_split, step, tuple(zero for _ in spec.layouts))
    if spec.mma:
        accs = tuple(jnp.sum(a, axis=0) for a in accs)  # row 0
    if spec.split_k > 1:  # partial sums; `_finish` adds the splits and applies the epilogue
        for li, a in enumerate(accs):
            plgpu.store(out_ref.at[jnp.int32(li), split, p, pl.ds(n0, bn)], a, mask=ns < spec.n)
        return
    rs = scale_ref[p].astype(jnp.float32) if spec.scale != "none" else None
    biases = [plgpu.load(b.at[e, pl.ds(n0, bn)], mask=ns < spec.n, other=0) for b in b_refs] if spec.has_bias else None
    y = _epilogue(spec, accs, rs, biases, id_ok)
    plgpu.store(out_ref.at[p, pl.ds(n0, bn)], y.astype(out_ref.dtype), mask=ns < spec.n)


def _epilogue(spec: PairSpec, accs, rs, biases, ok):
    """The decode epilogue on the float32 accumulators ``accs`` (one per weight): input
    scale ``rs``, ``biases``, activation, output scale, zero where not ``ok``. Broadcasting
    shapes: a pair's column block in the kernel, every pair's row in `_finish`."""
    if spec.scale == "input":
        accs = [a * rs for a in accs]
    if spec.has_bias:
        accs = [a + b.astype(jnp.float32) for a, b in zip(accs, biases)]
    y = spec.act(*accs) if len(accs) == 2 else accs[0]
    if spec.scale == "output":
        y = y * rs
    return jnp.where(ok, y, 0.0)


def _pair_call(
    where, launch: DecodeLaunch, ids, lhs, weights, biases, row_scale, out, *, gather, scale, act, out_dtype
):
    """Checks ``launch``, its tile sizes and split count, and ``out``, then launches
    `_pair_kernel` (the other arguments already checked by the public wrappers): ``[P, N]``
    in ``out_dtype`` (with ``split_k > 1`` the kernel's ``[layouts, splits, P, N]`` partial
    sums finished by `_finish`; ``out`` is then not aliased: every row is written either way).

    ``weights``: ``(layout, arrays)`` per weight; ``scale``: where a given ``row_scale``
    applies."""
    if not isinstance(launch, DecodeLaunch):
        raise ValueError(f"{where}: launch must be a pallas_kernels.launch.DecodeLaunch, got {type(launch).__name__}")
    t, k = ids.shape
    layouts = tuple(lay for lay, _ in weights)
    common.check_blocks(where, block_n=launch.block_n, block_k=launch.block_k)
    odt = jnp.dtype(out_dtype)
    common.check_out(where, out, (t * k, layouts[0].n), odt)
    bk = fit_block_k(launch.block_k, layouts)
    splits = _splits(where, launch.split_k, t * k, layouts[0].n, launch.block_n, lhs.shape[1], bk)
    fields = epilogue_fields(lhs, layouts, gather, scale, row_scale, biases, act, odt, launch)
    spec = PairSpec(pairs=t * k, top_k=k, block_n=launch.block_n, block_k=bk, mma=launch.mma, split_k=splits, **fields)
    if spec.split_k > 1:
        out = None
    args, aliases = epilogue_operands(
        [ids.reshape(-1).astype(jnp.int32)], spec, row_scale, lhs, [arrs for _, arrs in weights], biases, out
    )
    kernel = functools.partial(_pair_kernel, spec=spec, aliased=out is not None)
    if spec.split_k > 1:
        shape = (len(spec.layouts), spec.split_k, spec.pairs, spec.n)
        out_shape = jax.ShapeDtypeStruct(shape, jnp.float32)
    else:
        out_shape = jax.ShapeDtypeStruct((spec.pairs, spec.n), jnp.dtype(spec.out_dtype))
    grid = (spec.pairs, pl.cdiv(spec.n, spec.block_n)) + ((spec.split_k,) if spec.split_k > 1 else ())
    res = call("moe_decode", kernel, out_shape, grid, args, launch, aliases)
    if spec.split_k == 1:
        return res
    return _finish(spec, res, ids, row_scale, biases)


def _finish(spec: PairSpec, parts, ids, row_scale, biases):
    """The split-K epilogue in XLA: ``parts [layouts, S, P, N]`` float32 summed over the
    splits in order, then the kernel's epilogue (input scale, bias, activation, output
    scale, zero rows for invalid ids) -> ``[P, N]`` in ``spec.out_dtype``."""
    acc = parts[:, 0]
    for s in range(1, spec.split_k):
        acc = acc + parts[:, s]
    ids = ids.reshape(-1)
    ok = (ids >= 0) & (ids < spec.layouts[0].num_experts)
    e = jnp.where(ok, ids, 0)
    rs = row_scale.astype(jnp.float32)[:, None] if spec.scale != "none" else None
    y = _epilogue(spec, list(acc), rs, [b[e] for b in biases] if spec.has_bias else None, ok[:, None])
    return y.astype(spec.out_dtype)


def check_ids(name: str, expert_ids, num_experts: int) -> None:
    """ValueError naming ``name`` when concrete ``expert_ids`` hold an id outside ``[0, num_experts)``
    (tracers are not checked: the kernel then writes a zero row for such a pair)."""
    if isinstance(expert_ids, Tracer) or not hasattr(expert_ids, "shape") or not expert_ids.size:
        return
    ids = np.asarray(expert_ids)
    if not np.issubdtype(ids.dtype, np.integer):
        return  # the wrappers' dtype check names it
    bad = (ids < 0) | (ids >= num_experts)
    if bad.any():
        raise ValueError(
            f"{name}: expert ids must lie in [0, {num_experts}); {int(bad.sum())} do not "
            f"(e.g. {int(ids[bad].reshape(-1)[0])})"
        )


def _splits(where: str, split_k: int | None, pairs: int, n: int, block_n: int, k: int, block_k: int) -> int:
    """The K split count: ``split_k`` checked (1 .. K steps), or `tuning.decode_splits`."""
    steps = -(-k // block_k)
    if split_k is None:
        return tuning.decode_splits(pairs * (-(-n // block_n)), steps)
    if not isinstance(split_k, int) or not 1 <= split_k <= steps:
        raise ValueError(
            f"{where}: split_k must be an int in [1, {steps}] (K = {k} in steps of {block_k}), got {split_k!r}"
        )
    return tuning.whole_splits(split_k, steps)


def decode_gate_up(x, expert_ids, w_gate, *args, **kwargs):
    """Per-pair gate/up with the activation fused (`decode_gate_up_jit` after an eager check
    that concrete ``expert_ids`` lie in ``[0, E)``; see it for the arguments)."""
    check_ids(
        "decode_gate_up: expert_ids", expert_ids, weight_operands(w_gate, "decode_gate_up: w_gate")[0].num_experts
    )
    return decode_gate_up_jit(x, expert_ids, w_gate, *args, **kwargs)


def decode_down(h, expert_ids, w_down, *args, **kwargs):
    """Per-pair down projection (`decode_down_jit` after an eager check that concrete
    ``expert_ids`` lie in ``[0, E)``; see it for the arguments)."""
    check_ids("decode_down: expert_ids", expert_ids, weight_operands(w_down, "decode_down: w_down")[0].num_experts)
    return decode_down_jit(h, expert_ids, w_down, *args, **kwargs)


@kernel_jit("act")
def decode_gate_up_jit(
    x,
    expert_ids,
    w_gate,
    w_up,
    b_gate=None,
    b_up=None,
    row_scale=None,
    out=None,
    *,
    act=Activation(),
    launch=DecodeLaunch(),
):
    """Per-pair gate/up with the activation fused.

    Args:
      x: ``[T, d]``; expert_ids: ``[T, k]`` int32.
      w_gate, w_up: ``[E, d, F]`` arrays or `quant.QuantWeight`s; b_gate, b_up: ``[E, F]`` or None.
      row_scale: ``[T * k]`` float32 (pair order) multiplying both projections before the
        bias, or None.
      out: optional ``[T * k, F]`` buffer of ``x.dtype`` aliased to the output.
      act: the `common.Activation` of the epilogue.
      launch: the `launch.DecodeLaunch` (``block_m`` unused). Its ``split_k`` is lowered so
        that no split is empty (`tuning.whole_splits`); > 1 adds the splits' float32 partial
        sums in XLA and applies the epilogue there (``out`` is then not aliased).
    Returns:
      ``h [T * k, F]`` in ``x.dtype``, pair order.
    """
    common.check_array("decode_gate_up: x", x, (None, None), kinds="float")
    common.check_array("decode_gate_up: expert_ids", expert_ids, (x.shape[0], None), kinds="int")
    weights = gate_up_operands("decode_gate_up", x.shape[1], w_gate, w_up, b_gate, b_up, launch.word_loads)
    check_row_scale("decode_gate_up", row_scale, expert_ids.size)
    biases = None if b_gate is None else [b_gate, b_up]
    epilogue = dict(gather=True, scale="input", act=act, out_dtype=x.dtype)
    return _pair_call("decode_gate_up", launch, expert_ids, x, weights, biases, row_scale, out, **epilogue)


@kernel_jit("out_dtype")
def decode_down_jit(
    h, expert_ids, w_down, b_down=None, row_scale=None, out=None, *, launch=DecodeLaunch(), out_dtype=jnp.float32
):
    """Per-pair down projection with bias and routing weight fused.

    Args:
      h: ``[T * k, F]`` pair order; expert_ids: ``[T, k]`` int32.
      w_down: ``[E, F, d]`` array or `quant.QuantWeight`; b_down: ``[E, d]`` or None.
      row_scale: ``[T * k]`` float32 routing weights (pair order) or None.
      out: optional ``[T * k, d]`` buffer of ``out_dtype`` aliased to the output.
      launch: as in `decode_gate_up_jit`.
    Returns:
      ``[T * k, d]`` in ``out_dtype``, pair order.
    """
    common.check_array("decode_down: h", h, (None, None), kinds="float")
    common.check_array("decode_down: expert_ids", expert_ids, (None, None), kinds="int")
    t, k = expert_ids.shape
    if h.shape[0] != t * k:
        raise ValueError(
            f"decode_down: h has {h.shape[0]} rows, expected T*k = {t * k} (expert_ids {expert_ids.shape})"
        )
    weight = down_operands("decode_down", h.shape[1], w_down, b_down, launch.word_loads)
    check_row_scale("decode_down", row_scale, t * k)
    biases = None if b_down is None else [b_down]
    epilogue = dict(gather=False, scale="output", act=None, out_dtype=out_dtype)
    return _pair_call("decode_down", launch, expert_ids, h, [weight], biases, row_scale, out, **epilogue)


def combine_pairs(y: jax.Array, top_k: int) -> jax.Array:
    """``[T * k, d]`` pair-order rows -> ``[T, d]`` float32, slots summed in order."""
    if y.ndim != 2 or y.shape[0] % top_k:
        raise ValueError(f"combine_pairs: y {y.shape} must be [T * k, d] with k = {top_k}")
    return common.slot_sum(y.astype(jnp.float32).reshape(-1, top_k, y.shape[1]))


def decode_gate_up_reference(x, expert_ids, w_gate, w_up, b_gate=None, b_up=None, row_scale=None, act=Activation()):
    """Pure-jnp reference of `decode_gate_up`."""
    lg, ag = weight_operands(w_gate, "decode_gate_up_reference: w_gate", k=x.shape[1])
    lu, au = weight_operands(w_up, "decode_gate_up_reference: w_up", lg.num_experts, x.shape[1], lg.n)
    xs = jnp.repeat(x, expert_ids.shape[1], axis=0)  # [P, d]
    weights = ((lg, ag), (lu, au))
    return gate_up_rows_reference(xs, expert_ids.reshape(-1), weights, b_gate, b_up, row_scale, act, x.dtype)


def decode_down_reference(h, expert_ids, w_down, b_down=None, row_scale=None, out_dtype=jnp.float32):
    """Pure-jnp reference of `decode_down`."""
    weight = weight_operands(w_down, "decode_down_reference: w_down", k=h.shape[1])
    return down_rows_reference(h, expert_ids.reshape(-1), weight, b_down, row_scale, out_dtype)

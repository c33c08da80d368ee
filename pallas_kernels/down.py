"""Down projection with the routing weight in the epilogue, and the combine to tokens.

``y[r] = w[r] * (h[r] @ Wd[e] (+ bd[e]))`` for each sorted row ``r`` of expert ``e``,
written in float32 to its sorted row (each row by exactly one program, no atomics).
`combine` then sums each token's ``k`` slot rows, found through the plan's inverse
permutation, in slot order: the result is the same bit for bit on every run.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import common
from pallas_kernels.gmm import GroupedSpec, check_plan, fit_block_k, grouped_call, row_experts
from pallas_kernels.quant import dequantize_reference, weight_operands

_HI = jax.lax.Precision.HIGHEST


def _check(where, h, w_down, b_down, row_scale, word_loads=False):
    common.check_array(f"{where}: h", h, (None, None), kinds="float")
    lay, arrs = weight_operands(w_down, f"{where}: w_down", k=h.shape[1], word_loads=word_loads)
    if b_down is not None:
        common.check_array(f"{where}: b_down", b_down, (lay.num_experts, lay.n))
    if row_scale is not None:
        common.check_array(f"{where}: row_scale", row_scale, (h.shape[0],), kinds="float")
    return lay, arrs


@functools.partial(
    jax.jit,
    static_argnames=(
        "block_m",
        "block_n",
        "block_k",
        "num_warps",
        "num_stages",
        "out_dtype",
        "word_loads",
        "tf32",
        "interpret",
        "debug",
    ),
)
def down_project(
    h,
    group_offsets,
    tile_group,
    tile_row,
    num_tiles,
    w_down,
    b_down=None,
    row_scale=None,
    out=None,
    *,
    block_m: int,
    block_n: int = 64,
    block_k: int = 64,
    num_warps: int = 4,
    num_stages: int = 3,
    out_dtype=jnp.float32,
    word_loads: bool | None = None,
    tf32: bool = False,
    interpret: bool = False,
    debug: bool = False,
):
    """Down GMM over sorted rows with bias and per-row scale fused.

    Args:
      h: ``[P, F]`` sorted rows (the output of `gate_up_swiglu`).
      group_offsets, tile_group, tile_row, num_tiles: the plan (built with ``block_m``).
      w_down: ``[E, F, d]`` array or `quant.QuantWeight`; b_down: ``[E, d]`` or None.
      row_scale: ``[P]`` float32 routing weight of each sorted row, or None.
      out: optional ``[P, d]`` buffer of ``out_dtype`` aliased to the output.
      word_loads: quantized codes loaded as int32 words (`quant.as_words`); None: only
        for a code array of >= 2^31 elements, which 32-bit offsets cannot address.
      tf32: float32 inputs multiplied as one TensorFloat-32 dot on the tensor cores (faster,
        10-bit mantissas); default False: 3xTF32, float32-accurate (`quant.tile_matmul`).
        16-bit inputs are unaffected.
    Returns:
      ``[P, d]`` in ``out_dtype`` (sorted rows).
    """
    lay, arrs = _check("down_project", h, w_down, b_down, row_scale, word_loads)
    p = h.shape[0]
    check_plan("down_project", lay.num_experts, tile_group, tile_row, group_offsets, num_tiles)
    common.check_blocks("down_project", block_m=block_m, block_n=block_n, block_k=block_k)
    odt = jnp.dtype(out_dtype)
    common.check_out("down_project", out, (p, lay.n), odt)
    spec = GroupedSpec(
        rows=p,
        k=h.shape[1],
        n=lay.n,
        block_m=block_m,
        block_n=block_n,
        block_k=fit_block_k(block_k, [lay]),
        layouts=(lay,),
        gather=False,
        scale="output" if row_scale is not None else "none",
        has_bias=b_down is not None,
        act=None,
        compute_dtype=h.dtype.name,
        out_dtype=odt.name,
        num_warps=num_warps,
        num_stages=num_stages,
        tf32=tf32,
    )
    return grouped_call(
        spec,
        tile_group,
        tile_row,
        group_offsets,
        num_tiles,
        None,
        row_scale,
        h,
        [arrs],
        None if b_down is None else [b_down],
        out,
        interpret=interpret,
        debug=debug,
    )


def combine(y_sorted: jax.Array, inv: jax.Array, top_k: int) -> jax.Array:
    """``[T, d]`` float32: each token's ``k`` slot rows of ``y_sorted [P, d]`` summed in
    slot order (``inv [P]``: sorted row of pair ``t * k + slot``)."""
    common.check_array("combine: y_sorted", y_sorted, (None, None), kinds="float")
    common.check_array("combine: inv", inv, (y_sorted.shape[0],), kinds="int")
    if y_sorted.shape[0] % top_k:
        raise ValueError(f"combine: {y_sorted.shape[0]} rows are not a multiple of top_k={top_k}")
    y = y_sorted.astype(jnp.float32)[inv]
    return common.slot_sum(y.reshape(-1, top_k, y_sorted.shape[1]))


def down_project_reference(h, group_offsets, w_down, b_down=None, row_scale=None, out_dtype=jnp.float32):
    """Pure-jnp reference of `down_project` (materializes ``[P, F, d]``)."""
    lay, arrs = _check("down_project_reference", h, w_down, b_down, row_scale)
    ex = row_experts(group_offsets, h.shape[0])
    y = jnp.einsum(
        "pf,pfd->pd", h, dequantize_reference(lay, arrs, h.dtype)[ex], preferred_element_type=jnp.float32, precision=_HI
    )
    if b_down is not None:
        y = y + b_down.astype(jnp.float32)[ex]
    if row_scale is not None:
        y = y * row_scale[:, None]
    return y.astype(out_dtype)

"""Down projection with the routing weight in the epilogue, and the combine to tokens.

``y[r] = w[r] * (h[r] @ Wd[e] (+ bd[e]))`` for each sorted row ``r`` of expert ``e``,
written in float32 to its sorted row (each row by exactly one program, no atomics).
`combine` then sums each token's ``k`` slot rows, found through the plan's inverse
permutation, in slot order: the result is the same bit for bit on every run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import common
from pallas_kernels.gmm import grouped_call, row_experts
from pallas_kernels.launch import Launch, Plan, check_row_scale, down_operands, kernel_jit
from pallas_kernels.quant import dequantize_reference

_HI = jax.lax.Precision.HIGHEST


def _check(where, h, w_down, b_down, row_scale, word_loads=False):
    common.check_array(f"{where}: h", h, (None, None), kinds="float")
    weight = down_operands(where, h.shape[1], w_down, b_down, word_loads)
    check_row_scale(where, row_scale, h.shape[0])
    return weight


@kernel_jit("out_dtype")
def down_project(
    h, plan: Plan, w_down, b_down=None, row_scale=None, out=None, *, launch: Launch, out_dtype=jnp.float32
):
    """Down GMM over sorted rows with bias and per-row scale fused.

    Args:
      h: ``[P, F]`` sorted rows (the output of `gate_up_swiglu`).
      plan: the `launch.Plan`, built with ``launch.block_m``.
      w_down: ``[E, F, d]`` array or `quant.QuantWeight`; b_down: ``[E, d]`` or None.
      row_scale: ``[P]`` float32 routing weight of each sorted row, or None.
      out: optional ``[P, d]`` buffer of ``out_dtype`` aliased to the output.
      launch: the `launch.Launch` (``block_m`` required).
    Returns:
      ``[P, d]`` in ``out_dtype`` (sorted rows).
    """
    weight = _check("down_project", h, w_down, b_down, row_scale, launch.word_loads)
    biases = None if b_down is None else [b_down]
    return grouped_call(
        "down_project", plan, launch, h, [weight], out, out_dtype, row_scale=row_scale, scale="output", biases=biases
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
    weight = _check("down_project_reference", h, w_down, b_down, row_scale)
    return down_rows_reference(h, row_experts(group_offsets, h.shape[0]), weight, b_down, row_scale, out_dtype)


def down_rows_reference(h, ex, weight, b_down, row_scale, out_dtype):
    """``row_scale * (h @ Wd[ex] (+ bd[ex]))`` row by row (``h [P, F]``, ``ex [P]`` expert
    of each row; ``weight``: ``(layout, arrays)``) -> ``[P, d]`` in ``out_dtype``."""
    lay, arrs = weight
    y = jnp.einsum(
        "pf,pfd->pd", h, dequantize_reference(lay, arrs, h.dtype)[ex], preferred_element_type=jnp.float32, precision=_HI
    )
    if b_down is not None:
        y = y + b_down.astype(jnp.float32)[ex]
    if row_scale is not None:
        y = y * row_scale[:, None]
    return y.astype(out_dtype)

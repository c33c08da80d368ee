"""Fused gate + up projection with the SwiGLU epilogue, over a dispatch plan.

``h[r] = act(x[token_idx[r]] @ Wg[e] (+ bg[e]), x[token_idx[r]] @ Wu[e] (+ bu[e]))`` for
each sorted row ``r`` of expert ``e``. The prologue gathers the x rows by ``token_idx``
inside the kernel, so the permuted copy of ``x`` is never written to memory; both
projections share each loaded x tile. ``act`` is SwiGLU or gpt-oss's clamped form;
``row_scale`` (Llama 4: the routing weight on the expert input) multiplies both
projections before the biases.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels import common
from pallas_kernels.common import Activation
from pallas_kernels.gmm import grouped_call, row_experts
from pallas_kernels.launch import check_row_scale, gate_up_operands, kernel_jit
from pallas_kernels.quant import dequantize_reference

_HI = jax.lax.Precision.HIGHEST


def _check(where, x, token_idx, w_gate, w_up, b_gate, b_up, row_scale, word_loads=False):
    common.check_array(f"{where}: x", x, (None, None), kinds="float")
    common.check_array(f"{where}: token_idx", token_idx, (None,), kinds="int")
    weights = gate_up_operands(where, x.shape[1], w_gate, w_up, b_gate, b_up, word_loads)
    check_row_scale(where, row_scale, token_idx.shape[0])
    return weights


@kernel_jit("act")
def gate_up_swiglu(
    x, token_idx, plan, w_gate, w_up, b_gate=None, b_up=None, row_scale=None, out=None, *, act=Activation(), launch
):
    """Gate/up GMM with the activation fused, rows gathered from ``x`` by ``token_idx``.

    Args:
      x: ``[T, d]`` tokens (float32 / bfloat16 / float16; the compute dtype).
      token_idx: ``[P]`` int32 token of each sorted row (``plan.token_idx``).
      plan: the `launch.Plan`, built with ``launch.block_m``.
      w_gate, w_up: ``[E, d, F]`` arrays or `quant.QuantWeight`s.
      b_gate, b_up: ``[E, F]`` or None.
      row_scale: ``[P]`` float32 or None: multiplies both projections before the bias.
      out: optional ``[P, F]`` buffer of ``x.dtype`` aliased to the output.
      act: the `common.Activation` of the epilogue.
      launch: the `launch.Launch` (``block_m`` required).
    Returns:
      ``h [P, F]`` in ``x.dtype`` (sorted rows), float32 accumulation and epilogue.
    """
    weights = _check("gate_up_swiglu", x, token_idx, w_gate, w_up, b_gate, b_up, row_scale, launch.word_loads)
    biases = None if b_gate is None else [b_gate, b_up]
    rows: dict[str, Any] = dict(row_map=token_idx, row_scale=row_scale, scale="input")
    return grouped_call("gate_up_swiglu", plan, launch, x, weights, out, x.dtype, **rows, biases=biases, act=act)


def gate_up_swiglu_reference(
    x, token_idx, group_offsets, w_gate, w_up, b_gate=None, b_up=None, row_scale=None, act=Activation()
):
    """Pure-jnp reference of `gate_up_swiglu` (materializes ``[P, d]`` and ``[P, d, F]``)."""
    weights = _check("gate_up_swiglu_reference", x, token_idx, w_gate, w_up, b_gate, b_up, row_scale)
    ex = row_experts(group_offsets, token_idx.shape[0])
    return gate_up_rows_reference(x[token_idx], ex, weights, b_gate, b_up, row_scale, act, x.dtype)


def gate_up_rows_reference(xs, ex, weights, b_gate, b_up, row_scale, act: Activation, dtype):
    """``act(xs @ Wg[ex] (+ bg[ex]), xs @ Wu[ex] (+ bu[ex]))`` row by row, the projections
    scaled by ``row_scale`` before the biases (``xs [P, d]``, ``ex [P]`` expert of each row;
    ``weights``: the gate's and the up's ``(layout, arrays)``) -> ``[P, F]`` in ``dtype``."""
    g, u = (
        jnp.einsum(
            "pd,pdf->pf",
            xs,
            dequantize_reference(lay, arrs, xs.dtype)[ex],
            preferred_element_type=jnp.float32,
            precision=_HI,
        )
        for lay, arrs in weights
    )
    if row_scale is not None:
        g = g * row_scale[:, None]
        u = u * row_scale[:, None]
    if b_gate is not None:
        g = g + b_gate.astype(jnp.float32)[ex]
        u = u + b_up.astype(jnp.float32)[ex]
    return act(g, u).astype(dtype)

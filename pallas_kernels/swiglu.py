"""Fused gate + up projection with the SwiGLU epilogue, over a dispatch plan.

``h[r] = act(x[token_idx[r]] @ Wg[e] (+ bg[e]), x[token_idx[r]] @ Wu[e] (+ bu[e]))`` for
each sorted row ``r`` of expert ``e``. The prologue gathers the x rows by ``token_idx``
inside the kernel, so the permuted copy of ``x`` is never written to memory; both
projections share each loaded x tile. ``act`` is SwiGLU or gpt-oss's clamped form;
``row_scale`` (Llama 4: the routing weight on the expert input) multiplies both
projections before the biases.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import common
from pallas_kernels.common import Activation
from pallas_kernels.gmm import GroupedSpec, check_plan, fit_block_k, grouped_call, row_experts
from pallas_kernels.quant import dequantize_reference, weight_operands

_HI = jax.lax.Precision.HIGHEST


def _check(where, x, token_idx, w_gate, w_up, b_gate, b_up, row_scale, word_loads=False):
    common.check_array(f"{where}: x", x, (None, None), kinds="float")
    common.check_array(f"{where}: token_idx", token_idx, (None,), kinds="int")
    d = x.shape[1]
    lg, ag = weight_operands(w_gate, f"{where}: w_gate", k=d, word_loads=word_loads)
    lu, au = weight_operands(w_up, f"{where}: w_up", lg.num_experts, d, lg.n, word_loads=word_loads)
    if (b_gate is None) != (b_up is None):
        raise ValueError(f"{where}: give both b_gate and b_up or neither")
    if b_gate is not None:
        common.check_array(f"{where}: b_gate", b_gate, (lg.num_experts, lg.n))
        common.check_array(f"{where}: b_up", b_up, (lg.num_experts, lg.n))
    if row_scale is not None:
        common.check_array(f"{where}: row_scale", row_scale, (token_idx.shape[0],), kinds="float")
    return (lg, ag), (lu, au)


@functools.partial(
    jax.jit,
    static_argnames=(
        "activation",
        "alpha",
        "limit",
        "block_m",
        "block_n",
        "block_k",
        "num_warps",
        "num_stages",
        "word_loads",
        "tf32",
        "interpret",
        "debug",
    ),
)
def gate_up_swiglu(
    x,
    token_idx,
    group_offsets,
    tile_group,
    tile_row,
    num_tiles,
    w_gate,
    w_up,
    b_gate=None,
    b_up=None,
    row_scale=None,
    out=None,
    *,
    activation: str = "swiglu",
    alpha: float = 1.702,
    limit: float = 7.0,
    block_m: int,
    block_n: int = 64,
    block_k: int = 64,
    num_warps: int = 4,
    num_stages: int = 3,
    word_loads: bool | None = None,
    tf32: bool = False,
    interpret: bool = False,
    debug: bool = False,
):
    """Gate/up GMM with the activation fused, rows gathered from ``x`` by ``token_idx``.

    Args:
      x: ``[T, d]`` tokens (float32 / bfloat16 / float16; the compute dtype).
      token_idx: ``[P]`` int32 token of each sorted row (``plan.token_idx``).
      group_offsets, tile_group, tile_row, num_tiles: the plan (built with ``block_m``).
      w_gate, w_up: ``[E, d, F]`` arrays or `quant.QuantWeight`s.
      b_gate, b_up: ``[E, F]`` or None.
      row_scale: ``[P]`` float32 or None: multiplies both projections before the bias.
      out: optional ``[P, F]`` buffer of ``x.dtype`` aliased to the output.
      word_loads: quantized codes loaded as int32 words (`quant.as_words`); None: only
        for a code array of >= 2^31 elements, which 32-bit offsets cannot address.
      tf32: float32 inputs multiplied as one TensorFloat-32 dot on the tensor cores (faster,
        10-bit mantissas); default False: 3xTF32, float32-accurate (`quant.tile_matmul`).
        16-bit inputs are unaffected.
    Returns:
      ``h [P, F]`` in ``x.dtype`` (sorted rows), float32 accumulation and epilogue.
    """
    (lg, ag), (lu, au) = _check("gate_up_swiglu", x, token_idx, w_gate, w_up, b_gate, b_up, row_scale, word_loads)
    p = token_idx.shape[0]
    check_plan("gate_up_swiglu", lg.num_experts, tile_group, tile_row, group_offsets, num_tiles)
    common.check_blocks("gate_up_swiglu", block_m=block_m, block_n=block_n, block_k=block_k)
    common.check_out("gate_up_swiglu", out, (p, lg.n), x.dtype)
    spec = GroupedSpec(
        rows=p,
        k=x.shape[1],
        n=lg.n,
        block_m=block_m,
        block_n=block_n,
        block_k=fit_block_k(block_k, [lg, lu]),
        layouts=(lg, lu),
        gather=True,
        scale="input" if row_scale is not None else "none",
        has_bias=b_gate is not None,
        act=Activation(activation, alpha, limit),
        compute_dtype=x.dtype.name,
        out_dtype=x.dtype.name,
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
        token_idx,
        row_scale,
        x,
        [ag, au],
        None if b_gate is None else [b_gate, b_up],
        out,
        interpret=interpret,
        debug=debug,
    )


def gate_up_swiglu_reference(
    x,
    token_idx,
    group_offsets,
    w_gate,
    w_up,
    b_gate=None,
    b_up=None,
    row_scale=None,
    *,
    activation: str = "swiglu",
    alpha: float = 1.702,
    limit: float = 7.0,
):
    """Pure-jnp reference of `gate_up_swiglu` (materializes ``[P, d]`` and ``[P, d, F]``)."""
    (lg, ag), (lu, au) = _check("gate_up_swiglu_reference", x, token_idx, w_gate, w_up, b_gate, b_up, row_scale)
    ex = row_experts(group_offsets, token_idx.shape[0])
    xs = x[token_idx]
    g = jnp.einsum(
        "pd,pdf->pf", xs, dequantize_reference(lg, ag, x.dtype)[ex], preferred_element_type=jnp.float32, precision=_HI
    )
    u = jnp.einsum(
        "pd,pdf->pf", xs, dequantize_reference(lu, au, x.dtype)[ex], preferred_element_type=jnp.float32, precision=_HI
    )
    if row_scale is not None:
        g = g * row_scale[:, None]
        u = u * row_scale[:, None]
    if b_gate is not None:
        g = g + b_gate.astype(jnp.float32)[ex]
        u = u + b_up.astype(jnp.float32)[ex]
    return Activation(activation, alpha, limit)(g, u).astype(x.dtype)

"""Backward math shared by the strategies with a custom reverse mode.

`rows_vjp` is the reverse of one expert's SwiGLU over a block of its rows, written out
as matmuls against the transposed weights (input gradient) and per-expert ``x^T dy``
products (weight gradient), as megablox / tokamax do: the forward's ``g, u`` are
recomputed from the saved inputs, so nothing ``[rows, F]`` is saved between the passes.
The activation's derivative (``silu(g) * u`` or gpt-oss's clamped form) is the VJP of
the same `jaxmoe.experts.activation` the forward runs, so the clamp's subgradient is the
one JAX's autodiff of the forward gives.

Routing-weight gradient of a pair whose weight scales the output (``y_t = sum_j w_tj
E_j(x_t)``): ``<g_t, E_j(x_t)> = <h, g_t W_down^T> + <g_t, b_down>`` with ``h`` the
activation, so it costs no extra matmul: ``g_t W_down^T`` is the down projection's
input gradient before the weight is applied.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxmoe.config import MoEConfig
from jaxmoe.experts import activation, mm


class RowsGrad(NamedTuple):
    """`rows_vjp`'s result for ``m`` rows of one expert (all float32).

    Attributes:
      dx: ``[m, d]`` gradient w.r.t. the expert's input rows (zero on masked rows).
      dw: ``[m]`` the pair's routing-weight gradient ``<g_t, E(x)>`` (None when the
        rows were given no weights: ``weight_on_input``, where the caller forms it from
        ``dx``).
      weights: ``(dW_gate [d, F], dW_up [d, F], dW_down [F, d], db_gate [F], db_up [F],
        db_down [d])`` summed over the rows, or None when not asked for.
    """

    dx: jax.Array
    dw: jax.Array | None
    weights: tuple[jax.Array, ...] | None


def rows_vjp(
    xb: jax.Array,
    gt: jax.Array,
    wr: jax.Array | None,
    valid: jax.Array,
    w: tuple[jax.Array, jax.Array, jax.Array],
    bias: tuple[jax.Array, jax.Array, jax.Array] | None,
    cfg: MoEConfig,
    *,
    weight_grads: bool = True,
    platform: str | None = None,
) -> RowsGrad:
    """Reverse of ``y = wr * (act(x Wg + bg, x Wu + bu) Wd + bd)`` over rows of one expert.

    Args:
      xb: ``[m, d]`` the expert's input rows (compute dtype; weighted already under
        ``weight_on_input``).
      gt: ``[m, d]`` float32 cotangent of each row's token output.
      wr: ``[m]`` float32 routing weight scaling each row's output, or None (no scaling).
      valid: ``[m]`` bool, the rows that belong to this expert; the others contribute
        exactly zero (masked before any product, so a NaN or inf in a row of another
        expert or a padding row never reaches this expert's weight gradient).
      w: ``(w_gate [d, F], w_up [d, F], w_down [F, d])`` float, the compute dtype.
      bias: ``(b_gate [F], b_up [F], b_down [d])`` float32, or None.
      cfg: the layer config (activation).
      weight_grads: also form the weight gradients (False for frozen experts).
      platform: the lowering platform group (`jaxmoe.experts.dot_f32`).
    """
    dt = xb.dtype
    f32 = jnp.float32
    v = valid[:, None]
    xb = jnp.where(v, xb, jnp.zeros((), dt))
    gt = jnp.where(v, gt.astype(f32), 0.0)
    wg, wu, wd = w
    g = mm("md,df->mf", xb, wg, platform)  # recomputed: [m, F]
    u = mm("md,df->mf", xb, wu, platform)
    if bias is not None:
        g, u = g + bias[0], u + bias[1]
    h, act_vjp = jax.vjp(lambda g, u: activation(g, u, cfg).astype(dt), g, u)  # h [m, F]
    dh = mm("md,fd->mf", gt, wd, platform)  # g_t W_down^T [m, F]
    dw = None
    gy = gt
    if wr is not None:
        wr = jnp.where(valid, wr.astype(f32), 0.0)
        dw = jnp.sum(h.astype(f32) * dh, axis=-1)
        if bias is not None:
            dw = dw + jnp.sum(gt * bias[2], axis=-1)
        dh = dh * wr[:, None]
        gy = gt * wr[:, None]
    dg, du = act_vjp(dh.astype(dt))  # float32 [m, F]
    dx = mm("mf,df->md", dg, wg, platform) + mm("mf,df->md", du, wu, platform)
    if not weight_grads:
        return RowsGrad(dx, dw, None)
    dwg = mm("md,mf->df", xb, dg, platform)
    dwu = mm("md,mf->df", xb, du, platform)
    dwd = mm("mf,md->fd", h, gy, platform)
    return RowsGrad(dx, dw, (dwg, dwu, dwd, dg.sum(0), du.sum(0), gy.sum(0)))


__all__ = ["RowsGrad", "rows_vjp"]

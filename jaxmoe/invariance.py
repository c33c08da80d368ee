"""Batch invariance: a token's output depends only on that token and the weights.

Serving batches whatever requests arrive, and a user expects a token's output not to
change with its neighbours, the batch size or its position in the batch. Plain XLA
breaks that: a library dot picks its algorithm by the number of rows (XLA:CPU's YNNPACK
dots give one rounding for 1 or >= 64 rows and another for 2..63), a row reduction is
vectorized differently for large batches, and a strategy's tile size follows ``T``.
The rules here make every arithmetic step that produces a token's row independent of
``T`` by construction:

- **Dots over tokens run on fixed-shape row blocks** (`row_blocks`): the token rows are
  padded to a multiple of `ROW_BLOCK` and one program of shape ``[ROW_BLOCK, ...]``
  computes every block, whatever ``T`` is, so the same executable (same algorithm, same
  reduction order per output element) produces every row.
- **Row reductions in a fixed order** (`fixed_sum`, `fixed_softmax`): a pairwise tree of
  elementwise adds over slices, which no compiler may reassociate.
- **Strategies with fixed tiles**: the routed-expert strategies take a ``T``-independent
  tile size and no ``T``-dependent algorithm switch when invariance is on (each
  strategy's module says how); the C++ kernel (``impl="cpu"``) accumulates every output
  element in one sequential order whatever its row count, so it is invariant always.

``ExecConfig(batch_invariant=True)`` (`jaxmoe.execution`) turns it on for every strategy,
on one device and under expert parallelism; off (the default), nothing beyond the
routing's fixed-order sums (they cost nothing and are always on). Its cost per strategy
is measured by ``benchmarks/bench_invariance.py`` (docs/performance.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.common import slot_sum as ordered_slot_sum

#: Rows per block of a token-dimension dot in invariant mode.
ROW_BLOCK = 8


def row_blocks(fn: Callable[..., Any], rows: Any, *args, block: int = ROW_BLOCK) -> Any:
    """``fn`` over fixed-shape row blocks: ``rows`` (an array or pytree of arrays, all
    ``[T, ...]``) -> ``fn``'s output pytree, every leaf ``[T, ...]``.

    ``fn(rows_b, *args)`` takes the blocks ``[block, ...]`` and returns leaves
    ``[block, ...]``; it runs on every block of the zero-padded rows inside one loop, so
    each output row is computed by the same program whatever ``T`` is. ``args`` (the
    weights) are passed unchanged.
    """
    leaves = jax.tree.leaves(rows)
    t = leaves[0].shape[0]
    if any(v.shape[0] != t for v in leaves):
        raise ValueError(f"row_blocks: every row array needs the same leading size, got {[v.shape for v in leaves]}")
    if t == 0:
        spec = jax.tree.map(lambda v: jax.ShapeDtypeStruct((block, *v.shape[1:]), v.dtype), rows)
        out = jax.eval_shape(lambda r: fn(r, *args), spec)
        return jax.tree.map(lambda o: jnp.zeros((0, *o.shape[1:]), o.dtype), out)
    if not any(jnp.issubdtype(v.dtype, jnp.floating) for v in leaves):
        raise ValueError("row_blocks: the rows need at least one floating-point array")
    return _blocked(fn, block, rows, args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _blocked(fn: Callable[..., Any], block: int, rows: Any, args: tuple) -> Any:
    t = jax.tree.leaves(rows)[0].shape[0]
    nb = -(-t // block)
    floats = [v for v in jax.tree.leaves(rows) if jnp.issubdtype(v.dtype, jnp.floating)]
    padded = jax.tree.map(lambda v: jnp.pad(v, ((0, nb * block - t),) + ((0, 0),) * (v.ndim - 1)), rows)
    spec = jax.tree.map(lambda v: jax.ShapeDtypeStruct((block, *v.shape[1:]), v.dtype), rows)
    out = jax.eval_shape(lambda r: fn(r, *args), spec)

    def body(b, ys):
        r0 = jnp.minimum(b, nb - 1) * block
        rb = jax.tree.map(lambda v: jax.lax.dynamic_slice_in_dim(v, r0, block), padded)
        yb = fn(rb, *args)
        return jax.tree.map(lambda y, o: jax.lax.dynamic_update_slice_in_dim(y, o, r0, axis=0), ys, yb)

    ys = jax.tree.map(lambda o: jnp.zeros((nb * block, *o.shape[1:]), o.dtype), out)
    # A trip count XLA cannot see (nb, plus one for a NaN in the first element, which only
    # redoes the last block): a loop it knows runs once would be inlined and fused with its
    # neighbours, so T <= block would get other code (another vectorization, other fused
    # multiply-adds) than larger T.
    first = jnp.ravel(floats[0])[0]
    n = jnp.int32(nb) + (first != first).astype(jnp.int32)
    ys = jax.lax.fori_loop(0, n, body, ys)
    return jax.tree.map(lambda y: y[:t], ys)


def _blocked_fwd(fn, block, rows, args):
    return _blocked(fn, block, rows, args), (rows, args)


def _blocked_bwd(fn, block, res, g):
    # the loop's trip count is not static, so no reverse mode of its own: the VJP of the
    # same function on all rows at once (equal up to float rounding)
    rows, args = res
    return jax.vjp(lambda r, a: fn(r, *a), rows, args)[1](g)


_blocked.defvjp(_blocked_fwd, _blocked_bwd)


def fixed_sum(v: jax.Array, axis: int = -1, keepdims: bool = False) -> jax.Array:
    """Sum over ``axis`` as a pairwise tree of elementwise adds (a fixed order per element).

    For small reduced sizes (expert counts, top-k): ``ceil(log2(n))`` adds of slices.
    """
    v = jnp.moveaxis(v, axis, -1)
    n = v.shape[-1]
    if n == 0:
        s = jnp.zeros(v.shape[:-1], v.dtype)
    else:
        while n > 1:
            h = n // 2
            s2 = v[..., :h] + v[..., h : 2 * h]
            v = jnp.concatenate([s2, v[..., 2 * h :]], axis=-1) if n % 2 else s2
            n = v.shape[-1]
        s = v[..., 0]
    if keepdims:
        s = jnp.expand_dims(s, axis if axis >= 0 else s.ndim + 1 + axis)
    return s


def slot_sum(y: jax.Array, scale: jax.Array | None, valid: jax.Array, *, invariant: bool) -> jax.Array:
    """``y [T, k, n]`` -> ``[T, n]`` float32: ``sum_j valid[t, j] ? scale[t, j] * y[t, j] : 0``
    with the slots added in order (``scale`` None: no scaling).

    ``invariant``: the products are formed inside `row_blocks`' loop, apart from the
    sums, so no compiler fuses a product and a sum into a multiply-add for some ``T``
    and not for others.
    """

    def products(r):
        yb, sb, vb = r
        p = yb if sb is None else yb * sb[..., None]
        return jnp.where(vb[..., None], p, 0.0)

    if invariant:
        return ordered_slot_sum(row_blocks(products, (y, scale, valid)))
    return ordered_slot_sum(products((y, scale, valid)))


def fixed_softmax(z: jax.Array, axis: int = -1) -> jax.Array:
    """``softmax(z)`` along ``axis`` with the normalizer summed by `fixed_sum`.

    Same conventions as `jax.nn.softmax` (max subtracted first; a row of ``-inf`` gives NaN).
    """
    m = jax.lax.stop_gradient(jnp.max(z, axis=axis, keepdims=True))
    e = jnp.exp(z - m)
    return e / fixed_sum(e, axis=axis, keepdims=True)


__all__ = [
    "ROW_BLOCK",
    "fixed_softmax",
    "fixed_sum",
    "row_blocks",
    "slot_sum",
]

"""Pieces every kernel shares: Triton compiler params, argument checks, the ordered slot
sum (and the SwiGLU epilogue of `pallas_kernels.activation`, re-exported)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.activation import ACTIVATIONS, Activation


def compiler_params(num_warps: int, num_stages: int) -> plgpu.CompilerParams:
    """Triton compiler params: passing them is what selects the Triton backend
    (without them JAX >= 0.9 lowers a GPU `pallas_call` with Mosaic GPU)."""
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


#: Row tiles per group in the grouped kernels' launch order (Triton's ``GROUP_M``).
GROUP_M = 8


def grouped_order(num_rows: int, num_cols: int, group: int = GROUP_M) -> tuple[jax.Array, jax.Array]:
    """``(row tile, column block)`` of this program of a 1-D grid of ``num_rows * num_cols``
    programs, in GROUP_M order: programs run in launch order, and consecutive ones take
    ``group`` row tiles across every column block before the next row tiles, so the
    activation tiles of a group and the expert's column blocks they read stay in L2 while
    in use. With the 2-D grid ``(row tiles, column blocks)`` each row tile was re-read from
    HBM for every column block once the activations outgrow L2 (about 30 GB of reads at
    Mixtral's width, T = 16384). A bijection onto ``[0, num_rows) x [0, num_cols)``; the
    last group may hold fewer row tiles."""
    pid = pl.program_id(0)
    width = group * num_cols
    first = (pid // width) * group
    size = jnp.minimum(num_rows - first, group)
    local = pid % width
    return first + local % size, local // size


def check_array(name: str, a, shape: tuple, dtype=None, kinds: str | None = None) -> None:
    """ValueError naming ``name`` unless ``a`` has ``shape`` (None entries free) and dtype."""
    if a is None:
        raise ValueError(f"{name}: missing; expected shape {shape}")
    got = tuple(a.shape)
    if len(got) != len(shape) or any(w is not None and g != w for g, w in zip(got, shape)):
        raise ValueError(f"{name}: shape {got}, expected {shape}")
    if dtype is not None and a.dtype != jnp.dtype(dtype):
        raise ValueError(f"{name}: dtype {a.dtype}, expected {jnp.dtype(dtype)}")
    if kinds == "int" and not jnp.issubdtype(a.dtype, jnp.integer):
        raise ValueError(f"{name}: must be an integer array, got {a.dtype}")
    if kinds == "float" and not jnp.issubdtype(a.dtype, jnp.floating):
        raise ValueError(f"{name}: must be a floating-point array, got {a.dtype}")


def check_blocks(where: str, **blocks: int | None) -> None:
    for k, v in blocks.items():
        if not isinstance(v, int) or v < 16 or v & (v - 1):
            raise ValueError(f"{where}: {k} must be a power of two >= 16, got {v!r}")


def check_out(where: str, out, shape: tuple, dtype) -> None:
    """The optional aliased output buffer must match the kernel's output exactly."""
    if out is None:
        return
    if tuple(out.shape) != tuple(shape) or out.dtype != jnp.dtype(dtype):
        raise ValueError(
            f"{where}: out buffer {tuple(out.shape)} {out.dtype} must be {tuple(shape)} {jnp.dtype(dtype)}"
        )


__all__ = [
    "ACTIVATIONS",
    "slot_sum",
    "Activation",
    "check_array",
    "check_blocks",
    "check_out",
    "compiler_params",
]


def slot_sum(y: jax.Array) -> jax.Array:
    """``y [T, k, n]`` -> ``[T, n]``: each token's ``k`` slot rows added in slot order as
    elementwise adds (one fixed order per token whatever ``T`` is: batch invariance)."""
    acc = y[:, 0]
    for i in range(1, y.shape[1]):
        acc = acc + y[:, i]
    return acc

"""ggml's activation arithmetic in jnp: ``ExecConfig(activations="ggml")``.

llama.cpp's CPU backend does not multiply a quantized weight by float activations: it
first converts each activation row to the weight type's ``vec_dot_type`` and multiplies
the codes in integers, one float scale per block. This module reproduces that conversion
(`FORMATS`):

- ``q8_0`` (weights Q8_0, Q4_0, Q5_0, IQ4_NL, MXFP4, and jaxmoe's ``int8`` / ``int4``):
  per block of 32, ``amax = max|x|``, ``d = amax / 127`` stored as float16,
  ``q = round_half_even(x * (127 / amax))`` (0 where ``amax = 0``): the AVX path of
  ``quantize_row_q8_0`` (a product by ``127 / amax``, not a division by ``d``). The block
  stands for ``f16(d) * q``.
- ``q8_1`` (weights Q4_1, Q5_1): the codes and ``d`` of ``q8_0`` plus
  ``s = f16(d * sum(q))``, which the dot product uses for the weight's per-block minimum
  ``m``: ``sum_k w_k x_k = d_w f16(d) sum(q_w q) + m s``. `ggml_dot` adds the difference
  ``m (s - f16(d) sum(q))`` that ``s``'s rounding makes.
- ``q8_K`` (the K-quants, IQ4_XS and the other IQ kinds): per block of 256, ``max`` the
  element of largest magnitude (the first one), ``iscale = -127 / max``,
  ``q = round_half_even(iscale * x)``, ``d = 1 / iscale`` in float32
  (``quantize_row_q8_K_ref``, which the x86 backend runs, and its repacked form).
- ``bf16`` / ``f16``: the activations rounded to the weight's float type (round to
  nearest even); ``f32``: unchanged.

`ggml_dot` is then a plain float32 product of the dequantized weight and the activations
as their blocks stand for: a block's ``sum(q_w q)`` is an exact integer, so the result
equals ggml's within float32 summation order. The SwiGLU output is converted again by the
down projection's format (`jaxmoe.experts.swiglu`). A block with a NaN or an infinity
stands for NaN values (ggml's codes there are undefined). Each token's blocks are its own:
the mode keeps batch invariance.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxmoe.quant import QuantizedTensor, materialize

#: Activation formats: float types, then ggml's 8-bit block types (elements per block).
FORMATS = {"f32": 1, "f16": 1, "bf16": 1, "q8_0": 32, "q8_1": 32, "q8_K": 256}

#: `jaxmoe.quant.QuantizedTensor` kind -> ggml's ``vec_dot_type`` of that weight type
#: (``type_traits_cpu`` in ggml-cpu.c); ``int8`` is GGUF Q8_0, ``int4`` Q4_0 (or MLX affine).
VEC_DOT = {
    "int8": "q8_0",
    "int4": "q8_0",
    "q4_0": "q8_0",
    "q4_1": "q8_1",
    "q5_0": "q8_0",
    "q5_1": "q8_1",
    "iq4_nl": "q8_0",
    "mxfp4": "q8_0",
    "q2_k": "q8_K",
    "q3_k": "q8_K",
    "q4_k": "q8_K",
    "q5_k": "q8_K",
    "q6_k": "q8_K",
    "iq4_xs": "q8_K",
    "iq2_xxs": "q8_K",
    "iq2_xs": "q8_K",
    "iq2_s": "q8_K",
    "iq3_xxs": "q8_K",
    "iq3_s": "q8_K",
    "iq1_s": "q8_K",
    "iq1_m": "q8_K",
    "tq1_0": "q8_K",
    "tq2_0": "q8_K",
}

_FLOAT = {jnp.dtype(jnp.float32): "f32", jnp.dtype(jnp.float16): "f16", jnp.dtype(jnp.bfloat16): "bf16"}


def vec_dot_format(w) -> str:
    """The activation format (`FORMATS`) ggml converts activations to for weight ``w``: by
    a `QuantizedTensor`'s kind (`VEC_DOT`), by a float array's dtype otherwise."""
    if isinstance(w, QuantizedTensor):
        if w.kind not in VEC_DOT:
            raise ValueError(f"activations='ggml': no ggml vec_dot_type for weight kind {w.kind!r}")
        return VEC_DOT[w.kind]
    dt = jnp.dtype(w.dtype)
    if dt not in _FLOAT:
        raise ValueError(f"activations='ggml': weights of dtype {dt} have no ggml activation format")
    return _FLOAT[dt]


def _blocks(x: jax.Array, block: int, fmt: str) -> jax.Array:
    n = x.shape[-1]
    if n % block:
        raise ValueError(
            f"activations='ggml': format {fmt} quantizes blocks of {block}; the activation row has {n} elements"
        )
    return jnp.asarray(x, jnp.float32).reshape(*x.shape[:-1], n // block, block)


def quantize_q8_0(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``x [..., n]`` (n a multiple of 32) -> ``(q [..., n] int8, d [..., n/32] float16)``,
    ggml's x86 ``quantize_row_q8_0`` (module docstring). Non-finite blocks: codes 0."""
    b = _blocks(x, 32, "q8_0")
    amax = jnp.max(jnp.abs(b), axis=-1, keepdims=True)
    ok = jnp.isfinite(amax) & (amax != 0)
    inv = jnp.where(ok, jnp.float32(127) / jnp.where(ok, amax, 1), 0)
    q = jnp.where(ok, jnp.clip(jnp.round(b * inv), -128, 127), 0).astype(jnp.int8)
    d = (amax[..., 0] / jnp.float32(127)).astype(jnp.float16)
    return q.reshape(x.shape), d


def quantize_q8_1(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``x [..., n]`` -> ``(q int8 [..., n], d float16 [..., n/32], s float16 [..., n/32])``:
    `quantize_q8_0`'s codes and scale, and ``s = f16(d * sum(q))`` with ``d`` in float32."""
    q, d16 = quantize_q8_0(x)
    b = _blocks(x, 32, "q8_1")
    d = jnp.max(jnp.abs(b), axis=-1) / jnp.float32(127)
    sq = q.reshape(b.shape).astype(jnp.int32).sum(-1)
    return q, d16, (d * sq.astype(jnp.float32)).astype(jnp.float16)


def quantize_q8_K(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``x [..., n]`` (n a multiple of 256) -> ``(q int8 [..., n], d float32 [..., n/256],
    bsums int16 [..., n/16])``, ggml's ``quantize_row_q8_K_ref`` (module docstring)."""
    b = _blocks(x, 256, "q8_K")
    i = jnp.argmax(jnp.abs(b), axis=-1, keepdims=True)  # the first element of largest magnitude
    mx = jnp.take_along_axis(b, i, axis=-1)
    ok = jnp.isfinite(jnp.max(jnp.abs(b), axis=-1, keepdims=True)) & (mx != 0)
    iscale = jnp.float32(-127) / jnp.where(ok, mx, 1)
    q = jnp.where(ok, jnp.minimum(jnp.round(iscale * b), 127), 0).astype(jnp.int8)
    d = jnp.where(ok, jnp.float32(1) / iscale, 0)[..., 0]
    bsums = q.reshape(*b.shape[:-1], 16, 16).astype(jnp.int16).sum(-1, dtype=jnp.int16)
    return q.reshape(x.shape), d, bsums.reshape(*x.shape[:-1], -1)


def _nan_blocks(x: jax.Array, v: jax.Array, block: int) -> jax.Array:
    """``v`` with every block of ``x`` that holds a NaN or an infinity set to NaN."""
    b = jnp.asarray(x, jnp.float32).reshape(*x.shape[:-1], -1, block)
    fin = jnp.all(jnp.isfinite(b), axis=-1, keepdims=True)
    return jnp.where(fin, v.reshape(b.shape), jnp.nan).reshape(x.shape)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def ggml_round(x: jax.Array, fmt: str) -> jax.Array:
    """The float32 values ``x [..., n]`` stands for once converted to ``fmt``: ``f16(d) * q``
    for ``q8_0`` / ``q8_1``, ``d * q`` for ``q8_K``, the rounded value for ``bf16`` / ``f16``,
    ``x`` for ``f32``. Differentiated as the identity (straight through), as the C++
    kernel's ``int8`` mode is."""
    if fmt not in FORMATS:
        raise ValueError(f"activations='ggml': unknown activation format {fmt!r}; expected one of {tuple(FORMATS)}")
    x = jnp.asarray(x)
    if fmt == "f32":
        return x.astype(jnp.float32)
    if fmt in ("f16", "bf16"):
        return x.astype(jnp.float32).astype(jnp.float16 if fmt == "f16" else jnp.bfloat16).astype(jnp.float32)
    if fmt == "q8_K":
        q, d, _ = quantize_q8_K(x)
        v = q.astype(jnp.float32).reshape(*x.shape[:-1], -1, 256) * d[..., None]
        return _nan_blocks(x, v, 256)
    q, d = quantize_q8_0(x)
    v = q.astype(jnp.float32).reshape(*x.shape[:-1], -1, 32) * d.astype(jnp.float32)[..., None]
    return _nan_blocks(x, v, 32)


@ggml_round.defjvp
def _ggml_round_jvp(fmt, primals, tangents):
    (x,), (t,) = primals, tangents
    return ggml_round(x, fmt), jnp.asarray(t).astype(jnp.float32)


def q8_1_sum_residual(x: jax.Array) -> jax.Array:
    """``s - f16(d) * sum(q)`` per block of 32 of ``x [..., n]`` -> ``[..., n/32]`` float32:
    what ``q8_1``'s rounded block sum adds to a Q4_1 / Q5_1 product, per unit of the
    weight block's minimum."""
    q, d16, s = quantize_q8_1(jax.lax.stop_gradient(x))
    sq = q.reshape(*x.shape[:-1], -1, 32).astype(jnp.int32).sum(-1).astype(jnp.float32)
    return s.astype(jnp.float32) - d16.astype(jnp.float32) * sq  # a rounding residual: no gradient


def block_minimums(w: QuantizedTensor) -> jax.Array:
    """The per-block minimum ``m`` of Q4_1 / Q5_1 blocks as a weight ``[..., n_blocks, out]``
    float32 (bytes 2-3 of each block, float16), laid out like `QuantizedTensor.dequantize`'s
    ``[..., in, out]`` so that ``residual @ minimums`` is the correction of `ggml_dot`."""
    if w.kind not in ("q4_1", "q5_1"):
        raise ValueError(f"block_minimums: kind {w.kind!r} has no per-block minimum (q4_1 / q5_1 do)")
    raw = jnp.asarray(w.qdata)
    nbytes = {"q4_1": 20, "q5_1": 24}[w.kind]
    blk = raw.reshape(*raw.shape[:-1], raw.shape[-1] // nbytes, nbytes)[..., 2:4]
    m = jax.lax.bitcast_convert_type(blk, jnp.float16).astype(jnp.float32)  # [..., out, nb]
    return jnp.swapaxes(m, -1, -2)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GgmlWeight:
    """A weight prepared for ggml arithmetic: ``w [..., in, out]`` float32 (dequantized),
    ``mins [..., in / 32, out]`` (Q4_1 / Q5_1 only, else None) and the activation format."""

    w: jax.Array
    mins: jax.Array | None
    fmt: str = dataclasses.field(metadata=dict(static=True), default="f32")


def prepare(w, dtype, activations: str):
    """A weight as the SwiGLU body takes it: ``materialize(w, dtype)`` for float
    activations (and ``int8``, which the XLA strategies run as float, as
    `jaxmoe.ExecConfig` documents); a `GgmlWeight` (float32) for ``activations="ggml"``."""
    if activations in ("float", "int8"):  # int8 is the C++ kernel's mode: float elsewhere
        return materialize(w, dtype)
    if activations != "ggml":
        raise ValueError(f"prepare: activation mode {activations!r} has no XLA form (float, int8, ggml)")
    fmt = vec_dot_format(w)
    mins = block_minimums(w) if fmt == "q8_1" and isinstance(w, QuantizedTensor) else None
    return GgmlWeight(materialize(w, jnp.float32), mins, fmt)


def ggml_dot(matmul, a: jax.Array, w) -> jax.Array:
    """``matmul(a, w)`` for a plain weight; for a `GgmlWeight`, the product ggml computes:
    ``matmul(ggml_round(a, fmt), w)`` plus, for ``q8_1``, ``matmul(residual, mins)``."""
    if not isinstance(w, GgmlWeight):
        return matmul(a, w)
    y = matmul(ggml_round(a, w.fmt), w.w)
    if w.mins is not None:
        y = y + matmul(q8_1_sum_residual(a), w.mins)
    return y

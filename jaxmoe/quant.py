"""Quantized expert weights that stay quantized in device memory.

A `QuantizedTensor` stands for a logical weight ``W [..., in, out]`` (jaxmoe's
``x @ W`` convention) stored out-major with quantization blocks along ``in``, the
way GGUF, MLX and torch store it:

- ``kind="int8"`` (GGUF Q8_0): ``qdata [..., out, in]`` int8, ``scales [..., out, in/g]``,
  ``W[i, o] = scales[o, i // g] * qdata[o, i]``; ``biases`` is None.
- ``kind="int4"`` (MLX affine): ``qdata [..., out, in/2]`` uint8, element
  ``2j`` in the low nibble of byte ``j`` and ``2j+1`` in the high nibble (the byte
  order of MLX's uint32 words on a little-endian machine), ``scales``/``biases``
  ``[..., out, in/g]``, ``W[i, o] = scales[o, i//g] * q[o, i] + biases[o, i//g]``.
  (GGUF Q4_0 is the block kind ``"q4_0"`` below; an int4 tensor with ``scale = d, bias =
  -8 d`` is exactly Q4_0 too, and exports as such.)
- GGUF block kinds ``"q4_0"``, ``"q4_1"``, ``"q5_0"``, ``"q5_1"``, ``"iq4_nl"``, ``"mxfp4"`` (blocks of
  32) and ``"q2_k"``, ``"q3_k"``, ``"q4_k"``, ``"q5_k"``, ``"q6_k"``, ``"iq4_xs"``, the grid
  kinds ``"iq2_xxs"``, ``"iq2_xs"``, ``"iq2_s"``, ``"iq3_xxs"``, ``"iq3_s"``, ``"iq1_s"``,
  ``"iq1_m"`` and the ternary ``"tq1_0"``, ``"tq2_0"`` (super-blocks of 256; the grids and
  sign table come from ``gguf.quants``): ``qdata [..., out, n_blocks * block_bytes]``
  uint8 holds the file's block bytes of each output row unchanged, ``scales`` and ``biases``
  are None and ``group_size`` is the block size (`GGUF_BLOCKS`). `dequantize` decodes the
  blocks in jnp, bit-exact with ``gguf.quants.dequantize`` (the same float32 operations in
  the same order), and `nbytes` is the file's byte count. `gguf_block_tensor` builds one
  with errors that name the tensor.
- ``kind="fp8_e4m3"`` (block-scaled FP8, DeepSeek-V3 / Qwen3 FP8 safetensors): ``qdata [...,
  out, in]`` ``float8_e4m3fn`` codes as stored, ``scales [..., ceil(out/b), ceil(in/b)]``
  (the file's ``weight_scale_inv``: float32, or bfloat16 / float16) with one scale per
  square ``b x b`` block over ``[out, in]`` (``b = group_size``, 128 in the Hub
  checkpoints; the last blocks of a row or column may be partial), ``biases`` None,
  ``W[i, o] = float32(q[o, i]) * float32(scales[o // b, i // b])`` rounded once to float32.
  `fp8_block_tensor` builds one with errors that name the tensor.

The quantizers here follow MLX's affine rule (docs/routing.md, "MLX affine 4-bit") and GGUF's Q8_0
rule; bit-exact converters from stored GGUF / MLX bytes live in `jaxmoe.io`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

# GGUF block layouts and their pure-jnp decoder live with the kernels that read them in place
# (re-exported: ``GGUF_BLOCKS`` maps kind -> (elements per block, bytes per block))
from pallas_kernels.gguf import GGUF_BLOCKS as GGUF_BLOCKS
from pallas_kernels.gguf import check_block_tensor
from pallas_kernels.gguf import dequantize_gguf_blocks as dequantize_gguf_blocks
from pallas_kernels.gguf import dequantize_gguf_rows as dequantize_gguf_rows

#: Block-scaled FP8 kinds (codes in their float8 dtype, float scales per square block).
FP8_KINDS = ("fp8_e4m3",)
KINDS = ("int8", "int4", *GGUF_BLOCKS, *FP8_KINDS)

#: What a `QuantizedTensor` holds: device arrays, or host numpy arrays right after loading.
Buffer = jax.Array | np.ndarray


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedTensor:
    qdata: Buffer
    scales: Buffer | None
    biases: Buffer | None
    kind: str = dataclasses.field(metadata=dict(static=True), default="int8")
    group_size: int = dataclasses.field(metadata=dict(static=True), default=32)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"QuantizedTensor.kind: unknown {self.kind!r}; expected one of {KINDS}")
        if self.kind in GGUF_BLOCKS:
            check_gguf_blocks(self, "QuantizedTensor")
            return
        if self.kind in FP8_KINDS:
            check_fp8_blocks(self, "QuantizedTensor")
            return
        if not isinstance(self.qdata, jax.Array | np.ndarray):  # tracers / sentinels under transforms
            return
        if self.scales is None:
            raise ValueError(f"QuantizedTensor: kind {self.kind!r} needs scales")
        per_byte = 2 if self.kind == "int4" else 1
        n_in = self.qdata.shape[-1] * per_byte
        if n_in % self.group_size or self.scales.shape != (*self.qdata.shape[:-1], n_in // self.group_size):
            raise ValueError(
                f"QuantizedTensor: scales {self.scales.shape} do not match qdata {self.qdata.shape} "
                f"({self.kind}, group {self.group_size})"
            )
        if self.kind == "int4" and (self.biases is None or self.biases.shape != self.scales.shape):
            raise ValueError(f"QuantizedTensor: int4 needs biases of shape {self.scales.shape}")

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical ``[..., in, out]`` shape."""
        *lead, out, n = self.qdata.shape
        if self.kind in GGUF_BLOCKS:
            block, block_bytes = GGUF_BLOCKS[self.kind]
            return (*lead, n // block_bytes * block, out)
        if self.kind in FP8_KINDS:
            return (*lead, n, out)
        per_byte = 2 if self.kind == "int4" else 1
        return (*lead, n * per_byte, out)

    @property
    def ndim(self) -> int:
        return self.qdata.ndim

    @property
    def dtype(self):
        """The scales' dtype (float16 for the GGUF block kinds, whose scales are float16)."""
        if self.scales is None:
            return np.dtype(np.float16)
        return self.scales.dtype

    @property
    def nbytes(self) -> int:
        """Bytes held (for a GGUF block kind: exactly the file's bytes of the tensor)."""
        b = self.qdata.size * self.qdata.dtype.itemsize
        if self.scales is not None:
            b += self.scales.size * self.scales.dtype.itemsize
        if self.biases is not None:
            b += self.biases.size * self.biases.dtype.itemsize
        return int(b)

    def codes(self) -> jax.Array:
        """Integer codes ``[..., out, in]`` (int8 for int8, 0..15 as int8 for int4; the GGUF
        block kinds and the FP8 kinds have no integer codes: ValueError)."""
        if self.kind in FP8_KINDS:
            raise ValueError(f"QuantizedTensor.codes: kind {self.kind!r} keeps float8 codes in qdata; use dequantize()")
        if self.kind in GGUF_BLOCKS:
            raise ValueError(f"QuantizedTensor.codes: kind {self.kind!r} keeps raw GGUF blocks; use dequantize()")
        if self.kind == "int8":
            return jnp.asarray(self.qdata)
        return unpack_int4(jnp.asarray(self.qdata))

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The logical weight ``[..., in, out]`` in ``dtype`` (math in float32)."""
        if self.kind in GGUF_BLOCKS:
            return jnp.swapaxes(dequantize_gguf_rows(jnp.asarray(self.qdata), self.kind), -1, -2).astype(dtype)
        assert self.scales is not None
        if self.kind in FP8_KINDS:
            w = dequantize_fp8_blocks(jnp.asarray(self.qdata), jnp.asarray(self.scales), self.group_size)
            return jnp.swapaxes(w, -1, -2).astype(dtype)
        q = self.codes().astype(jnp.float32)
        *lead, out, n = q.shape
        g = self.group_size
        qg = q.reshape(*lead, out, n // g, g)
        w = qg * self.scales.astype(jnp.float32)[..., None]
        if self.biases is not None:
            w = w + self.biases.astype(jnp.float32)[..., None]
        return jnp.swapaxes(w.reshape(*lead, out, n), -1, -2).astype(dtype)

    def __getitem__(self, idx) -> QuantizedTensor:
        """Indexes the leading (expert) axes only."""
        return QuantizedTensor(
            self.qdata[idx],
            None if self.scales is None else self.scales[idx],
            None if self.biases is None else self.biases[idx],
            self.kind,
            self.group_size,
        )


def check_gguf_blocks(w: QuantizedTensor, name: str = "QuantizedTensor") -> None:
    """ValueError naming ``name``, the kind and the shapes unless ``w`` is a well-formed GGUF
    block tensor (uint8 ``[..., out, n_blocks * block_bytes]``, no scales / biases,
    ``group_size`` = the block size; `pallas_kernels.gguf.check_block_tensor`). Tracers are
    checked by shape only; a ``float0`` cotangent of the codes passes."""
    check_block_tensor(name, w.kind, w.qdata, w.scales, w.biases, w.group_size, extra_dtypes=(jax.dtypes.float0,))


def check_fp8_blocks(w: QuantizedTensor, name: str = "QuantizedTensor") -> None:
    """ValueError naming ``name`` and the shapes unless ``w`` is a well-formed block-scaled
    FP8 tensor: ``float8_e4m3fn`` codes ``[..., out, in]``, scales ``[..., ceil(out/b),
    ceil(in/b)]`` (float32, bfloat16 or float16), no biases, block ``b = group_size > 0``.
    Leaves without a shape (sentinels, partition specs under a transform) are not checked;
    ``float0`` codes (a cotangent) pass."""
    b = w.group_size
    where = f"{name} ({w.kind}, {b} x {b} blocks)"
    if not isinstance(b, int) or isinstance(b, bool) or b <= 0:
        raise ValueError(f"{where}: group_size must be the positive block edge, got {b!r}")
    if w.biases is not None:
        raise ValueError(f"{where}: block-scaled FP8 has no biases; biases must be None")
    shape = getattr(w.qdata, "shape", None)
    if shape is None:
        return
    shape = tuple(shape)
    if w.scales is None:
        raise ValueError(f"{where}: codes of shape {shape} need their block scales, got None")
    if len(shape) < 2:
        raise ValueError(f"{where}: codes must be [..., out, in], got shape {shape}")
    dt = getattr(w.qdata, "dtype", None)
    if dt is not None and np.dtype(dt) not in (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(jax.dtypes.float0)):
        raise ValueError(f"{where}: codes must be float8_e4m3fn, got {dt} of shape {shape}")
    sshape = getattr(w.scales, "shape", None)
    if sshape is None:
        return
    *lead, out, n_in = shape
    want = (*lead, -(-out // b), -(-n_in // b))
    if tuple(sshape) != want:
        raise ValueError(
            f"{where}: scales of shape {tuple(sshape)} do not match codes of shape {shape}: one scale per "
            f"block needs {want} (truncated or wrong-sized scale buffer?)"
        )
    sdt = getattr(w.scales, "dtype", None)
    if sdt is not None and np.dtype(sdt) not in _FP8_SCALE_DTYPES:
        raise ValueError(f"{where}: scales must be float32, bfloat16 or float16, got {sdt} of shape {tuple(sshape)}")


_FP8_SCALE_DTYPES = (
    np.dtype(np.float32),
    np.dtype(ml_dtypes.bfloat16),
    np.dtype(np.float16),
    np.dtype(jax.dtypes.float0),
)


def dequantize_fp8_blocks(codes: jax.Array, scales: jax.Array, block: int) -> jax.Array:
    """Block-scaled FP8 ``codes [..., out, in]`` and ``scales [..., ceil(out/b), ceil(in/b)]``
    -> float32 ``[..., out, in]``: each code widened to float32 (exact) times its block's
    scale widened to float32, one rounding; the same as numpy's
    ``codes.astype(float32) * scale`` with ``ml_dtypes`` (a product below float32's normal
    range is flushed to zero by XLA:CPU, where numpy keeps the subnormal)."""
    *_, out, n_in = codes.shape
    s = scales.astype(jnp.float32)
    s = jnp.repeat(jnp.repeat(s, block, axis=-2, total_repeat_length=s.shape[-2] * block), block, axis=-1)
    return codes.astype(jnp.float32) * s[..., :out, :n_in]


def dequantize_fp8_numpy(codes, scales, block: int) -> np.ndarray:
    """`dequantize_fp8_blocks` in numpy (``ml_dtypes`` float8 -> float32), ``[..., out, in]``
    float32; for exports that compile nothing."""
    c = np.asarray(codes).astype(np.float32)
    s = np.asarray(scales).astype(np.float32)
    s = np.repeat(np.repeat(s, block, axis=-2), block, axis=-1)[..., : c.shape[-2], : c.shape[-1]]
    return c * s


def fp8_block_tensor(codes, scales, block: int = 128, name: str = "weight") -> QuantizedTensor:
    """A block-scaled FP8 `QuantizedTensor` (``kind="fp8_e4m3"``) from the file's
    ``float8_e4m3fn`` codes ``[..., out, in]`` and scales ``[..., ceil(out/b), ceil(in/b)]``,
    kept as given (no copy). ValueError naming ``name`` and the shapes for another code
    dtype, a scale buffer of the wrong shape or dtype, or a block edge that is not positive."""
    w = object.__new__(QuantizedTensor)
    for f, v in (("qdata", codes), ("scales", scales), ("biases", None), ("kind", "fp8_e4m3"), ("group_size", block)):
        object.__setattr__(w, f, v)
    if getattr(codes, "shape", None) is None or getattr(scales, "shape", None) is None:
        raise ValueError(f"{name} (fp8_e4m3): codes and scales must be arrays")
    check_fp8_blocks(w, name)
    return w


def gguf_block_tensor(raw, kind: str, n_in: int | None = None, name: str = "weight") -> QuantizedTensor:
    """A GGUF block `QuantizedTensor` from block bytes ``[..., out, n_blocks * block_bytes]``.

    ``kind`` is a `GGUF_BLOCKS` key (case-insensitive, e.g. ``"Q4_K"``); ``n_in``, when
    given, is the logical input width the bytes must hold. Raises ValueError naming
    ``name``, the type and the shapes for an unknown type, a width that is not a multiple
    of the block, or a truncated / wrong-sized buffer. Keeps numpy / jax leaves as given.
    """
    k = str(kind).lower()
    shape = tuple(getattr(raw, "shape", ()))
    if k not in GGUF_BLOCKS:
        raise ValueError(
            f"{name}: GGUF type {kind!r} (bytes of shape {shape}) is not a block kind jaxmoe keeps quantized; "
            f"expected one of {sorted(GGUF_BLOCKS)}"
        )
    block, block_bytes = GGUF_BLOCKS[k]
    if n_in is not None:
        if n_in % block:
            raise ValueError(
                f"{name} ({k.upper()}): input width {n_in} is not a multiple of the block size {block} "
                f"(bytes of shape {shape})"
            )
        want = n_in // block * block_bytes
        if not shape or shape[-1] != want:
            raise ValueError(
                f"{name} ({k.upper()}): block bytes of shape {shape} do not hold width {n_in}: rows must be "
                f"{want} bytes ({n_in // block} blocks of {block_bytes})"
            )
    w = object.__new__(QuantizedTensor)
    for f, v in (("qdata", raw), ("scales", None), ("biases", None), ("kind", k), ("group_size", block)):
        object.__setattr__(w, f, v)
    check_gguf_blocks(w, name)
    return w


def unpack_int4(packed: jax.Array) -> jax.Array:
    """``[..., n/2]`` uint8 -> ``[..., n]`` int8 codes 0..15 (low nibble first)."""
    lo = packed & 0xF
    hi = packed >> 4
    return jnp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2).astype(jnp.int8)


def pack_int4(codes) -> np.ndarray:
    """``[..., n]`` integer codes 0..15 -> ``[..., n/2]`` uint8 (low nibble first)."""
    c = np.asarray(codes).astype(np.uint8)
    if c.shape[-1] % 2:
        raise ValueError(f"pack_int4: last dimension must be even, got {c.shape}")
    if c.size and c.max() > 15:
        raise ValueError("pack_int4: codes must lie in 0..15")
    return (c[..., 0::2] | (c[..., 1::2] << 4)).astype(np.uint8)


def materialize(w, dtype) -> jax.Array:
    """A float weight in ``dtype``: dequantizes a `QuantizedTensor`, casts an array.

    The dequantized weight sits behind `jax.lax.optimization_barrier`: fused into its
    consumers, XLA:CPU (jax 0.10) computed a layer with a Q5_0 shared expert 4% off under
    ``jit`` (tests/test_quant_gguf.py, ``test_jitted_layer_with_block_shared_expert...``).
    """
    if isinstance(w, QuantizedTensor):
        return jax.lax.optimization_barrier(w.dequantize(dtype))
    return w.astype(dtype)


def _out_major(w) -> np.ndarray:
    w = np.asarray(w, np.float32)
    if w.ndim < 2:
        raise ValueError(f"quantize: weight must be at least 2-D [..., in, out], got {w.shape}")
    return np.swapaxes(w, -1, -2)


def quantize_int8(w, group_size: int = 32, scale_dtype=np.float16) -> QuantizedTensor:
    """GGUF Q8_0 rule on a logical ``[..., in, out]`` weight: ``d = amax / 127``
    (stored as float16), ``q = round(x / d)``."""
    t = _out_major(w)
    *lead, out, n = t.shape
    if n % group_size:
        raise ValueError(f"quantize_int8: input dim {n} is not a multiple of the group size {group_size}")
    g = t.reshape(*lead, out, n // group_size, group_size)
    d = np.abs(g).max(axis=-1) / 127.0
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(d == 0, 0.0, 1.0 / d)
    q = np.round(g * inv[..., None]).clip(-127, 127).astype(np.int8).reshape(*lead, out, n)
    return QuantizedTensor(jnp.asarray(q), jnp.asarray(d.astype(scale_dtype)), None, "int8", group_size)


def quantize_int4_affine(w, group_size: int = 64, scale_dtype=np.float32) -> QuantizedTensor:
    """MLX's affine 4-bit rule (docs/routing.md, "MLX affine 4-bit") on a logical ``[..., in, out]`` weight."""
    t = _out_major(w)
    *lead, out, n = t.shape
    if n % group_size:
        raise ValueError(f"quantize_int4_affine: input dim {n} is not a multiple of the group size {group_size}")
    scales, biases, q = mlx_affine_quantize_groups(t.reshape(*lead, out, n // group_size, group_size))
    return QuantizedTensor(
        jnp.asarray(pack_int4(q.reshape(*lead, out, n))),
        jnp.asarray(scales.astype(scale_dtype)),
        jnp.asarray(biases.astype(scale_dtype)),
        "int4",
        group_size,
    )


def mlx_affine_quantize_groups(g: np.ndarray):
    """MLX 4-bit affine quantization of groups ``[..., G, gs]`` (float32 math).

    Returns ``scales [..., G]``, ``biases [..., G]``, codes ``[..., G, gs]`` uint8.
    """
    g = g.astype(np.float32)
    n_bins = np.float32(15.0)
    eps = np.float32(1e-7)
    w_min = g.min(axis=-1)
    w_max = g.max(axis=-1)
    mask = np.abs(w_min) > np.abs(w_max)
    scale = np.maximum((w_max - w_min) / n_bins, eps).astype(np.float32)
    scale = np.where(mask, scale, -scale).astype(np.float32)
    edge = np.where(mask, w_min, w_max).astype(np.float32)
    q0 = np.rint(edge / scale).astype(np.float32)
    nz = q0 != 0
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(nz, edge / np.where(nz, q0, 1), scale).astype(np.float32)
    bias = np.where(nz, edge, 0).astype(np.float32)
    q = np.clip(np.rint((g - bias[..., None]) / scale[..., None]), 0, 15).astype(np.uint8)
    return scale, bias, q


def quantize_activations_q8(x: jax.Array, block: int = 32) -> jax.Array:
    """``Q8(x)``: ``x [..., n]`` rounded to int8 per block of ``block`` along the last axis,
    as float32 (``dx * xq``), what ``ExecConfig(activations="int8")`` feeds the int8 / int4
    experts of ``impl="cpu"`` (ggml's Q8_0 rule on activations).

    Per block: ``dx = max|x| / 127`` (float32), ``xq = rint(clip(x / dx, -127, 127))`` (round
    half to even; 0 where ``dx = 0``); a block with a NaN or an infinity becomes NaN. So
    ``|x - Q8(x)| <= dx / 2`` elementwise. ``n`` must be a multiple of ``block``.
    """
    x = jnp.asarray(x, jnp.float32)
    n = x.shape[-1]
    if n % block:
        raise ValueError(f"quantize_activations_q8: last dimension {n} is not a multiple of the block {block}")
    b = x.reshape(*x.shape[:-1], n // block, block)
    finite = jnp.all(jnp.isfinite(b), axis=-1, keepdims=True)
    dx = jnp.max(jnp.abs(b), axis=-1, keepdims=True) / jnp.float32(127)
    safe = jnp.where(dx > 0, dx, jnp.float32(1))
    xq = jnp.where(dx > 0, jnp.rint(jnp.clip(b / safe, -127, 127)), 0)
    out = jnp.where(finite, xq * dx, jnp.nan)
    return out.reshape(x.shape)

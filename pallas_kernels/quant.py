"""Expert weights as kernel operands, and their tiles loaded (and dequantized) in-kernel.

A routed-expert weight of logical shape ``[E, K, N]`` (``x @ W``: K in, N out) is given
to a kernel wrapper as a floating-point array or as a `QuantWeight`, and reaches the
kernel as one of these layouts (`WeightLayout.kind`):

- ``dense``: one array ``w [E, K, N]``; a tile is ``w[e, k0:k0+bk, n0:n0+bn]``.
- ``int8`` (GGUF Q8_0): ``q [E, N, K]`` int8 and ``s [E, N, K/g]``; a tile is
  ``q[e, n0:, k0:] * s`` per group of g along K, transposed (``[bn, bk]``).
- ``int4`` (MLX affine, Q4_0 as scale d / bias -8d): ``p [E, N, K/2]`` uint8 (low nibble
  = even element), ``s, b [E, N, K/g]``; a tile is ``s * q + b``.
- a GGUF block kind decoded in-kernel (``q4_1``, ``q5_0``, ``q5_1``, ``q4_k``, ``q5_k``,
  ``q6_k``, ``q2_k``, ``q3_k``, ``iq4_nl``, ``iq4_xs``, ``mxfp4``; `gguf.TILE_KINDS`): the file's block bytes ``[E, N, n_blocks * block_bytes]`` uint8,
  scales and mins inside the blocks, read as uint16 words (MXFP4: each expert's bytes as one
  run of words, `gguf.expert_words`) and decoded per tile by `gguf.load_tile`.
- ``fp8_e4m3`` (block-scaled FP8): ``q [E, N, K]`` uint8 (the ``float8_e4m3fn`` codes'
  bytes) and ``s [E, ceil(N/b), ceil(K/b)]``, one scale per ``b x b`` block (``b`` a
  multiple of 32); a tile is each code's exact float32 value (bit arithmetic) times its
  block's scale, one rounding.

The weights stay in this form in device memory; `load_tile` dequantizes one tile in
registers (float32 math, then the compute dtype). `weight_operands` checks a weight and
splits it into its static `WeightLayout` and its arrays; `dequantize_reference` is the
pure-jnp reference of the same layouts.

Code arrays of 2^31 elements or more (DeepSeek-V3 in Q8_0: 256 x 2048 x 7168 int8 codes
per projection) reach the kernel as int32 *words*, 4 bytes each (``WeightLayout.word``
= 4): a free bitcast of the same memory. Pallas's Triton lowering indexes an operand with
32-bit element offsets unless it is over 2^32 *bytes*, so a 1-byte array of 2^31..2^32
elements would be addressed with wrapping offsets; as words it has a quarter of the
elements and every offset fits. `load_tile` unpacks the bytes in registers.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import gguf
from pallas_kernels.gguf import GGUF_BLOCKS
from pallas_kernels.tuning import is_pow2

#: Quantized kinds with separate scale (and bias) arrays, decoded by code planes.
PLANE_KINDS = ("int8", "int4")
#: Block-scaled FP8 kinds (codes' bytes and ``[E, ceil(N/b), ceil(K/b)]`` scales).
FP8_KINDS = ("fp8_e4m3",)
#: Kinds of a `QuantWeight`.
QUANT_KINDS = (*PLANE_KINDS, *gguf.TILE_KINDS, *FP8_KINDS)
KINDS = ("dense", *QUANT_KINDS)
#: Code arrays with at least this many elements are loaded as int32 words (see the module doc).
WORD_MIN_ELEMENTS = 2**31
#: Code bytes per int32 word.
WORD_BYTES = 4


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantWeight:
    """A quantized expert weight operand, logical ``[E, K, N]``, stored out-major.

    A pytree (``kind`` and ``group_size`` static), so it passes through ``jax.jit``.

    Attributes:
      qdata: ``int8``: ``[E, N, K]`` int8 codes; ``int4``: ``[E, N, K/2]`` uint8, element
        ``2j`` in the low nibble of byte ``j``; a GGUF block kind: ``[E, N, K / block *
        block_bytes]`` uint8, the file's blocks.
      scales: ``[E, N, K/g]`` floating point; None for a GGUF block kind; ``fp8_e4m3``:
        ``[E, ceil(N/b), ceil(K/b)]`` (``qdata``: ``[E, N, K]`` uint8, the codes' bytes).
      biases: ``int4``: ``[E, N, K/g]`` floating point (``W = scales * q + biases``);
        ``int8`` and GGUF block kinds: None (``W = scales * q``).
      kind: ``"int8"``, ``"int4"`` or a `gguf.TILE_KINDS` key.
      group_size: ``g``, the quantization group along K (a power of two >= 2); for a GGUF
        block kind the block size (32 or 256).
    """

    qdata: jax.Array
    scales: jax.Array | None
    biases: jax.Array | None = None
    kind: str = dataclasses.field(metadata=dict(static=True), default="int8")
    group_size: int = dataclasses.field(metadata=dict(static=True), default=32)

    def __post_init__(self):
        if self.kind not in QUANT_KINDS:
            why = (
                " (a GGUF block kind without an in-kernel decode: pass it dequantized)"
                if self.kind in GGUF_BLOCKS
                else ""
            )
            raise ValueError(f"QuantWeight.kind: unknown {self.kind!r}{why}; expected one of {QUANT_KINDS}")

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical ``[E, K, N]`` shape."""
        *lead, n, k = self.qdata.shape
        if self.kind in GGUF_BLOCKS:
            block, block_bytes = GGUF_BLOCKS[self.kind]
            return (*lead, k // block_bytes * block, n)
        per_byte = 2 if self.kind == "int4" else 1
        return (*lead, k * per_byte, n)


@dataclasses.dataclass(frozen=True)
class WeightLayout:
    """Static description of one expert weight operand (logical ``[E, K, N]``)."""

    kind: str
    num_experts: int
    k: int
    n: int
    group_size: int = 0
    #: Code bytes per loaded element of the code array: 1 (as stored), 4 (int32 words) or
    #: 2 (GGUF block kinds: always uint16 words).
    word: int = 1

    @property
    def num_arrays(self) -> int:
        return {"dense": 1, "int8": 2, "int4": 3, "fp8_e4m3": 2}.get(self.kind, 1)

    def min_block_k(self) -> int:
        """Smallest K step the layout allows (a whole quantization group; GGUF block
        kinds: `gguf.MIN_BLOCK_K` elements, part of a block's scale groups)."""
        if self.kind in GGUF_BLOCKS or self.kind in FP8_KINDS:
            return gguf.MIN_BLOCK_K
        return self.group_size if self.kind != "dense" else 1


def weight_operands(
    w,
    name: str,
    num_experts: int | None = None,
    k: int | None = None,
    n: int | None = None,
    word_loads: bool | None = None,
) -> tuple[WeightLayout, tuple[jax.Array, ...]]:
    """The layout and arrays of an expert weight ``[E, K, N]`` (float array or `QuantWeight`).

    ``word_loads``: a `QuantWeight`'s codes as int32 words (``layout.word == 4``, the
    code array bitcast to ``[E, N, bytes / 4]`` int32); None: only when the code array has
    `WORD_MIN_ELEMENTS` or more (what 32-bit offsets cannot address).

    Raises ValueError naming ``name`` when ``w`` is neither, when the shape differs from
    the expected ``(num_experts, k, n)`` (entries left None are not checked), when a
    `QuantWeight`'s arrays do not fit its kind and group size, or when word loads are
    needed and the code bytes per row are not a multiple of 4.
    """
    if not isinstance(w, QuantWeight | jax.Array | np.ndarray):
        raise ValueError(
            f"{name}: expert weight must be a floating-point array or a pallas_kernels.quant.QuantWeight, "
            f"got {type(w).__name__}"
        )
    if isinstance(w, QuantWeight) and w.qdata.ndim != 3:
        raise ValueError(
            f"{name}: QuantWeight.qdata must be [E, N, K] (int4: [E, N, K/2]; GGUF blocks: [E, N, row bytes]), "
            f"got shape {w.qdata.shape}"
        )
    if isinstance(w, QuantWeight) and w.kind in GGUF_BLOCKS:
        return _gguf_operands(w, name, num_experts, k, n)
    shape = tuple(w.shape)
    if len(shape) != 3:
        raise ValueError(f"{name}: expert weight must be [E, K, N], got shape {shape}")
    for got, want, what in zip(shape, (num_experts, k, n), ("E", "K", "N")):
        if want is not None and got != want:
            raise ValueError(
                f"{name}: shape {shape} has {what}={got}, expected {want} (want [E, K, N] = {(num_experts, k, n)})"
            )
    e, kk, nn = shape
    if isinstance(w, QuantWeight):
        lay, arrs = _quant_operands(w, name, e, kk, nn)
        return as_words(lay, arrs, name, word_loads)
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise ValueError(f"{name}: expert weight must be floating point or a QuantWeight, got {w.dtype}")
    return WeightLayout("dense", e, kk, nn), (w,)


def _gguf_operands(w: QuantWeight, name: str, num_experts, k, n) -> tuple[WeightLayout, tuple[jax.Array, ...]]:
    gguf.check_block_tensor(name, w.kind, w.qdata, w.scales, w.biases, w.group_size)
    block, block_bytes = GGUF_BLOCKS[w.kind]
    where = f"{name} ({w.kind.upper()}, block {block} in {block_bytes} bytes)"
    e, rows, row_bytes = w.qdata.shape
    shape = (e, row_bytes // block_bytes * block, rows)
    for got, want, what in zip(shape, (num_experts, k, n), ("E", "K", "N")):
        if want is not None and got != want:
            raise ValueError(f"{where}: logical shape {shape} has {what}={got}, expected {want}")
    layout = WeightLayout(w.kind, e, shape[1], rows, block, word=2)
    if w.kind in gguf.FLAT_KINDS:
        if rows * row_bytes % 2:
            raise ValueError(
                f"{where}: an expert's {rows} rows of {row_bytes} bytes are an odd number of bytes; the kernels "
                f"read them as uint16 words (decode it with XLA instead)"
            )
        return layout, (gguf.expert_words(jnp.asarray(w.qdata)),)
    return layout, (gguf.as_words(jnp.asarray(w.qdata)),)


def _fp8_operands(w: QuantWeight, name: str, e: int, k: int, n: int) -> tuple[WeightLayout, tuple[jax.Array, ...]]:
    b = w.group_size
    where = f"{name} (fp8_e4m3, {b} x {b} blocks)"
    if b <= 0 or b % gguf.MIN_BLOCK_K:
        raise ValueError(f"{where}: the kernels take a block edge that is a multiple of {gguf.MIN_BLOCK_K}")
    if w.qdata.dtype != jnp.uint8:
        raise ValueError(f"{where}: qdata must be the codes' bytes, uint8 [E, N, K], got {w.qdata.dtype}")
    want = (e, -(-n // b), -(-k // b))
    s = w.scales
    if s is None or tuple(s.shape) != want or not jnp.issubdtype(s.dtype, jnp.floating) or w.biases is not None:
        got = "None" if s is None else f"{tuple(s.shape)} {s.dtype}"
        raise ValueError(
            f"{where}: scales must be floating point of shape {want} (one per block; no biases), got {got} "
            f"(truncated or wrong-sized scale buffer?)"
        )
    return WeightLayout("fp8_e4m3", e, k, n, b), (w.qdata, s)


def _quant_operands(w: QuantWeight, name: str, e: int, k: int, n: int) -> tuple[WeightLayout, tuple[jax.Array, ...]]:
    if w.kind in FP8_KINDS:
        return _fp8_operands(w, name, e, k, n)
    g = w.group_size
    if not is_pow2(g) or g < 2:
        raise ValueError(f"{name}: quantization group size must be a power of two, got {g}")
    if k % g:
        raise ValueError(f"{name}: K={k} is not a multiple of the quantization group size {g}")
    want_q = jnp.dtype(jnp.int8 if w.kind == "int8" else jnp.uint8)
    if w.qdata.dtype != want_q:
        raise ValueError(f"{name}: {w.kind} qdata must be {want_q}, got {w.qdata.dtype}")
    groups = (e, n, k // g)
    parts = [("scales", w.scales)] + ([("biases", w.biases)] if w.kind == "int4" else [])
    for what, a in parts:
        if a is None or tuple(a.shape) != groups or not jnp.issubdtype(a.dtype, jnp.floating):
            got = "None" if a is None else f"{tuple(a.shape)} {a.dtype}"
            raise ValueError(f"{name}: {w.kind} {what} must be floating point of shape {groups}, got {got}")
    if w.kind == "int8":
        if w.biases is not None:
            raise ValueError(f"{name}: an int8 QuantWeight takes no biases (W = scales * q)")
        return WeightLayout("int8", e, k, n, g), (w.qdata, w.scales)
    return WeightLayout("int4", e, k, n, g), (w.qdata, w.scales, w.biases)


def as_words(
    layout: WeightLayout, arrays: tuple[jax.Array, ...], name: str, word_loads: bool | None = None
) -> tuple[WeightLayout, tuple[jax.Array, ...]]:
    """``layout, arrays`` with the code array as int32 words when ``word_loads`` (None: when
    it has `WORD_MIN_ELEMENTS` elements or more); dense weights are returned as they are."""
    if layout.kind == "dense" or layout.word != 1:
        return layout, arrays
    q = arrays[0]
    if word_loads is None:
        word_loads = q.size >= WORD_MIN_ELEMENTS
    if not word_loads:
        return layout, arrays
    e, n, nb = q.shape
    if nb % WORD_BYTES:
        raise ValueError(
            f"{name}: {layout.kind} codes {tuple(q.shape)} are loaded as int32 words (>= {WORD_MIN_ELEMENTS} "
            f"elements or word_loads=True), which needs the bytes per row ({nb}) to be a multiple of {WORD_BYTES}"
        )
    words = jax.lax.bitcast_convert_type(q.reshape(e, n, nb // WORD_BYTES, WORD_BYTES), jnp.int32)
    return dataclasses.replace(layout, word=WORD_BYTES), (words, *arrays[1:])


def word_bytes(words: jax.Array) -> jax.Array:
    """``words [..., W]`` int32 -> ``[..., 4 W]`` uint8, little-endian (the inverse of `as_words`)."""
    b = jax.lax.bitcast_convert_type(words, jnp.uint8)
    return b.reshape(*words.shape[:-1], words.shape[-1] * WORD_BYTES)


def dequantize_reference(layout: WeightLayout, arrays, dtype=jnp.float32) -> jax.Array:
    """Pure-jnp reference: the logical ``[E, K, N]`` weight in ``dtype`` (math in float32)."""
    if layout.kind == "dense":
        return arrays[0].astype(dtype)
    if layout.kind in GGUF_BLOCKS:
        raw = gguf.words_to_bytes(arrays[0]).reshape(layout.num_experts, layout.n, -1)
        w = gguf.dequantize_gguf_rows(raw, layout.kind)  # [E, N, K]
        return jnp.swapaxes(w, 1, 2).astype(dtype)
    e, k, n, g = layout.num_experts, layout.k, layout.n, layout.group_size
    codes = word_bytes(arrays[0]) if layout.word != 1 else arrays[0]
    if layout.kind in FP8_KINDS:  # ml_dtypes' float8 -> float32 (exact) times the block's scale
        c = jax.lax.bitcast_convert_type(codes, jnp.float8_e4m3fn).astype(jnp.float32)
        s = jnp.repeat(jnp.repeat(arrays[1].astype(jnp.float32), g, axis=1), g, axis=2)[:, :n, :k]
        return jnp.swapaxes(c * s, 1, 2).astype(dtype)
    if layout.kind == "int8":
        q = jax.lax.bitcast_convert_type(codes, jnp.int8).astype(jnp.float32)
    else:
        p = codes
        q = jnp.stack([p & 0xF, p >> 4], axis=-1).reshape(e, n, k).astype(jnp.float32)
    w = q.reshape(e, n, k // g, g) * arrays[1].astype(jnp.float32)[..., None]
    if layout.kind == "int4":
        w = w + arrays[2].astype(jnp.float32)[..., None]
    return jnp.swapaxes(w.reshape(e, n, k), 1, 2).astype(dtype)


def interleave(planes: list) -> jax.Array:
    """``m`` planes ``[r, w]`` (``m`` a power of two) -> ``[r, m w]`` with element ``m j + i``
    from plane ``i`` (in-kernel: pairwise joins along a new last axis, which Triton keeps
    in order, unlike its concatenate)."""
    if len(planes) == 1:
        return planes[0]
    ev, od = interleave(planes[0::2]), interleave(planes[1::2])
    r, w = ev.shape
    return jnp.stack([ev, od], axis=-1).reshape(r, 2 * w)


def load_codes(layout: WeightLayout, ref, e, n0, ns, c0, bn: int, nc: int) -> jax.Array:
    """Codes ``c0 .. c0 + nc`` of rows ``n0 .. n0 + bn`` of expert ``e`` (in-kernel), as
    ``[bn, nc]`` integers (int8 codes, int4 bytes 0..255); codes past the row read as
    zero. With word loads (``layout.word == 4``; ``c0``, ``nc`` multiples of 4) the int32
    words are loaded and their bytes unpacked (little-endian) to int32 values."""
    per_row = layout.k // 2 if layout.kind == "int4" else layout.k
    if layout.word == 1:
        cs = c0 + jnp.arange(nc, dtype=jnp.int32)
        m = (ns < layout.n)[:, None] & (cs < per_row)[None, :]
        return plgpu.load(ref.at[e, pl.ds(n0, bn), pl.ds(c0, nc)], mask=m, other=0)
    wb = layout.word
    nw = nc // wb
    ws = c0 // wb + jnp.arange(nw, dtype=jnp.int32)
    m = (ns < layout.n)[:, None] & (ws < per_row // wb)[None, :]
    words = plgpu.load(ref.at[e, pl.ds(n0, bn), pl.ds(c0 // wb, nw)], mask=m, other=0)  # [bn, nw] int32
    if layout.kind == "int8":  # byte i sign-extended: shift it to the top, arithmetic shift back
        planes = [jnp.right_shift(jnp.left_shift(words, 24 - 8 * i), 24) for i in range(wb)]
    else:
        planes = [jnp.right_shift(words, 8 * i) & 0xFF for i in range(wb)]
    return interleave(planes)


def load_tile(layout: WeightLayout, refs, e, k0, n0, bk: int, bn: int, dtype):
    """One weight tile of expert ``e`` at rows ``k0`` and columns ``n0`` (in-kernel).

    Rows past K and columns past N read as zero. Returns ``(tile, k_major)``: ``tile``
    is ``[bk, bn]`` when ``k_major`` else ``[bn, bk]`` (the stored, out-major order of
    the quantized layouts), in ``dtype``.
    """
    ks = k0 + jnp.arange(bk, dtype=jnp.int32)
    ns = n0 + jnp.arange(bn, dtype=jnp.int32)
    if layout.kind == "dense":
        (w_ref,) = refs
        m = (ks < layout.k)[:, None] & (ns < layout.n)[None, :]
        t = plgpu.load(w_ref.at[e, pl.ds(k0, bk), pl.ds(n0, bn)], mask=m, other=0)
        return t.astype(dtype), True
    if layout.kind in GGUF_BLOCKS:
        return gguf.load_tile(layout.kind, layout.k, layout.n, refs[0], e, k0, n0, bk, bn, dtype), False
    if layout.kind in FP8_KINDS:
        return load_fp8_tile(layout, refs, e, k0, n0, ns, bk, bn, dtype), False
    g = layout.group_size
    ng = bk // g
    gs = k0 // g + jnp.arange(ng, dtype=jnp.int32)
    nm = (ns < layout.n)[:, None]
    sm = nm & (gs < layout.k // g)[None, :]
    s = plgpu.load(refs[1].at[e, pl.ds(n0, bn), pl.ds(k0 // g, ng)], mask=sm, other=0).astype(jnp.float32)
    if layout.kind == "int8":
        q = load_codes(layout, refs[0], e, n0, ns, k0, bn, bk).astype(jnp.float32)
        w = (q.reshape(bn, ng, g) * s[:, :, None]).reshape(bn, bk)
        return w.astype(dtype), False
    # dequantized per nibble plane (each [bn, bk / 2], in the compute dtype), then interleaved:
    # no float32 [bn, bk] code tile next to the result (fewer live registers, issue 12)
    b = plgpu.load(refs[2].at[e, pl.ds(n0, bn), pl.ds(k0 // g, ng)], mask=sm, other=0).astype(jnp.float32)
    _, planes = code_planes(layout, refs[0], e, n0, ns, k0, bn, bk)
    if len(planes) == 2 and g >= 2:
        sb = [(q.reshape(bn, ng, g // 2) * s[:, :, None] + b[:, :, None]).reshape(bn, bk // 2) for q in planes]
        return interleave([h.astype(dtype) for h in sb]), False
    q = interleave(planes)  # word loads: 8 nibble planes
    w = (q.reshape(bn, ng, g) * s[:, :, None] + b[:, :, None]).reshape(bn, bk)
    return w.astype(dtype), False


def fp8_values(c: jax.Array) -> jax.Array:
    """E4M3 code bytes (int32 0..255) -> their exact float32 values by integer ops (a normal
    code's exponent and mantissa moved into float32's fields, exponent + 120; a subnormal
    one its mantissa times 2^-9; S.1111.111 NaN): the values of ``ml_dtypes.float8_e4m3fn``."""
    mag = c & 0x7F
    normal = jax.lax.bitcast_convert_type((mag << 20) + (120 << 23), jnp.float32)
    v = jnp.where(mag < 8, mag.astype(jnp.float32) * jnp.float32(2.0**-9), normal)
    v = jnp.where(mag == 0x7F, jnp.float32(jnp.nan), v)
    return jnp.where(c >= 128, -v, v)


def load_fp8_tile(layout: WeightLayout, refs, e, k0, n0, ns, bk: int, bn: int, dtype) -> jax.Array:
    """A ``[bn, bk]`` tile of a block-scaled FP8 weight (in-kernel; ``bk`` a multiple of 32,
    the block edge ``b`` too, so each 32 codes share one scale): codes' exact values
    (`fp8_values`) times their block's scale ``s[e, n // b, k // b]``, one rounding.
    Codes past K and rows past N read as zero."""
    b = layout.group_size
    ng = bk // gguf.MIN_BLOCK_K
    q = load_codes(layout, refs[0], e, n0, ns, k0, bn, bk).astype(jnp.int32) & 0xFF  # [bn, bk]
    gk = k0 + gguf.MIN_BLOCK_K * jnp.arange(ng, dtype=jnp.int32)
    rows = jnp.minimum(ns, layout.n - 1) // b
    cols = jnp.minimum(gk, layout.k - 1) // b
    sm = (ns < layout.n)[:, None] & (gk < layout.k)[None, :]
    s = plgpu.load(refs[1].at[e, rows[:, None], cols[None, :]], mask=sm, other=0).astype(jnp.float32)  # [bn, ng]
    w = fp8_values(q).reshape(bn, ng, gguf.MIN_BLOCK_K) * s[:, :, None]
    ks = k0 + jnp.arange(bk, dtype=jnp.int32)
    w = jnp.where((ks < layout.k)[None, :], w.reshape(bn, bk), 0.0)
    return w.astype(dtype)


def split_tf32(a: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``a = hi + lo`` (float32, exact): ``hi`` keeps the sign, exponent and the 10 mantissa
    bits a TensorFloat-32 operand holds, ``lo`` the remainder (the low 13 bits, itself
    within TF32 rounding when multiplied on the tensor cores)."""
    hi = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(a, jnp.uint32) & jnp.uint32(0xFFFFE000), jnp.float32)
    return hi, a - hi


def tile_matmul(x: jax.Array, tile: jax.Array, k_major: bool, tf32: bool = False) -> jax.Array:
    """``x [bm, bk] @ tile`` -> ``[bm, bn]`` float32 (tile ``[bk, bn]`` or ``[bn, bk]``).

    16-bit operands: one tensor-core dot. float32 operands: ``tf32`` takes one TensorFloat-32
    dot (10-bit mantissas); else three (3xTF32, what Triton calls ``tf32x3`` and cuBLAS
    its float32 emulation): with ``x = xh + xl`` and ``t = th + tl`` (`split_tf32`),
    ``xh th + xh tl + xl th`` drops only ``xl tl`` (2^-22 relative) and the TF32 rounding of the
    low parts, so the result is float32-accurate (about 1e-6 relative) on MMA. Triton's
    plain ``ieee`` float32 dot is per-thread FMA over whole K steps and spilled registers at
    every float32 tile size of the table (benchmarks/gpu_compile_check.py). Written out
    here rather than as ``DotAlgorithmPreset.TF32_TF32_F32_X3`` because XLA:CPU (interpret
    mode) refuses that preset; on the CPU each of the three dots is plain float32, so
    interpret mode computes the same sum at (more than) float32 accuracy."""
    dims = (((1,), (0,)), ((), ())) if k_major else (((1,), (1,)), ((), ()))

    def dot(a, b):
        return jax.lax.dot_general(a, b, dims, precision=jax.lax.Precision.DEFAULT, preferred_element_type=jnp.float32)

    if x.dtype != jnp.float32 or tf32:
        return dot(x, tile)
    xh, xl = split_tf32(x)
    th, tl = split_tf32(tile.astype(jnp.float32))
    return dot(xh, th) + (dot(xh, tl) + dot(xl, th))


def code_planes(layout: WeightLayout, ref, e, n0, ns, k0, bn: int, bk: int) -> tuple[int, list[jax.Array]]:
    """The codes of a ``[bn, bk]`` tile as ``m`` planes ``[bn, bk / m]`` without interleaving
    them (in-kernel): plane ``i`` holds the codes of rows ``k0 + m j + i``. Returns ``(m, planes)``
    with float32 planes: int8 codes, int4 values 0..15."""
    if layout.kind == "int8":
        if layout.word == 1:
            q = load_codes(layout, ref, e, n0, ns, k0, bn, bk)
            return 1, [q.astype(jnp.float32)]
        wb = layout.word
        nw = bk // wb
        ws = k0 // wb + jnp.arange(nw, dtype=jnp.int32)
        m = (ns < layout.n)[:, None] & (ws < layout.k // wb)[None, :]
        words = plgpu.load(ref.at[e, pl.ds(n0, bn), pl.ds(k0 // wb, nw)], mask=m, other=0)
        planes = [jnp.right_shift(jnp.left_shift(words, 24 - 8 * i), 24) for i in range(wb)]
        return wb, [p.astype(jnp.float32) for p in planes]
    if layout.word == 1:
        p = load_codes(layout, ref, e, n0, ns, k0 // 2, bn, bk // 2)
        return 2, [(p & 0xF).astype(jnp.float32), (p >> 4).astype(jnp.float32)]
    wb = layout.word
    nw = bk // (2 * wb)
    ws = k0 // (2 * wb) + jnp.arange(nw, dtype=jnp.int32)
    m = (ns < layout.n)[:, None] & (ws < layout.k // (2 * wb))[None, :]
    words = plgpu.load(ref.at[e, pl.ds(n0, bn), pl.ds(k0 // (2 * wb), nw)], mask=m, other=0)
    planes = [jnp.right_shift(words, 4 * i) & 0xF for i in range(2 * wb)]
    return 2 * wb, [p.astype(jnp.float32) for p in planes]


def quant_matvec(layout: WeightLayout, refs, e, k0, n0, bk: int, bn: int, load_x) -> jax.Array:
    """``x[k0 : k0 + bk] @ W[e][k0 : k0 + bk, n0 : n0 + bn]`` -> ``[bn]`` float32 for a
    quantized weight (in-kernel), without dequantizing the tile: per quantization group,
    ``s * sum(x * q) (+ b * sum(x))``. The codes stay in planes (`code_planes`), each
    multiplied by the strided part of ``x`` it pairs with: no interleave, no ``[bn, bk]``
    float tile. ``load_x(start, size, stride)`` loads ``[size]`` float32 entries of ``x``
    (zero past K). Needs the group size to be a multiple of the plane count."""
    g = layout.group_size
    ng = bk // g
    ns = n0 + jnp.arange(bn, dtype=jnp.int32)
    mp, planes = code_planes(layout, refs[0], e, n0, ns, k0, bn, bk)
    per = g // mp  # codes of one group in one plane
    dot = None
    xsum = None
    for i, q in enumerate(planes):
        xi = load_x(k0 + i, bk // mp, mp)  # [bk / m]
        t = (q * xi[None, :]).reshape(bn, ng, per).sum(axis=2)  # [bn, ng]
        dot = t if dot is None else dot + t
        if layout.kind == "int4":
            xs = xi.reshape(ng, per).sum(axis=1)
            xsum = xs if xsum is None else xsum + xs
    gs = k0 // g + jnp.arange(ng, dtype=jnp.int32)
    sm = (ns < layout.n)[:, None] & (gs < layout.k // g)[None, :]
    s = plgpu.load(refs[1].at[e, pl.ds(n0, bn), pl.ds(k0 // g, ng)], mask=sm, other=0).astype(jnp.float32)
    y = dot * s
    if layout.kind == "int4":
        b = plgpu.load(refs[2].at[e, pl.ds(n0, bn), pl.ds(k0 // g, ng)], mask=sm, other=0).astype(jnp.float32)
        y = y + b * xsum[None, :]
    return y.sum(axis=1)


def planes_of(layout: WeightLayout) -> int:
    """Code planes of a quantized layout (`code_planes`): 1, 2, 4 or 8."""
    return (1 if layout.kind == "int8" else 2) * layout.word


def tile_matvec(x: jax.Array, tile: jax.Array, k_major: bool) -> jax.Array:
    """``x [bk] @ tile`` -> ``[bn]`` float32 as a broadcast-multiply and reduction
    (Triton's dot needs 16 rows; a decode program has one)."""
    t = tile.astype(jnp.float32)
    x = x.astype(jnp.float32)
    if k_major:
        return jnp.sum(x[:, None] * t, axis=0)
    return jnp.sum(t * x[None, :], axis=1)

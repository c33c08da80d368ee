"""GGUF block formats as kernel operands: their layout, a pure-jnp decoder, and the
in-kernel tile decode.

A GGUF block tensor keeps the file's bytes: ``[E, N, n_blocks * block_bytes]`` uint8, each
output row a run of blocks along K (`GGUF_BLOCKS`: elements and bytes per block). The
kernels read them in place as uint16 *words* (``[E, N, row_bytes / 2]``, a free bitcast:
every block size and every field offset inside a block is even), so an array of up to
2^32 bytes has element offsets that fit in int32 (Pallas's Triton lowering switches to
64-bit offsets only above 2^32 bytes; DeepSeek-V3's Q6_K down projection, 3.1e9 bytes, is
1.5e9 words).

`load_tile` decodes one ``[bn, bk]`` tile (``bk`` a multiple of 32) of an expert in
registers, in natural K order: Q4_K / Q5_K / Q6_K tiles of 32 or 64 elements (what the kernels use)
load their 32-byte code chunks contiguously and expand each word to the elements whose
codes it holds (broadcast + reshape); other tiles gather each element's code from the word
that holds its byte (element ``k`` of a row sits at a byte offset computed from ``k``
alone; IQ4_NL / IQ4_XS codes become their table values by selects). Each 32 (Q6_K, Q2_K,
Q3_K: 16) elements' scale and min come from the block header. MXFP4's 17-byte blocks can
leave a row an odd number of bytes, so its words view each expert's rows as one run
(`expert_words`, ``[E, N * row_bytes / 2]``) and its tiles gather each code's byte and each
block's E8M0 byte from there (`FLAT_KINDS`).
`dequantize_gguf_blocks` is the pure-jnp reference, bit-exact with
``gguf.quants.dequantize`` (the same float32 operations in the same order); ggml's
``dequantize_row_*`` (ggml-quants.c) define both.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

#: GGUF block kinds kept as their raw block bytes: ``kind -> (elements per block, bytes per block)``
#: (ggml's ``GGML_QUANT_SIZES``).
GGUF_BLOCKS: dict[str, tuple[int, int]] = {
    "q4_0": (32, 18),
    "q4_1": (32, 20),
    "q5_0": (32, 22),
    "q5_1": (32, 24),
    "q4_k": (256, 144),
    "q5_k": (256, 176),
    "q6_k": (256, 210),
    "q2_k": (256, 84),
    "q3_k": (256, 110),
    "iq4_nl": (32, 18),
    "iq4_xs": (256, 136),
    "mxfp4": (32, 17),
    "iq2_xxs": (256, 66),
    "iq2_xs": (256, 74),
    "iq2_s": (256, 82),
    "iq3_xxs": (256, 98),
    "iq3_s": (256, 110),
    "iq1_s": (256, 50),
    "iq1_m": (256, 56),
    "tq1_0": (256, 54),
    "tq2_0": (256, 66),
}
#: The grid kinds (IQ2 / IQ3 / IQ1: groups of 4 or 8 elements picked from a lattice by an
#: index, with sign bits) and the ternary kinds (TQ1_0 / TQ2_0): decoded by
#: `dequantize_gguf_blocks` only (the Pallas impl decodes them with XLA before its kernels).
GRID_KINDS: tuple[str, ...] = ("iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m")
TERNARY_KINDS: tuple[str, ...] = ("tq1_0", "tq2_0")
#: Elements sharing one scale (and min) inside a block: the granularity of `load_tile`, for
#: the kinds it decodes in-kernel (`TILE_KINDS`).
SCALE_GROUP: dict[str, int] = {
    "q4_0": 32,
    "q4_1": 32,
    "q5_0": 32,
    "q5_1": 32,
    "q4_k": 32,
    "q5_k": 32,
    "q6_k": 16,
    "q2_k": 16,
    "q3_k": 16,
    "iq4_nl": 32,
    "iq4_xs": 32,
    "mxfp4": 32,
}
#: GGUF block kinds `load_tile` decodes in-kernel.
TILE_KINDS: tuple[str, ...] = tuple(SCALE_GROUP)
#: Kinds whose words view each expert's bytes as one run (``[E, N * row_bytes / 2]``, `expert_words`):
#: MXFP4's 17-byte blocks leave a row an odd number of bytes.
FLAT_KINDS: tuple[str, ...] = ("mxfp4",)
#: IQ4_NL / IQ4_XS code -> value (ggml's ``kvalues_iq4nl``).
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
#: MXFP4 code -> twice its E2M1 value (ggml's ``kvalues_mxfp4``; the block scale is halved to match).
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
#: Smallest K step of a tile (a multiple of every `SCALE_GROUP`).
MIN_BLOCK_K = 32


def check_block_tensor(name: str, kind: str, qdata, scales, biases, group_size: int, extra_dtypes=()) -> None:
    """ValueError naming ``name``, the type and the shapes unless ``qdata`` is well-formed
    block bytes of ``kind`` (uint8, or one of ``extra_dtypes``, ``[..., out, n_blocks *
    block_bytes]``), with no separate scales / biases and ``group_size`` the block size.
    Without a shape (a sentinel under a transform) only the metadata is checked."""
    block, block_bytes = GGUF_BLOCKS[kind]
    where = f"{name} ({kind.upper()}, block {block} in {block_bytes} bytes)"
    if scales is not None or biases is not None:
        raise ValueError(f"{where}: GGUF blocks keep their scales inside the blocks; scales/biases must be None")
    if group_size != block:
        raise ValueError(f"{where}: group_size must be the block size {block}, got {group_size}")
    shape = getattr(qdata, "shape", None)
    if shape is None:
        return
    if len(shape) < 2:
        raise ValueError(f"{where}: block bytes must be [..., out, n_blocks * {block_bytes}], got shape {tuple(shape)}")
    dt = getattr(qdata, "dtype", None)
    if dt is not None and np.dtype(dt) not in (np.uint8, *extra_dtypes):
        raise ValueError(f"{where}: block bytes must be uint8, got {dt} of shape {tuple(shape)}")
    if shape[-1] % block_bytes:
        raise ValueError(
            f"{where}: rows of {shape[-1]} bytes (shape {tuple(shape)}) are not a whole number of "
            f"{block_bytes}-byte blocks (truncated or wrong-sized block buffer)"
        )


def as_words(raw: jax.Array) -> jax.Array:
    """Block bytes ``[..., R]`` uint8 (``R`` even) -> ``[..., R / 2]`` uint16, little-endian."""
    *lead, r = raw.shape
    return jax.lax.bitcast_convert_type(raw.reshape(*lead, r // 2, 2), jnp.uint16)


def expert_words(raw: jax.Array) -> jax.Array:
    """Block bytes ``[E, N, R]`` uint8 (``N R`` even) -> each expert's bytes as one run of
    uint16 words ``[E, N R / 2]`` (`FLAT_KINDS`): a free bitcast whatever the parity of ``R``."""
    e, n, r = raw.shape
    return as_words(raw.reshape(e, n * r))


def words_to_bytes(words: jax.Array) -> jax.Array:
    """The inverse of `as_words`: ``[..., W]`` uint16 -> ``[..., 2 W]`` uint8."""
    b = jax.lax.bitcast_convert_type(words, jnp.uint8)
    return b.reshape(*words.shape[:-1], words.shape[-1] * 2)


# ----------------------------------------------------------------------------- pure-jnp reference


def _f16(b) -> jax.Array:
    """``[..., 2]`` uint8 (little-endian) -> ``[...]`` float32 via float16."""
    return jax.lax.bitcast_convert_type(b, jnp.float16).astype(jnp.float32)


def _k_scale_min(s) -> tuple[jax.Array, jax.Array]:
    """Q4_K / Q5_K 12 packed scale bytes ``[..., 12]`` -> 6-bit scales and mins ``[..., 8]``."""
    d, m, m_d = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = jnp.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = jnp.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _nibbles(qs, chunk: int) -> jax.Array:
    """``[..., n * chunk]`` bytes -> ``[..., n * 2 * chunk]``: per chunk of bytes, its low
    nibbles then its high nibbles (ggml's order)."""
    q = qs.reshape(*qs.shape[:-1], -1, 1, chunk) >> jnp.array([0, 4], jnp.uint8).reshape(2, 1)
    return (q & 0x0F).reshape(*qs.shape[:-1], -1)


def _bits(qh, n_bits: int, width: int, step: int = 1) -> jax.Array:
    """Bit-planes ``[..., n_bits * width]``: plane ``i`` is ``(qh >> step*i) & mask`` over ``width`` bytes."""
    sh = jnp.arange(0, n_bits * step, step, dtype=qh.dtype).reshape(n_bits, 1)
    return (qh.reshape(*qh.shape[:-1], -1, 1, width) >> sh).reshape(*qh.shape[:-1], -1)


def dequantize_gguf_blocks(b: jax.Array, kind: str) -> jax.Array:
    """GGUF blocks ``[..., block_bytes]`` uint8 -> float32 ``[..., block]``, bit-exact with
    ``gguf.quants.dequantize`` (same float32 operations in the same order)."""
    f32 = jnp.float32
    if kind in ("q4_1", "q5_0", "q5_1"):
        d = _f16(b[..., 0:2])[..., None]
        o = 4 if kind == "q5_1" else 2
        m = _f16(b[..., 2:4])[..., None]  # Q5_0 has no min: these bytes are its qh, unused as m
        if kind == "q4_1":
            q = _nibbles(b[..., 4:20], 16).astype(f32)
            return d * q + m
        qh = jax.lax.bitcast_convert_type(b[..., o : o + 4], jnp.uint32)[..., None]
        hi = ((qh >> jnp.arange(32, dtype=jnp.uint32)) & 1).astype(jnp.uint8)
        ql = _nibbles(b[..., o + 4 : o + 20], 16)
        q = ql | (hi << 4)
        if kind == "q5_0":
            return d * (q.astype(jnp.int8) - jnp.int8(16)).astype(f32)
        return d * q.astype(f32) + m
    if kind in ("q4_k", "q5_k"):
        d = _f16(b[..., 0:2])[..., None]
        dmin = _f16(b[..., 2:4])[..., None]
        sc, mn = _k_scale_min(b[..., 4:16])
        ds = (d * sc.astype(f32))[..., None]  # [..., 8, 1]
        dm = (dmin * mn.astype(f32))[..., None]
        if kind == "q4_k":
            q = _nibbles(b[..., 16:144], 32)
        else:
            ql = _nibbles(b[..., 48:176], 32)
            qh = _bits(b[..., 16:48], 8, 32) & 0x01
            q = ql | (qh << 4)
        q = q.reshape(*b.shape[:-1], 8, 32).astype(f32)
        return (ds * q - dm).reshape(*b.shape[:-1], 256)
    if kind == "q6_k":
        ql = _nibbles(b[..., 0:128], 64)  # [..., 256]: per 64-byte half, low then high nibbles
        qh = _bits(b[..., 128:192], 4, 32, step=2) & 0x03  # [..., 256]
        sc = jax.lax.bitcast_convert_type(b[..., 192:208], jnp.int8).astype(f32)
        d = _f16(b[..., 208:210])[..., None]
        ds = (d * sc)[..., None]  # [..., 16, 1]
        q = (ql | (qh << 4)).astype(jnp.int8) - jnp.int8(32)
        q = q.reshape(*b.shape[:-1], 16, 16).astype(f32)
        return (ds * q).reshape(*b.shape[:-1], 256)
    if kind == "q2_k":  # scales 16 bytes (low nibble: scale, high: min), qs 64, d, dmin
        sc = b[..., 0:16]
        d = _f16(b[..., 80:82])[..., None]
        dmin = _f16(b[..., 82:84])[..., None]
        dl = (d * (sc & 0x0F).astype(f32))[..., None]  # [..., 16, 1]
        ml = (dmin * (sc >> 4).astype(f32))[..., None]
        q = (_bits(b[..., 16:80], 4, 32, step=2) & 0x03).reshape(*b.shape[:-1], 16, 16).astype(f32)
        return (dl * q - ml).reshape(*b.shape[:-1], 256)
    if kind == "q3_k":  # hmask 32 bytes, qs 64, 12 packed 6-bit scales, d
        s = b[..., 96:108]
        sc = (_nibbles(s[..., 0:8], 8) & 0x0F) | ((_bits(s[..., 8:12], 4, 4, step=2) & 0x03) << 4)
        sc = (sc.astype(jnp.int8) - jnp.int8(32)).astype(f32)  # [..., 16]
        dl = (_f16(b[..., 108:110])[..., None] * sc)[..., None]  # [..., 16, 1]
        ql = _bits(b[..., 32:96], 4, 32, step=2) & 0x03
        qh = (_bits(b[..., 0:32], 8, 32) & 0x01) ^ 0x01  # the offset 4 applies where the mask bit is 0
        q = (ql.astype(jnp.int8) - (qh << 2).astype(jnp.int8)).astype(f32).reshape(*b.shape[:-1], 16, 16)
        return (dl * q).reshape(*b.shape[:-1], 256)
    if kind == "q4_0":  # d, 16 bytes of nibbles (low then high): d * (q - 8)
        d = _f16(b[..., 0:2])[..., None]
        return d * (_nibbles(b[..., 2:18], 16).astype(jnp.int8) - jnp.int8(8)).astype(f32)
    if kind == "iq4_nl":  # d, 16 bytes of nibbles (low then high) indexing the non-linear table
        d = _f16(b[..., 0:2])[..., None]
        q = jnp.asarray(IQ4_VALUES, jnp.int8)[_nibbles(b[..., 2:18], 16)].astype(f32)
        return d * q
    if kind == "iq4_xs":  # d, scales_h u16, scales_l 4 bytes, qs 128: 8 sub-blocks of 32, 6-bit scales
        d = _f16(b[..., 0:2])[..., None]
        sh = jax.lax.bitcast_convert_type(b[..., 2:4], jnp.uint16)[..., None]
        sh = ((sh >> jnp.arange(0, 16, 2, dtype=jnp.uint16)).astype(jnp.uint8)) & 0x03
        sl = (b[..., 4:8, None] >> jnp.array([0, 4], jnp.uint8)).reshape(*b.shape[:-1], 8) & 0x0F
        sc = (sl | (sh << 4)).astype(jnp.int8) - jnp.int8(32)
        dl = (d * sc.astype(f32))[..., None]  # [..., 8, 1]
        q = jnp.asarray(IQ4_VALUES, jnp.int8)[_nibbles(b[..., 8:136], 16)].astype(f32)
        return (dl * q.reshape(*b.shape[:-1], 8, 32)).reshape(*b.shape[:-1], 256)
    if kind == "mxfp4":
        return _mxfp4(b)
    if kind in GRID_KINDS:
        return _grid_kind(b, kind)
    if kind in TERNARY_KINDS:
        return _ternary(b, kind)
    raise ValueError(f"dequantize_gguf_blocks: unknown GGUF block kind {kind!r}; expected one of {sorted(GGUF_BLOCKS)}")


def _mxfp4(b) -> jax.Array:
    """MXFP4 blocks ``[..., 17]`` (an E8M0 exponent ``e``, 16 bytes of E2M1 nibbles, low then
    high) -> float32 ``[..., 32]``: ``v * 2^(e - 128)`` with ``v`` the doubled E2M1 value.

    Every such product is exact in float32 (two significant bits) or overflows to
    infinity, but for small ``e`` it is subnormal, which XLA:CPU flushes to zero in float
    arithmetic; so the float32 bits are assembled with integer ops: ``v``'s own exponent
    field moved by ``e - 128``, a subnormal result shifted into place, an overflow infinity.
    Bit-exact with ``gguf.quants.dequantize``'s ``d * v`` (``d`` = ggml's
    ``e8m0_to_fp32_half``).
    """
    v = jnp.asarray(MXFP4_VALUES, jnp.float32)[_nibbles(b[..., 1:17], 16)]
    bits = jax.lax.bitcast_convert_type(v, jnp.uint32)
    sign, mant = bits & jnp.uint32(0x80000000), bits & jnp.uint32(0x007FFFFF)
    ex = (bits >> 23 & 0xFF).astype(jnp.int32) + b[..., 0:1].astype(jnp.int32) - 128  # the product's exponent field
    sub = (mant | jnp.uint32(0x00800000)) >> jnp.clip(1 - ex, 0, 31).astype(jnp.uint32)  # exact: low bits are 0
    mag = jnp.where(ex >= 255, jnp.uint32(0x7F800000), jnp.where(ex >= 1, ex.astype(jnp.uint32) << 23 | mant, sub))
    out = jax.lax.bitcast_convert_type(sign | mag, jnp.float32)
    return jnp.where(v == 0, jnp.float32(0), out)


@functools.cache
def grid_tables(kind: str) -> tuple[np.ndarray, np.ndarray, float]:
    """``(grid [n, 4 or 8] float32, ksigns [128] uint8, IQ1 delta)`` of a `GRID_KINDS` kind,
    taken from ``gguf.quants`` (its ``init_grid`` unpacks ggml's grids from their packed
    hex; ``ksigns``: ggml's ``ksigns_iq2xs``, the 8 sign bits of a 7-bit index, the eighth
    its parity)."""
    from gguf import quants

    cls = getattr(quants, kind.upper())
    cls.init_grid()
    assert cls.grid is not None
    grid = np.asarray(cls.grid, np.float32).reshape(cls.grid_shape)
    ksigns = np.frombuffer(quants.IQ2_XXS.ksigns, np.uint8).copy()
    return grid, ksigns, float(quants.IQ1_S.delta)


def _sign_bits(s) -> jax.Array:
    """Sign bytes ``[...]`` -> ``[..., 8]`` float32 ``+1`` / ``-1`` (bit ``j`` set: element ``j`` negative)."""
    bit = (s[..., None] >> jnp.arange(8, dtype=s.dtype)) & 1
    return jnp.where(bit == 0, jnp.float32(1), jnp.float32(-1))


def _u32(b) -> jax.Array:
    """``[..., 4 n]`` uint8 -> ``[..., n]`` uint32, little-endian."""
    return jax.lax.bitcast_convert_type(b.reshape(*b.shape[:-1], -1, 4), jnp.uint32)


def _u16(b) -> jax.Array:
    """``[..., 2 n]`` uint8 -> ``[..., n]`` uint16, little-endian."""
    return jax.lax.bitcast_convert_type(b.reshape(*b.shape[:-1], -1, 2), jnp.uint16)


def _grid_kind(b, kind: str) -> jax.Array:
    """IQ2_XXS / IQ2_XS / IQ2_S / IQ3_XXS / IQ3_S / IQ1_S / IQ1_M blocks ``[..., block_bytes]``
    -> float32 ``[..., 256]``, the float32 operations of ``gguf.quants``' decoders in their
    order (ggml's ``dequantize_row_iq*``): a scale per 16 or 32 elements, grid rows of 4 or 8
    values picked by an index, signs (IQ2 / IQ3) or a shift ``+-delta`` (IQ1)."""
    f32 = jnp.float32
    lead = b.shape[:-1]
    grid_np, ksigns_np, delta = grid_tables(kind)
    grid, ksigns = jnp.asarray(grid_np), jnp.asarray(ksigns_np)
    if kind in ("iq2_xxs", "iq3_xxs"):  # per 32: 4 sign indices of 7 bits and a 4-bit scale in a uint32
        d = _f16(b[..., 0:2])[..., None]
        if kind == "iq2_xxs":
            qs = _u32(b[..., 2:66]).reshape(*lead, 8, 2)
            idx, aux = jax.lax.bitcast_convert_type(qs[..., 0], jnp.uint8), qs[..., 1]  # [.., 8, 4], [.., 8]
            half = f32(0.25)
        else:
            idx, aux = b[..., 2:66].reshape(*lead, 8, 8), _u32(b[..., 66:98])
            half = f32(0.5)
        db = (d * (f32(0.5) + (aux >> 28).astype(f32)) * half)[..., None, None]  # [.., 8, 1, 1]
        si = (aux[..., None] >> jnp.array([0, 7, 14, 21], jnp.uint32)) & 0x7F  # [.., 8, 4]
        signs = _sign_bits(ksigns[si])  # [.., 8, 4, 8]
        g = grid[idx].reshape(*lead, 8, 4, 8)
        return (db * g * signs).reshape(*lead, 256)
    if kind == "iq2_xs":  # per 8: a uint16 (9-bit grid index, 7-bit sign index); a 4-bit scale per 16
        d = _f16(b[..., 0:2])[..., None]
        qs = _u16(b[..., 2:66])  # [.., 32]
        sc = _nibbles(b[..., 66:74], 1)  # [.., 16]: low then high nibble of each byte
        db = (d * (f32(0.5) + sc.astype(f32)) * f32(0.25))[..., None, None]  # [.., 16, 1, 1]
        signs = _sign_bits(ksigns[qs >> 9]).reshape(*lead, 16, 2, 8)
        g = grid[qs & 511].reshape(*lead, 16, 2, 8)
        return (db * g * signs).reshape(*lead, 256)
    if kind == "iq2_s":  # qs (low 8 index bits), signs, qh (2 high bits per 8), scales per 16
        d = _f16(b[..., 0:2])[..., None]
        sc = _nibbles(b[..., 74:82], 1)
        db = (d * (f32(0.5) + sc.astype(f32)) * f32(0.25))[..., None, None]
        signs = _sign_bits(b[..., 34:66]).reshape(*lead, 16, 2, 8)
        qh = _bits(b[..., 66:74], 4, 1, step=2).reshape(*lead, 8, 4).reshape(*lead, 32) & 3
        idx = b[..., 2:34].astype(jnp.uint16) | (qh.astype(jnp.uint16) << 8)
        g = grid[idx].reshape(*lead, 16, 2, 8)
        return (db * g * signs).reshape(*lead, 256)
    if kind == "iq3_s":  # qs (low 8 index bits of 64 groups of 4), qh (bit 8), signs per 8, scales per 32
        d = _f16(b[..., 0:2])[..., None]
        sc = _nibbles(b[..., 106:110], 1)  # [.., 8]
        db = (d * (1 + 2 * sc).astype(f32))[..., None, None]  # [.., 8, 1, 1]
        signs = _sign_bits(b[..., 74:106]).reshape(*lead, 8, 4, 8)
        qh = _bits(b[..., 66:74], 8, 1).reshape(*lead, 64) & 1
        idx = b[..., 2:66].astype(jnp.uint16) | (qh.astype(jnp.uint16) << 8)
        g = grid[idx].reshape(*lead, 8, 4, 8)
        return (db * g * signs).reshape(*lead, 256)
    if kind == "iq1_s":  # qs (low 8 index bits), per 32 a uint16: 3 index bits per 8, scale, delta sign
        d = _f16(b[..., 0:2])[..., None]
        qh = _u16(b[..., 34:50])  # [.., 8]
        dl = (d * (2 * ((qh >> 12) & 7) + 1).astype(f32))[..., None, None]  # [.., 8, 1, 1]
        dd = jnp.where((qh & 0x8000) == 0, f32(delta), f32(-delta))[..., None, None]
        hi = ((qh[..., None] >> jnp.array([0, 3, 6, 9], jnp.uint16)) & 7).reshape(*lead, 32)
        idx = b[..., 2:34].astype(jnp.uint16) | (hi << 8)
        g = grid[idx].reshape(*lead, 8, 4, 8)
        return (dl * (g + dd)).reshape(*lead, 256)
    # iq1_m: qs 32, qh 16 (a nibble per 8: 3 index bits, the delta sign), 4 uint16 holding
    # 3-bit scales per 16 and, in their top nibbles, the float16 d
    sw = _u16(b[..., 48:56])  # [.., 4]
    dbits = (sw & 0xF000) >> jnp.array([12, 8, 4, 0], jnp.uint16)
    dbits = dbits[..., 0] | dbits[..., 1] | dbits[..., 2] | dbits[..., 3]
    d = jax.lax.bitcast_convert_type(dbits, jnp.float16).astype(f32)[..., None]
    sc = ((sw[..., None] >> jnp.array([0, 3, 6, 9], jnp.uint16)) & 7).reshape(*lead, 16)
    dl = (d * (2 * sc + 1).astype(f32)).reshape(*lead, 8, 2, 1, 1)
    qh = _nibbles(b[..., 32:48], 1)  # [.., 32]: low then high nibble of each byte
    idx = b[..., 0:32].astype(jnp.uint16) | ((qh & 7).astype(jnp.uint16) << 8)
    dd = jnp.where((qh & 8) == 0, f32(delta), f32(-delta)).reshape(*lead, 8, 2, 2, 1)
    g = grid[idx].reshape(*lead, 8, 2, 2, 8)
    return (dl * (g + dd)).reshape(*lead, 256)


def _ternary(b, kind: str) -> jax.Array:
    """TQ1_0 / TQ2_0 blocks -> float32 ``[..., 256]``: ``d * t`` with ``t`` in {-1, 0, 1}.
    TQ2_0: 2-bit codes (``t + 1``), four planes of each 32 bytes. TQ1_0: five trits per
    byte in base 3 scaled to 256 (48 bytes: 32 + 16 of five trits, 4 of four), trit ``i``
    the top of ``(byte * 3^i mod 256) * 3``, as ggml's ``dequantize_row_tq1_0``."""
    lead = b.shape[:-1]
    if kind == "tq2_0":
        d = _f16(b[..., 64:66])[..., None]
        q = _bits(b[..., 0:64], 4, 32, step=2) & 3
    else:
        d = _f16(b[..., 52:54])[..., None]

        def trits(x, n: int) -> jax.Array:  # [.., w] -> [.., n * w]: per power of 3, every byte
            pw = jnp.array([1, 3, 9, 27, 81][:n], jnp.uint8).reshape(n, 1)
            return (x[..., None, :] * pw).reshape(*lead, -1)  # uint8: wraps mod 256 as ggml's

        q = jnp.concatenate([trits(b[..., 0:32], 5), trits(b[..., 32:48], 5), trits(b[..., 48:52], 4)], axis=-1)
        q = (q.astype(jnp.uint16) * 3) >> 8
    return d * (q.astype(jnp.int8) - jnp.int8(1)).astype(jnp.float32)


def dequantize_gguf_rows(raw: jax.Array, kind: str) -> jax.Array:
    """Rows of GGUF blocks ``[..., out, n_blocks * block_bytes]`` uint8 -> float32 ``[..., out, in]``."""
    block, block_bytes = GGUF_BLOCKS[kind]
    *lead, out, row = raw.shape
    nb = row // block_bytes
    w = dequantize_gguf_blocks(raw.reshape(*lead, out, nb, block_bytes), kind)
    return w.reshape(*lead, out, nb * block)


# ----------------------------------------------------------------------------- in-kernel decode


def _half(words: jax.Array) -> jax.Array:
    """uint16 words holding float16 bits -> float32."""
    return jax.lax.bitcast_convert_type(words, jnp.float16).astype(jnp.float32)


def _iq4_value(q: jax.Array) -> jax.Array:
    """IQ4 codes 0..15 (int32) -> their `IQ4_VALUES` as float32, by selects (no table in a
    Triton kernel)."""
    v = jnp.full(q.shape, float(IQ4_VALUES[0]), jnp.float32)
    for i, val in enumerate(IQ4_VALUES[1:], 1):
        v = jnp.where(q == i, jnp.float32(val), v)
    return v


def _mxfp4_bits(q: jax.Array, ex8: jax.Array) -> jax.Array:
    """MXFP4 codes ``q`` (int32 0..15) and their block's E8M0 byte ``ex8`` (int32, broadcast)
    -> float32 ``v * 2^(e - 128)`` (``v`` the doubled E2M1 value, `MXFP4_VALUES`), assembled
    with integer ops as `_mxfp4` does (no float32 subnormal arithmetic, which XLA:CPU flushes):
    bit-exact with `dequantize_gguf_blocks` (``v = 0`` gives +0)."""
    m = q & 7
    v = jnp.where(m < 5, m, jnp.where(m == 5, 6, jnp.where(m == 6, 8, 12))).astype(jnp.float32)  # exact
    bits = jax.lax.bitcast_convert_type(v, jnp.uint32)
    mant = bits & jnp.uint32(0x007FFFFF)
    ex = (bits >> 23).astype(jnp.int32) + ex8 - 128  # v >= 0: no sign bit in `bits`
    sub = (mant | jnp.uint32(0x00800000)) >> jnp.clip(1 - ex, 0, 31).astype(jnp.uint32)
    mag = jnp.where(ex >= 255, jnp.uint32(0x7F800000), jnp.where(ex >= 1, ex.astype(jnp.uint32) << 23 | mant, sub))
    sign = jnp.where(q >= 8, jnp.uint32(0x80000000), jnp.uint32(0))
    out = jax.lax.bitcast_convert_type(sign | mag, jnp.float32)
    return jnp.where(m == 0, jnp.float32(0), out)


def _load_mxfp4_tile(k_total: int, n_total: int, ref, e, k0, n0, bk: int, bn: int, dtype) -> jax.Array:
    """`load_tile` for MXFP4: ``ref`` is each expert's bytes as one run of uint16 words
    ``[E, N * row_bytes / 2]`` (`expert_words`); element ``k`` of row ``n`` is nibble
    ``k % 32 // 16`` of byte ``n row_bytes + 17 (k // 32) + 1 + k % 16``, its block's E8M0
    exponent byte ``n row_bytes + 17 (k // 32)``. Offsets inside one expert (``N row_bytes``
    bytes: 3.3e7 for gpt-oss-120b's gate_up) fit int32; the expert's own offset is
    ``e * N row_bytes / 2`` words, under 2^31 while the array is under 2^32 bytes (past
    that Pallas's Triton lowering takes 64-bit offsets itself)."""
    row_bytes = k_total // 32 * 17
    n_words = n_total * row_bytes // 2
    ns = n0 + jnp.arange(bn, dtype=jnp.int32)
    n_ok = ns < n_total
    rows = jnp.minimum(ns, n_total - 1)[:, None] * row_bytes  # [bn, 1] byte offset of each row
    t = jnp.arange(bk, dtype=jnp.int32)
    k = k0 + t
    k_ok = k < k_total
    ng = bk // 32
    gk = k0 + 32 * jnp.arange(ng, dtype=jnp.int32)
    g_ok = gk < k_total

    def byte(off, ok):  # byte at offsets off [bn, c] (int32), 0 where masked
        w = plgpu.load(ref.at[e, jnp.minimum(off // 2, n_words - 1)], mask=n_ok[:, None] & ok[None, :], other=0)
        return (w.astype(jnp.int32) >> (8 * (off % 2))) & 0xFF

    code_off = rows + (k // 32 * 17 + 1 + k % 16)[None, :]
    q = (byte(code_off, k_ok) >> (4 * (k % 32 // 16))[None, :]) & 0xF  # [bn, bk]
    ex8 = byte(rows + (gk // 32 * 17)[None, :], g_ok)  # [bn, ng]
    out = _mxfp4_bits(q.reshape(bn, ng, 32), ex8[:, :, None]).reshape(bn, bk)
    return jnp.where(n_ok[:, None] & k_ok[None, :], out, 0.0).astype(dtype)


def load_tile(kind: str, k_total: int, n_total: int, ref, e, k0, n0, bk: int, bn: int, dtype) -> jax.Array:
    """Rows ``n0 .. n0 + bn`` (outputs), elements ``k0 .. k0 + bk`` (inputs) of expert ``e``
    of a GGUF block weight, decoded (in-kernel): ``[bn, bk]`` in ``dtype`` (float32 math).

    ``ref`` is the ``[E, N, row_bytes / 2]`` uint16 word view (`as_words`); ``k0`` a
    multiple of ``bk``, ``bk`` a multiple of `MIN_BLOCK_K` (a tile may cover part of a
    super-block or several blocks). Rows past ``n_total`` and elements past ``k_total``
    read as zero. MXFP4 (`FLAT_KINDS`) takes ``[E, N * row_bytes / 2]`` words (`expert_words`).
    """
    if kind == "mxfp4":
        return _load_mxfp4_tile(k_total, n_total, ref, e, k0, n0, bk, bn, dtype)
    block, block_bytes = GGUF_BLOCKS[kind]
    g = SCALE_GROUP[kind]
    n_words = k_total // block * block_bytes // 2
    ns = n0 + jnp.arange(bn, dtype=jnp.int32)
    n_ok = ns < n_total
    rows = jnp.minimum(ns, n_total - 1)[:, None]  # in bounds even where masked (interpret mode)

    def words(byte_off, ok):
        """The words holding bytes ``byte_off [c]`` of each row: ``[bn, c]`` uint16."""
        w = jnp.minimum(byte_off // 2, n_words - 1)
        return plgpu.load(ref.at[e, rows, w[None, :]], mask=n_ok[:, None] & ok[None, :], other=0)

    def bits(byte_off, shift, width, ok):
        """``width`` bits of each byte at ``byte_off [c]``, from bit ``shift [c]``: ``[bn, c]`` int32."""
        w = words(byte_off, ok).astype(jnp.int32)
        return (w >> (8 * (byte_off % 2) + shift)[None, :]) & ((1 << width) - 1)

    def runs(word0, n_words: int, rep: int):
        """Words ``word0 .. word0 + n_words`` of each row (one contiguous load, which Triton can
        pipeline; none when the tile is past K), each word repeated for the two bytes it holds
        and the run repeated ``rep`` times: ``[bn, rep * 2 * n_words]`` int32, element ``t`` from word
        ``t // 2 % n_words`` (``n_words`` a multiple of 16, a 32-byte chunk of codes)."""
        m = n_ok[:, None] & (k0 + jnp.zeros((1, n_words), jnp.int32) < k_total)
        w = plgpu.load(ref.at[e, pl.ds(n0, bn), pl.ds(word0, n_words)], mask=m, other=0).astype(jnp.int32)
        a = n_words // 16
        w = jnp.broadcast_to(w.reshape(bn, 1, a, 16, 1), (bn, rep, a, 16, 2))
        return w.reshape(bn, rep * a * 32)

    # K-quant codes from contiguous 32-byte chunks when the tile lies in one chunk pair
    # (bk 32 or 64, what the grouped, backward and decode kernels use): element t of a chunk
    # sits in byte t % 32, so each word is loaded once and expanded in registers; the
    # per-element gathers below serve the other tile widths
    kq = kind in ("q4_k", "q5_k", "q6_k") and bk in (32, 64)
    t = jnp.arange(bk, dtype=jnp.int32)
    byte_sh = 8 * (t % 2)  # the byte of its word an element's code sits in
    blk = k0 // block * (block_bytes // 2)  # word offset of the tile's block
    pos = k0 - k0 // block * block  # the tile's position inside it (a scalar `%` fails Triton's lowering)

    # per element of the tile (base, p: for the gathers)
    k = k0 + t
    k_ok = k < k_total
    base = k // block * block_bytes  # byte offset of the element's block
    p = k % block  # position inside the block
    # per scale group of the tile
    ng = bk // g
    gk = k0 + g * jnp.arange(ng, dtype=jnp.int32)
    g_ok = gk < k_total
    gbase = gk // block * block_bytes
    gp = gk % block

    if kind in ("q4_k", "q5_k"):
        qs_at = 16 if kind == "q4_k" else 48
        if kq:  # chunk pos // 64; sub-block pos // 32 + t // 32
            rep = bk // 32
            s = pos // 32 + t // 32
            q = (runs(blk + (qs_at + 32 * (pos // 64)) // 2, 16, rep) >> (4 * (s % 2) + byte_sh)) & 0xF
            if kind == "q5_k":
                q = q | (((runs(blk + 8, 16, rep) >> (s + byte_sh)) & 1) << 4)
        else:
            s = p // 32  # sub-block: codes in chunk s // 2, low nibbles for even s
            q = bits(base + qs_at + 32 * (s // 2) + p % 32, 4 * (s % 2), 4, k_ok)
            if kind == "q5_k":
                q = q | (bits(base + 16 + p % 32, s, 1, k_ok) << 4)
        gs = gp // 32
        u = bits(gbase + 4 + gs, 0, 8, g_ok)  # scales[gs]
        v = bits(gbase + 8 + gs, 0, 8, g_ok)  # scales[gs + 4]
        w = bits(gbase + 4 + jnp.maximum(gs - 4, 0), 0, 8, g_ok)  # scales[gs - 4]
        low = (gs < 4)[None, :]
        sc = jnp.where(low, u & 63, (v & 0xF) | ((w >> 6) << 4))
        mn = jnp.where(low, v & 63, (v >> 4) | ((u >> 6) << 4))
        d = _half(words(gbase, g_ok))
        dmin = _half(words(gbase + 2, g_ok))
        scale, mins = d * sc.astype(jnp.float32), dmin * mn.astype(jnp.float32)
        out = scale[:, :, None] * q.astype(jnp.float32).reshape(bn, ng, g) - mins[:, :, None]
    elif kind == "q6_k":
        if kq:  # half pos // 128; ranges r0 = pos % 128 // 32 (.. r0 + 1): ql chunk r % 2, nibble r // 2
            h0 = pos // 128
            r0 = (pos - 128 * h0) // 32
            rt = r0 + t // 32
            if bk == 32:
                ql = runs(blk + 32 * h0 + 16 * (r0 - r0 // 2 * 2), 16, 1)
            else:  # r0 even: both ql chunks of the half, one nibble
                ql = runs(blk + 32 * h0, 32, 1)
            ql = (ql >> (4 * (rt // 2) + byte_sh)) & 0xF
            qh = (runs(blk + 64 + 16 * h0, 16, bk // 32) >> (2 * rt + byte_sh)) & 3
        else:
            h, r, l = p // 128, p % 128 // 32, p % 32
            ql = bits(base + 64 * h + 32 * (r % 2) + l, 4 * (r // 2), 4, k_ok)
            qh = bits(base + 128 + 32 * h + l, 2 * r, 2, k_ok)
        q = (ql | (qh << 4)) - 32
        sc = bits(gbase + 192 + gp // 16, 0, 8, g_ok)
        sc = jnp.where(sc >= 128, sc - 256, sc)  # int8
        scale = _half(words(gbase + 208, g_ok)) * sc.astype(jnp.float32)
        out = scale[:, :, None] * q.astype(jnp.float32).reshape(bn, ng, g)
    elif kind in (
        "q2_k",
        "q3_k",
    ):  # element p: bits 2 j of qs byte 32 c + l (c, j, l = p // 128, p % 128 // 32, p % 32)
        qs_at = 16 if kind == "q2_k" else 32
        q = bits(base + qs_at + 32 * (p // 128) + p % 32, 2 * (p % 128 // 32), 2, k_ok)
        g16 = gp // 16  # the group's scale index
        if kind == "q2_k":
            sc = bits(gbase + g16, 0, 8, g_ok)
            d = _half(words(gbase + 80, g_ok))
            dmin = _half(words(gbase + 82, g_ok))
            scale, mins = d * (sc & 15).astype(jnp.float32), dmin * (sc >> 4).astype(jnp.float32)
            out = scale[:, :, None] * q.astype(jnp.float32).reshape(bn, ng, g) - mins[:, :, None]
        else:  # Q3_K: the mask bit p // 32 of hmask byte p % 32 set: q, else q - 4; 6-bit signed scales
            q = q - 4 * (1 - bits(base + p % 32, p // 32, 1, k_ok))
            lo = bits(gbase + 96 + g16 % 8, 4 * (g16 // 8), 4, g_ok)
            hi = bits(gbase + 104 + g16 % 4, 2 * (g16 // 4), 2, g_ok)
            scale = _half(words(gbase + 108, g_ok)) * ((lo | (hi << 4)) - 32).astype(jnp.float32)
            out = scale[:, :, None] * q.astype(jnp.float32).reshape(bn, ng, g)
    elif kind == "q4_0":  # d, 16 bytes: element l in nibble l // 16 of byte 2 + l % 16; d * (q - 8)
        q = bits(base + 2 + p % 16, 4 * (p // 16), 4, k_ok)
        d = _half(words(gbase, g_ok))[:, :, None]
        out = d * (q.reshape(bn, ng, g) - 8).astype(jnp.float32)
    elif kind in ("iq4_nl", "iq4_xs"):  # 32 elements per 16 bytes: low nibbles, then high ones
        l = p % 32
        qs = base + (2 if kind == "iq4_nl" else 8 + 16 * (p // 32)) + l % 16
        v = _iq4_value(bits(qs, 4 * (l // 16), 4, k_ok))
        d = _half(words(gbase, g_ok))
        if (
            kind == "iq4_xs"
        ):  # sub-block j: 4 bits from nibble j % 2 of byte 4 + j // 2, 2 from bits 2 j of the u16 at 2
            j = gp // 32
            lo = bits(gbase + 4 + j // 2, 4 * (j % 2), 4, g_ok)
            hi = bits(gbase + 2 + j // 4, 2 * (j % 4), 2, g_ok)
            d = d * ((lo | (hi << 4)) - 32).astype(jnp.float32)
        out = d[:, :, None] * v.reshape(bn, ng, g)
    else:  # q4_1, q5_0, q5_1: blocks of 32, element l in the low nibble of byte l % 16 for l < 16
        qs = base + {"q4_1": 4, "q5_0": 6, "q5_1": 8}[kind] + p % 16
        q = bits(qs, 4 * (p // 16), 4, k_ok)
        if kind != "q4_1":
            qh = base + (2 if kind == "q5_0" else 4) + p // 8  # bit p of the little-endian uint32
            q = q | (bits(qh, p % 8, 1, k_ok) << 4)
        d = _half(words(gbase, g_ok))[:, :, None]
        qf = q.reshape(bn, ng, g)
        if kind == "q5_0":
            out = d * (qf - 16).astype(jnp.float32)
        else:
            out = d * qf.astype(jnp.float32) + _half(words(gbase + 2, g_ok))[:, :, None]
    out = out.reshape(bn, bk)
    return jnp.where(n_ok[:, None] & k_ok[None, :], out, 0.0).astype(dtype)

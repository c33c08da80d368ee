"""The GGUF block codec: GGUF tensor bytes <-> jaxmoe weights, in one place.

Used by the GGUF loader and exporter (`jaxmoe.io.gguf`) and by the offload expert
store (`jaxmoe.offload.store.GGUFStore`), so both decode the same bytes the same way.

GGUF stores a matrix as numpy ``[..., out, in]`` (GGUF lists dims fastest first), with
quantization blocks along ``in``. jaxmoe weights are logical ``[..., in, out]`` (the
``x @ W`` convention), and a `jaxmoe.quant.QuantizedTensor` stores them out-major with
blocks along ``in``: the GGUF layout itself, so Q8_0 maps onto it block by block.

- Q8_0 (32 elements in 34 bytes: f16 ``d``, 32 int8 ``q``; ``w = d * q``) ->
  ``kind="int8"``, group 32, the f16 scales kept as they are.
- Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4 (blocks of 32) and Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS
  (super-blocks of 256) -> a GGUF block `QuantizedTensor` (``kind="q4_0"`` ... ``"mxfp4"``)
  holding the file's block bytes of each row unchanged (`jaxmoe.quant.GGUF_BLOCKS`):
  resident bytes = file bytes. (`q4_0_to_quantized` still gives Q4_0 as an ``int4`` tensor,
  ``scale = d``, ``bias = -8 d``, nibbles repacked to jaxmoe's order; `quantized_to_q4_0`
  writes such a tensor back as Q4_0.)
- F32, F16, BF16, F64 and every other type `gguf.quants.dequantize` handles (MXFP4, IQ*,
  Q2_K, Q3_K, ...) -> a float array, via ``gguf.quants.dequantize`` (so bit-exact with it).

Every quantized mapping is exact: ``QuantizedTensor.dequantize(float32)`` equals
``gguf.quants.dequantize`` bit for bit, and converting back gives the same bytes
(`native_qtype` names the GGUF type a weight is stored in exactly; ``save_gguf(dtype="keep")``
writes each tensor in it).

`matrix_from_gguf` gives host (numpy) weights, as the expert store hands them out;
`weight_from_gguf` gives device (jax) weights in a compute dtype, as the loader builds them.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import gguf
import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

from jaxmoe.quant import FP8_KINDS, GGUF_BLOCKS, QuantizedTensor, dequantize_fp8_numpy, gguf_block_tensor, pack_int4

#: GGUF types kept as raw block bytes (a GGUF block `QuantizedTensor` of the same name, lower case).
BLOCK_TYPES = tuple(QT[k.upper()] for k in GGUF_BLOCKS)
#: GGUF types kept quantized in device memory.
KEPT_QUANTIZED = (QT.Q8_0, *BLOCK_TYPES)
#: GGUF types the reader returns as plain numpy floats.
_PLAIN_FLOATS = (QT.F32, QT.F16, QT.F64)
#: ``save_gguf(dtype=...)`` names.
EXPORT_TYPES = {
    "f32": QT.F32,
    "f16": QT.F16,
    "bf16": QT.BF16,
    "q8_0": QT.Q8_0,
    "q4_0": QT.Q4_0,
    **{qt.name.lower(): qt for qt in BLOCK_TYPES},
}
#: ``save_gguf(dtype=KEEP)``: every matrix in the GGUF type it is stored in exactly (`native_qtype`).
KEEP = "keep"

_Q8_BYTES = GGML_QUANT_SIZES[QT.Q8_0][1]  # 34
_Q4_BYTES = GGML_QUANT_SIZES[QT.Q4_0][1]  # 18
_QK = 32
#: The largest Q4_0 ``|d|`` whose bias ``-8 d`` is still finite in float16 (65504 / 8).
F16_MAX_D_Q4 = 65504.0 / 8


@functools.cache
def can_dequantize(qtype: QT) -> bool:
    """Whether ``gguf.quants.dequantize`` (or the reader itself) gives floats for ``qtype``."""
    if qtype in _PLAIN_FLOATS:
        return True
    _, type_size = GGML_QUANT_SIZES[qtype]
    try:
        gguf.quants.dequantize(np.zeros((1, type_size), np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def dequantize_raw(data: np.ndarray, qtype: QT) -> np.ndarray:
    """Reader data (floats, or uint8 bytes ``[..., row_bytes]``) -> float32 ``[..., out, in]``."""
    if qtype in _PLAIN_FLOATS:
        return np.asarray(data, np.float32)
    return gguf.quants.dequantize(np.asarray(data), qtype).astype(np.float32, copy=False)


def q8_0_to_quantized(raw: np.ndarray) -> QuantizedTensor:
    """Q8_0 bytes ``[..., out, in/32*34]`` -> int8 `QuantizedTensor` (logical ``[..., in, out]``,
    numpy leaves)."""
    raw = np.asarray(raw, np.uint8)
    *lead, out, row = raw.shape
    if row % _Q8_BYTES:
        raise ValueError(f"q8_0_to_quantized: row of {row} bytes is not a whole number of {_Q8_BYTES}-byte blocks")
    nb = row // _Q8_BYTES
    blocks = raw.reshape(*lead, out, nb, _Q8_BYTES)
    d = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0]  # [..., out, nb]
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(*lead, out, nb * _QK)
    return QuantizedTensor(q, d, None, "int8", _QK)


def _q4_0_parts(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_0 bytes ``[..., out, in/32*18]`` -> (jaxmoe-packed nibbles ``[..., out, in/2]``, float32 ``d``)."""
    raw = np.asarray(raw, np.uint8)
    *lead, out, row = raw.shape
    if row % _Q4_BYTES:
        raise ValueError(f"q4_0_to_quantized: row of {row} bytes is not a whole number of {_Q4_BYTES}-byte blocks")
    nb = row // _Q4_BYTES
    blocks = raw.reshape(*lead, out, nb, _Q4_BYTES)
    d = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0].astype(np.float32)  # [..., out, nb]
    qs = blocks[..., 2:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [..., out, nb, 32]: elements 0..15, 16..31
    return pack_int4(codes.reshape(*lead, out, nb * _QK)), d


def _q4_0_tensor(packed: np.ndarray, d: np.ndarray) -> QuantizedTensor:
    """The int4 `QuantizedTensor` of packed nibbles and the file's ``d`` (float16, or float32
    holding float16 values; ``bias = -8 d``, exact in either dtype)."""
    sdt = np.float16 if not d.size or np.abs(d).max() <= F16_MAX_D_Q4 else np.float32
    d = d.astype(sdt, copy=False)
    return QuantizedTensor(packed, d, d * sdt(-8.0), "int4", _QK)


def q4_0_to_quantized(raw: np.ndarray) -> QuantizedTensor:
    """Q4_0 bytes ``[..., out, in/32*18]`` -> int4 `QuantizedTensor` (``scale = d``, ``bias = -8 d``,
    numpy leaves): float16 scales and biases when every ``|d| <= F16_MAX_D_Q4``, else float32."""
    return _q4_0_tensor(*_q4_0_parts(raw))


def quantized_to_q8_0(w: QuantizedTensor) -> np.ndarray | None:
    """The Q8_0 bytes of ``w`` when it is exactly Q8_0 (int8, group 32, f16 scales), else None."""
    if w.kind != "int8" or w.group_size != _QK:
        return None
    s = np.asarray(w.scales, np.float32)
    s16 = s.astype(np.float16)
    if not np.array_equal(s16.astype(np.float32), s, equal_nan=True):
        return None
    q = np.asarray(w.qdata, np.int8)
    *lead, out, n = q.shape
    nb = n // _QK
    blocks = np.concatenate([s16[..., None].view(np.uint8), q.reshape(*lead, out, nb, _QK).view(np.uint8)], axis=-1)
    return np.ascontiguousarray(blocks.reshape(*lead, out, nb * _Q8_BYTES))


def quantized_to_q4_0(w: QuantizedTensor) -> np.ndarray | None:
    """The Q4_0 bytes of ``w`` when it is exactly Q4_0 (int4, group 32, ``bias = -8 scale``,
    f16 scales), else None."""
    if w.kind != "int4" or w.group_size != _QK or w.biases is None:
        return None
    s = np.asarray(w.scales, np.float32)
    b = np.asarray(w.biases, np.float32)
    s16 = s.astype(np.float16)
    if not (np.array_equal(s16.astype(np.float32), s) and np.array_equal(b, -8.0 * s)):
        return None
    packed = np.asarray(w.qdata, np.uint8)
    codes = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)  # [..., out, in]
    *lead, out, n = codes.shape
    nb = n // _QK
    c = codes.reshape(*lead, out, nb, _QK)
    qs = (c[..., :16] | (c[..., 16:] << 4)).astype(np.uint8)
    blocks = np.concatenate([s16[..., None].view(np.uint8), qs], axis=-1)
    return np.ascontiguousarray(blocks.reshape(*lead, out, nb * _Q4_BYTES))


def block_tensor_from_gguf(
    data: np.ndarray, qtype: QT, name: str = "weight", n_in: int | None = None
) -> QuantizedTensor:
    """Block bytes ``[..., out, row_bytes]`` of a `BLOCK_TYPES` tensor -> a GGUF block
    `QuantizedTensor` (numpy leaves, the bytes unchanged). ValueError naming ``name``, the
    type and the shapes for a wrong-sized buffer or a width that is not a multiple of the block."""
    raw = np.asarray(data)
    if raw.dtype != np.uint8:
        raise ValueError(f"{name} ({qtype.name}): block data must be uint8 bytes, got {raw.dtype} of shape {raw.shape}")
    return gguf_block_tensor(raw, qtype.name, n_in=n_in, name=name)


def matrix_from_gguf(data: np.ndarray, qtype: QT, name: str = "weight") -> np.ndarray | QuantizedTensor:
    """One GGUF matrix (reader data, numpy ``[..., out, in]``) -> a host weight ``[..., in, out]``.

    Q8_0 and the `BLOCK_TYPES` (Q4_0 among them) stay quantized (a `QuantizedTensor` with numpy
    leaves); F32 / F16 keep their stored dtype; every other type is dequantized with
    gguf-py to float32. ``name`` appears in errors.
    """
    if qtype in BLOCK_TYPES:
        return block_tensor_from_gguf(data, qtype, name)
    if qtype == QT.Q8_0:
        return q8_0_to_quantized(data)
    w = np.asarray(data) if qtype in (QT.F32, QT.F16) else dequantize_raw(data, qtype)
    return np.ascontiguousarray(np.swapaxes(w, -1, -2))


def weight_from_gguf(data: np.ndarray, qtype: QT, dtype, name: str = "weight"):
    """One GGUF matrix (reader data, numpy ``[..., out, in]``) -> a device weight ``[..., in, out]``.

    The `KEPT_QUANTIZED` types stay quantized (a `QuantizedTensor`); every other type is
    dequantized with gguf-py to float32 and cast to ``dtype``.
    """
    w = matrix_from_gguf(data, qtype, name)
    if isinstance(w, QuantizedTensor):
        return jax.tree.map(jnp.asarray, w)
    return jnp.asarray(np.asarray(w, np.float32).astype(jnp.dtype(dtype)))


# --------------------------------------------------------------------------- reading a file


#: Host buffers given to jax start on this byte boundary: XLA:CPU then uses them in place
#: (``jax.device_put`` of such a numpy array makes no copy on the CPU).
HOST_ALIGN = 64


def aligned_empty(shape, dtype, align: int = HOST_ALIGN) -> np.ndarray:
    """An uninitialized numpy array whose data starts on an ``align``-byte boundary."""
    dt = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    buf = np.empty(n + align, np.uint8)
    off = (-buf.ctypes.data) % align
    return buf[off : off + n].view(dt).reshape(shape)


def pread_into(fd: int, dst: np.ndarray, offset: int, name: str) -> None:
    """Fills the contiguous array ``dst`` with the file's bytes from ``offset``; a short file is
    a ValueError naming ``name``."""
    mv = dst.reshape(-1).view(np.uint8).data
    done = 0
    while done < len(mv):
        n = os.preadv(fd, [mv[done:]], offset + done)
        if n <= 0:
            raise ValueError(f"{name}: the file ends {len(mv) - done} bytes before the tensor's end")
        done += n


@dataclasses.dataclass(frozen=True)
class FileTensor:
    """One tensor of a GGUF file as the loader reads it, without mapping its pages.

    ``data`` is the reader's memory-mapped numpy view ``[..., out, row]`` (its shape and
    dtype; read from only when ``file`` is None); ``file`` / ``offset`` where its bytes lie;
    ``rows`` the ``(start, stop)`` output rows of each matrix to take (a merged gate / up
    tensor), None for all.
    """

    data: np.ndarray
    qtype: QT
    file: str | os.PathLike | None = None
    offset: int = 0
    rows: tuple[int, int] | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The numpy shape of the rows taken: ``[..., rows, row]``."""
        *lead, out, row = self.data.shape
        r0, r1 = self.rows or (0, out)
        return (*lead, r1 - r0, row)

    def matrices(self, name: str):
        """Yields ``(i, m)`` for each matrix ``i`` (leading indices flattened) of the rows taken:
        ``m`` a ``[rows, row]`` array in a buffer reused from one matrix to the next (copy what
        you keep). The bytes come through ``pread``, so the file's pages never count in the
        process's resident memory."""
        *lead, out, row = self.data.shape
        r0, r1 = self.rows or (0, out)
        n_lead = int(np.prod(lead, dtype=np.int64))
        tmp = np.empty((r1 - r0, row), self.data.dtype)
        flat = None if self.file is not None else self.data.reshape(n_lead, out, row)
        fd = os.open(self.file, os.O_RDONLY) if self.file is not None else -1
        try:
            for i in range(n_lead):
                if flat is not None:
                    tmp[...] = flat[i, r0:r1]
                else:
                    pread_into(fd, tmp, self.offset + (i * out + r0) * row * tmp.itemsize, name)
                yield i, tmp
        finally:
            if fd >= 0:
                os.close(fd)

    def read(self, name: str) -> np.ndarray:
        """The rows taken, as a fresh `HOST_ALIGN`-aligned array (read straight into it)."""
        out = aligned_empty(self.shape, self.data.dtype)
        *lead, rows, row = self.shape
        if self.rows is None and self.file is not None:
            fd = os.open(self.file, os.O_RDONLY)
            try:
                pread_into(fd, out, self.offset, name)
            finally:
                os.close(fd)
            return out
        flat = out.reshape(-1, rows, row)
        for i, m in self.matrices(name):
            flat[i] = m
        return out


def host_weight_from_file(t: FileTensor, dtype=None, name: str = "weight") -> np.ndarray | QuantizedTensor:
    """A GGUF matrix read from its file into host buffers that jax can take in place (leaves
    `HOST_ALIGN`-aligned): the `KEPT_QUANTIZED` types as a `QuantizedTensor` (block bytes as
    they are, Q8_0 split matrix by matrix), every other type dequantized matrix by
    matrix and transposed to ``[..., in, out]`` in ``dtype`` (float32 when None). No more
    than one matrix's bytes beyond the result is allocated at a time: a load peaks near the
    bytes it keeps."""
    qt = t.qtype
    *lead, rows, row = t.shape
    if qt in BLOCK_TYPES:
        return block_tensor_from_gguf(t.read(name), qt, name)
    if qt == QT.Q8_0:
        if row % _Q8_BYTES:
            raise ValueError(f"{name}: Q8_0 row of {row} bytes is not a whole number of {_Q8_BYTES}-byte blocks")
        nb = row // _Q8_BYTES
        q = aligned_empty((*lead, rows, nb * _QK), np.int8)
        d = aligned_empty((*lead, rows, nb), np.float16)
        qf, df = q.reshape(-1, rows, nb * _QK), d.reshape(-1, rows, nb)
        for i, m in t.matrices(name):
            blocks = m.reshape(rows, nb, _Q8_BYTES)
            qf[i] = blocks[..., 2:].reshape(rows, nb * _QK).view(np.int8)
            df[i] = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0]
        return QuantizedTensor(q, d, None, "int8", _QK)
    dt = np.dtype(np.float32 if dtype is None else dtype)
    if t.data.dtype == np.uint8:  # bytes of a block type
        block, size = GGML_QUANT_SIZES[qt]
        n_in = row // size * block
    else:
        n_in = row
    res = aligned_empty((*lead, n_in, rows), dt)
    flat = res.reshape(-1, n_in, rows)
    for i, m in t.matrices(name):
        w = np.asarray(dequantize_raw(m, qt), np.float32)  # [rows, in]
        flat[i] = w.T if dt == np.float32 else w.T.astype(dt)
    return res


def to_device(w):
    """Host leaves -> jax arrays: `jax.device_put` (in place on the CPU for aligned buffers)."""
    return jax.tree.map(jax.device_put, w)


def to_numpy_f32(w) -> np.ndarray:
    """A weight ``[..., in, out]`` as float32 numpy (quantized ones dequantized in numpy, so no
    device computation is compiled for an export)."""
    if not isinstance(w, QuantizedTensor):
        return np.asarray(w, np.float32)
    if w.kind in GGUF_BLOCKS:
        v = gguf.quants.dequantize(np.asarray(w.qdata, np.uint8), QT[w.kind.upper()]).astype(np.float32, copy=False)
        return np.swapaxes(v, -1, -2)
    assert w.scales is not None
    if w.kind in FP8_KINDS:
        return np.swapaxes(dequantize_fp8_numpy(w.qdata, w.scales, w.group_size), -1, -2)
    q = np.asarray(w.qdata)
    if w.kind == "int4":
        q = np.stack([q & 0x0F, q >> 4], axis=-1).reshape(*q.shape[:-1], -1)
    q = q.astype(np.float32)
    *lead, out, n = q.shape
    g = w.group_size
    v = q.reshape(*lead, out, n // g, g) * np.asarray(w.scales, np.float32)[..., None]
    if w.biases is not None:
        v = v + np.asarray(w.biases, np.float32)[..., None]
    return np.swapaxes(v.reshape(*lead, out, n), -1, -2)


def native_qtype(w) -> QT:
    """The GGUF type ``w`` is stored in exactly: a GGUF block kind its own type, an int8 /
    int4 `QuantizedTensor` Q8_0 / Q4_0 when it is exactly that, else F32 (F16 / BF16 for
    such float arrays); for ``save_gguf(dtype="keep")``."""
    if isinstance(w, QuantizedTensor):
        if w.kind in GGUF_BLOCKS:
            return QT[w.kind.upper()]
        if quantized_to_q8_0(w) is not None:
            return QT.Q8_0
        if quantized_to_q4_0(w) is not None:
            return QT.Q4_0
        return QT.F32
    dt = np.dtype(getattr(w, "dtype", np.float32))
    return {np.dtype(np.float16): QT.F16, np.dtype(jnp.bfloat16): QT.BF16}.get(dt, QT.F32)


def weight_to_gguf(w, qtype: QT, name: str) -> tuple[np.ndarray, QT | None]:
    """A jaxmoe weight ``[..., in, out]`` -> (data for ``GGUFWriter.add_tensor``, raw_dtype).

    Already-quantized weights that are exactly in ``qtype`` (Q8_0 / Q4_0, or a GGUF block
    kind of that type) are written byte for byte (no second lossy rounding); anything
    else is dequantized and quantized with gguf-py (ValueError naming the tensor when
    gguf-py cannot quantize to ``qtype``, e.g. the K-quants).
    """
    if isinstance(w, QuantizedTensor):
        if w.kind in GGUF_BLOCKS and QT[w.kind.upper()] == qtype:
            return np.ascontiguousarray(np.asarray(w.qdata, np.uint8)), qtype
        direct = quantized_to_q8_0(w) if qtype == QT.Q8_0 else quantized_to_q4_0(w) if qtype == QT.Q4_0 else None
        if direct is not None:
            return direct, qtype
    dense = np.ascontiguousarray(np.swapaxes(to_numpy_f32(w), -1, -2))
    if qtype == QT.F32:
        return dense, None
    if qtype == QT.F16:
        return dense.astype(np.float16), None
    block, _ = GGML_QUANT_SIZES[qtype]
    if dense.shape[-1] % block:
        raise ValueError(
            f"save_gguf: tensor {name} has input dim {dense.shape[-1]}, not a multiple of the "
            f"{qtype.name} block size {block}"
        )
    try:
        return gguf.quants.quantize(dense, qtype), qtype
    except NotImplementedError:
        raise ValueError(
            f"save_gguf: tensor {name} (shape {dense.shape}) cannot be quantized to {qtype.name} by gguf-py; "
            f"only weights already stored as {qtype.name} are written in it (dtype='keep' writes each as stored)"
        ) from None

"""MLX affine quantization (the edge0 expert format): the codec and mlx-lm's per-module lookup.

MLX stores a quantized linear weight ``(..., out, in)`` as ``weight`` uint32
``(..., out, in * bits / 32)`` (element ``j`` of the row occupies bits
``[j * bits, (j + 1) * bits)`` of the little-endian bit stream), with ``scales`` and
``biases`` ``(..., out, in / group_size)`` in the model dtype; the value is
``scale * q + bias`` per group (docs/routing.md, "MLX affine 4-bit"; `mlx.core.quantize` /
`mlx.core.dequantize` are the reference, and the tests compare against them).

For 4 bits the uint32 words viewed as bytes are exactly `jaxmoe.quant.QuantizedTensor`'s
``int4`` layout (low nibble = even element), so `to_quantized_tensor` is a view, not a
repack. Other bit widths (a router at 8 bits, say) are dequantized at load.

`quant_lookup` reads the ``"quantization"`` entry of an mlx-lm ``config.json``
(``{"group_size": 64, "bits": 4, <module path>: {...} | false, ...}``) into a per-module
`QuantSpec`. The safetensors reader (`jaxmoe.io.hf`) uses this module; mlx-lm checkpoint
directories load through `jaxmoe.io.mlx`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxmoe.quant import QuantizedTensor, mlx_affine_quantize_groups

BITS = (2, 3, 4, 5, 6, 8)


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """How one module is quantized: ``bits``, ``group_size`` and MLX ``mode`` (``affine``)."""

    bits: int = 4
    group_size: int = 64
    mode: str = "affine"

    def __post_init__(self):
        if self.bits not in BITS:
            raise ValueError(f"QuantSpec.bits: {self.bits!r} is not one of {BITS}")
        if not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"QuantSpec.group_size: must be a positive int, got {self.group_size!r}")
        if self.mode != "affine":
            raise ValueError(f"QuantSpec.mode: only MLX 'affine' quantization is supported, got {self.mode!r}")


#: module path -> its `QuantSpec`, or None where the module is plain floating point.
QuantLookup = Callable[[str], "QuantSpec | None"]


def _check_packed(w: np.ndarray, scales: np.ndarray, biases: np.ndarray, spec: QuantSpec, name: str) -> int:
    if w.dtype != np.uint32:
        raise ValueError(f"{name}.weight: a quantized weight must be uint32, got {w.dtype}")
    n_in = w.shape[-1] * 32 // spec.bits
    want = (*w.shape[:-1], n_in // spec.group_size)
    if (w.shape[-1] * 32) % spec.bits or n_in % spec.group_size:
        raise ValueError(
            f"{name}.weight: packed width {w.shape[-1]} does not hold whole groups of "
            f"{spec.group_size} at {spec.bits} bits"
        )
    for what, a in (("scales", scales), ("biases", biases)):
        if tuple(a.shape) != want:
            raise ValueError(
                f"{name}.{what} has shape {tuple(a.shape)}, expected {want} "
                f"(weight {tuple(w.shape)}, {spec.bits} bits, group {spec.group_size})"
            )
    return n_in


def unpack_codes(w: np.ndarray, bits: int) -> np.ndarray:
    """uint32 ``[..., n * bits / 32]`` -> uint8 codes ``[..., n]`` (little-endian bit stream)."""
    w = np.ascontiguousarray(w, dtype=np.uint32)
    if bits in (2, 4, 8):
        per = 32 // bits
        shifts = np.arange(per, dtype=np.uint32) * bits
        q = (w[..., None] >> shifts) & np.uint32((1 << bits) - 1)
        return q.reshape(*w.shape[:-1], w.shape[-1] * per).astype(np.uint8)
    by = w.view(np.uint8)  # little-endian host: byte order of the stream
    b = np.unpackbits(by, axis=-1, bitorder="little")
    n = b.shape[-1] // bits
    b = b[..., : n * bits].reshape(*w.shape[:-1], n, bits)
    return (b.astype(np.uint16) << np.arange(bits, dtype=np.uint16)).sum(-1).astype(np.uint8)


def pack_codes(q: np.ndarray, bits: int) -> np.ndarray:
    """uint8 codes ``[..., n]`` -> uint32 ``[..., n * bits / 32]`` (inverse of `unpack_codes`)."""
    q = np.asarray(q)
    if (q.shape[-1] * bits) % 32:
        raise ValueError(f"pack_codes: {q.shape[-1]} codes of {bits} bits do not fill whole uint32 words")
    b = ((q[..., None].astype(np.uint16) >> np.arange(bits, dtype=np.uint16)) & 1).astype(np.uint8)
    by = np.packbits(b.reshape(*q.shape[:-1], q.shape[-1] * bits), axis=-1, bitorder="little")
    return np.ascontiguousarray(by).view(np.uint32)


def dequantize(
    w: np.ndarray, scales: np.ndarray, biases: np.ndarray, spec: QuantSpec, name: str = "weight"
) -> np.ndarray:
    """float32 ``[..., out, in]`` from an MLX packed weight (``scale * q + bias`` in float32)."""
    n_in = _check_packed(w, scales, biases, spec, name)
    q = unpack_codes(w, spec.bits)[..., :n_in].astype(np.float32)
    g = spec.group_size
    q = q.reshape(*q.shape[:-1], n_in // g, g)
    out = q * np.asarray(scales, np.float32)[..., None] + np.asarray(biases, np.float32)[..., None]
    return out.reshape(*w.shape[:-1], n_in)


def to_quantized_tensor(
    w: np.ndarray, scales: np.ndarray, biases: np.ndarray, group_size: int = 64, name: str = "weight"
) -> QuantizedTensor:
    """An MLX 4-bit affine weight ``(..., out, in/8)`` uint32 as a `QuantizedTensor` (a byte view).

    The logical weight is ``[..., in, out]``; scales and biases keep their dtype.
    """
    spec = QuantSpec(4, group_size)
    _check_packed(w, scales, biases, spec, name)
    qdata = np.ascontiguousarray(w, dtype=np.uint32).view(np.uint8)
    return QuantizedTensor(jnp.asarray(qdata), jnp.asarray(scales), jnp.asarray(biases), "int4", group_size)


def from_quantized_tensor(qt: QuantizedTensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A ``kind="int4"`` `QuantizedTensor` as MLX's ``(weight uint32, scales, biases)``."""
    if qt.kind != "int4":
        raise ValueError(f"from_quantized_tensor: needs an int4 QuantizedTensor, got kind {qt.kind!r}")
    q = np.ascontiguousarray(np.asarray(qt.qdata, np.uint8))
    if q.shape[-1] % 4:
        raise ValueError(f"from_quantized_tensor: qdata width {q.shape[-1]} bytes is not a whole number of words")
    return q.view(np.uint32), np.asarray(qt.scales), np.asarray(qt.biases)


def quantize(w: np.ndarray, group_size: int = 64, bits: int = 4) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`mlx.core.quantize` in numpy: ``w (..., out, in)`` -> ``(weight uint32, scales, biases)``.

    4-bit only (the rule of `jaxmoe.quant.mlx_affine_quantize_groups`); scales and
    biases come back in ``w``'s dtype, rounded from float32 as MLX rounds them.
    """
    if bits != 4:
        raise ValueError(f"quantize: only bits=4 is supported, got {bits}")
    w = np.asarray(w)
    if w.ndim < 2 or w.shape[-1] % group_size:
        raise ValueError(f"quantize: weight {w.shape} must be (..., out, in) with in a multiple of {group_size}")
    g = w.astype(np.float32).reshape(*w.shape[:-1], w.shape[-1] // group_size, group_size)
    s, b, q = mlx_affine_quantize_groups(g)
    dt = w.dtype if np.issubdtype(w.dtype, np.floating) or w.dtype.name == "bfloat16" else np.float32
    return pack_codes(q.reshape(w.shape), 4), s.astype(dt), b.astype(dt)


# ----------------------------------------------------------------------------- checkpoints


def quant_lookup(config: dict[str, Any], keys, source: str = "config.json") -> QuantLookup:
    """The `QuantLookup` of an mlx-lm ``config.json`` (``quantization`` with per-module overrides).

    A module is quantized where its ``.scales`` tensor exists (mlx-lm's own rule), with
    the bits and group size of its override entry or of the top level; an override
    ``false`` marks a float module.
    """
    qc = config.get("quantization")
    if qc is None:
        qc = config.get("quantization_config")
    if not isinstance(qc, dict):
        raise ValueError(f"{source}: 'quantization' must be an object, got {type(qc).__name__}")
    keys = set(keys)
    try:
        top = QuantSpec(int(qc.get("bits", 4)), int(qc.get("group_size", 64)), qc.get("mode", "affine"))
    except ValueError as e:
        raise ValueError(f"{source}: quantization: {e}") from None

    def lookup(module: str) -> QuantSpec | None:
        ov = qc.get(module)
        has_scales = f"{module}.scales" in keys
        if ov is False:
            if has_scales:
                raise ValueError(f"{source}: quantization marks {module!r} as float (false) but {module}.scales exists")
            return None
        if isinstance(ov, dict):
            try:
                spec = QuantSpec(
                    int(ov.get("bits", top.bits)), int(ov.get("group_size", top.group_size)), ov.get("mode", top.mode)
                )
            except ValueError as e:
                raise ValueError(f"{source}: quantization[{module!r}]: {e}") from None
            if not has_scales:
                raise ValueError(
                    f"{source}: quantization[{module!r}] says quantized but tensor {module + '.scales'!r} is missing"
                )
            return spec
        if ov is not None and ov is not True:
            raise ValueError(f"{source}: quantization[{module!r}] must be an object or false, got {ov!r}")
        return top if has_scales else None

    return lookup

"""How the C++ custom calls take a weight, shared by the forward (`jaxmoe.impls.cpu.kernel`)
and the backward (`jaxmoe.impls.cpu.backward`): the format numbers (the ``kind_*``
attributes; ``enum Kind`` in ``kernel_common.h``) and `operands`."""

import jax.numpy as jnp

from jaxmoe.quant import FP8_KINDS, GGUF_BLOCKS, QuantizedTensor

FLOAT, INT8, INT4 = 0, 1, 2
#: GGUF block kinds (raw block bytes, `jaxmoe.quant.GGUF_BLOCKS`) -> the kernels' kind number.
GGUF_KINDS = {
    "q4_1": 3,
    "q5_0": 4,
    "q5_1": 5,
    "q4_k": 6,
    "q5_k": 7,
    "q6_k": 8,
    "q2_k": 9,
    "q3_k": 10,
    "iq4_nl": 11,
    "iq4_xs": 12,
    "mxfp4": 13,
    "iq2_xxs": 14,  # iq_kinds.h
    "iq2_xs": 15,
    "iq2_s": 16,
    "iq3_xxs": 17,
    "iq3_s": 18,
    "iq1_s": 19,
    "iq1_m": 20,
    "tq1_0": 21,
    "tq2_0": 22,
    "q4_0": 23,
}
assert set(GGUF_KINDS) <= set(GGUF_BLOCKS)
#: Block-scaled FP8 E4M3 (``kFP8`` in fp8_kind.h; outside the GGUF numbers).
FP8 = 40
#: Every `QuantizedTensor` kind the kernels read -> its kind number.
QUANT_KINDS = {"int8": INT8, "int4": INT4, **GGUF_KINDS, "fp8_e4m3": FP8}
assert set(FP8_KINDS) <= set(QUANT_KINDS)


def operands(w) -> tuple[tuple, int, int]:
    """``((data, scales, qbias), kind, group)`` of one weight: a float array with empty
    scales (kind `FLOAT`, group 0); GGUF blocks as their raw bytes (the scales are inside
    the blocks; group = the block's elements); int8 / int4 codes with their scales and
    biases (empty when absent); block-scaled FP8 as its float8 codes with its block scales
    (group = the block edge). The kind must be one the kernels read (callers check)."""
    empty = jnp.zeros((0,), jnp.float32)
    if not isinstance(w, QuantizedTensor):
        return (w, empty, empty), FLOAT, 0
    if w.kind in GGUF_KINDS:
        return (w.qdata, empty, empty), GGUF_KINDS[w.kind], GGUF_BLOCKS[w.kind][0]
    if w.kind in FP8_KINDS:  # the float8 codes as stored (a bitcast to uint8 made XLA copy them), their scales
        assert w.scales is not None
        return (w.qdata, w.scales, empty), FP8, w.group_size
    scales = w.scales
    assert scales is not None  # int8 / int4 always carry scales
    qb = w.biases if w.biases is not None else jnp.zeros((0,), scales.dtype)
    return (w.qdata, scales, qb), QUANT_KINDS[w.kind], w.group_size

"""Weight-format numbers of the C++ custom calls (the ``kind_*`` attributes), shared by the
forward (`jaxmoe.impls.cpu.kernel`) and the backward (`jaxmoe.impls.cpu.backward`); the
C++ side is ``enum Kind`` in ``kernel_common.h``."""

from jaxmoe.quant import GGUF_BLOCKS

FLOAT, INT8, INT4 = 0, 1, 2
#: GGUF block kinds (raw block bytes, `jaxmoe.quant.GGUF_BLOCKS`) -> the kernels' kind number.
GGUF_KINDS = {"q4_1": 3, "q5_0": 4, "q5_1": 5, "q4_k": 6, "q5_k": 7, "q6_k": 8}
assert set(GGUF_KINDS) == set(GGUF_BLOCKS)

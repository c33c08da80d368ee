"""``impl="cpu"``: the routed experts in one C++ XLA FFI custom call on XLA:CPU.

`jaxmoe.impls.cpu.kernel` holds the JAX side (`experts_cpu`, `supports`), and
`jaxmoe.impls.cpu.build` compiles, caches and registers ``grouped_swiglu.cc``.
"""

from jaxmoe.impls.cpu.build import cpu_kernel_available, cpu_kernel_status
from jaxmoe.impls.cpu.kernel import (
    DOWN_BLOCK,
    UP_BLOCK,
    cpu_layer,
    experts_cpu,
    experts_shared_cpu,
    ggml_problem,
    grouped_swiglu,
    shared_expert_cpu,
    shared_stored_narrow,
    shared_supported,
    supports,
)

__all__ = [
    "DOWN_BLOCK",
    "UP_BLOCK",
    "cpu_kernel_available",
    "cpu_kernel_status",
    "cpu_layer",
    "experts_cpu",
    "experts_shared_cpu",
    "ggml_problem",
    "grouped_swiglu",
    "shared_expert_cpu",
    "shared_stored_narrow",
    "shared_supported",
    "supports",
]

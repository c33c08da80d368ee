"""Execution strategies of the routed experts.

Every strategy is a function ``fn(x [T, d], routing, experts, cfg) -> [T, d]`` (float32):

- `jaxmoe.experts.experts_dense` (``dense``) and `jaxmoe.experts.experts_gather`
  (``gather``): the pure-jnp references;
- `jaxmoe.impls.xla` (``xla``): sorted, tiled grouped SwiGLU in plain XLA ops;
- `jaxmoe.impls.ragged` (``ragged_dot``): `jax.lax.ragged_dot`, for comparison;
- `jaxmoe.impls.cpu` (``cpu``): the C++ XLA FFI kernel for XLA:CPU;
- `jaxmoe.impls.pallas` (``pallas``): the Pallas/Triton kernels of `pallas_kernels`.

`jaxmoe.impls.registry` holds the table of names, `jaxmoe.impls.policy` the
``impl="auto"`` choice, and `jaxmoe.impls.common` the steps the grouped strategies
share (input checks, sorted rows, the weighted combine).
"""

"""Pallas kernels of the MoE hot path, lowered to GPU Triton.

- `gmm`: the grouped-matmul core over a dispatch plan (`jaxmoe.dispatch`), plain `gmm`.
- `swiglu`: fused gate + up projection with the SwiGLU epilogue, rows gathered in-kernel.
- `down`: down projection with bias and routing weight fused, and the deterministic combine.
- `decode`: one program per (token, expert) pair for few tokens.
- `quant`: weight operands and in-kernel dequantization (Q8_0 int8, MLX / Q4_0 4-bit).
- `tuning`: the block-size table; `common`: Triton compiler params, activation, checks.
- `impl`: the ``pallas`` execution strategy registered with `jaxmoe.backends`.

Each kernel has its pure-jnp reference beside it; every wrapper takes ``interpret`` and
``debug`` flags and static block sizes.
"""

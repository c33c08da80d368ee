"""Pallas kernels of the MoE hot path, lowered to GPU Triton.

A standalone kernel package: it imports only JAX and takes plain arrays, static block
sizes and static layouts. The MoE library reaches it through its ``impl="pallas"``
adapter (``impls/pallas.py``), which builds the dispatch plan and turns the model's
weights into kernel operands (float arrays or `quant.QuantWeight`).

- `gmm`: the grouped-matmul core over a dispatch plan (sorted rows, tile visits), plain `gmm`.
- `swiglu`: fused gate + up projection with the SwiGLU epilogue, rows gathered in-kernel.
- `down`: down projection with bias and routing weight fused, and the deterministic combine.
- `decode`: one program per (token, expert) pair for few tokens.
- `backward`: the reverse mode over the same plan (gate/up backward with the SwiGLU
  derivative fused, input gradient against transposed weights, deterministic tgmm).
- `quant`: weight operands (`quant.QuantWeight` for Q8_0 int8, MLX / Q4_0 4-bit) and
  in-kernel dequantization.
- `tuning`: the block-size table; `common`: Triton compiler params, activation, checks.
- `launch`: what the wrappers share: how to launch (`launch.Launch`, `launch.DecodeLaunch`:
  block sizes, Triton knobs, the ``interpret`` / ``debug`` flags), the dispatch plan
  (`launch.Plan`), spec fields, plan operands and tile visits, weight checks, the
  ``pallas_call`` launch.

Each kernel has its pure-jnp reference beside it; every wrapper takes its launch as one
static `launch.Launch`.
"""

"""mlx-lm checkpoint directories: one MoE layer, routed experts kept 4-bit.

An mlx-lm directory is an HF-style directory (``config.json`` + ``*.safetensors``) whose
``config.json`` carries ``"quantization": {"group_size": 64, "bits": 4, <module path>:
{...} | false, ...}`` and whose routed experts use the stacked ``switch_mlp`` layout.
`load_layer` reads it with the safetensors reader of `jaxmoe.io.hf` and the MLX codec of
`jaxmoe.io.mlx_codec`: the routed experts (``...mlp.switch_mlp.{gate,up,down}_proj``)
stay quantized when they are 4-bit affine; the router, selection bias and shared expert
are dequantized to float.

The codec names (`QuantSpec`, `quantize`, `dequantize`, `to_quantized_tensor`, ...) are
re-exported here from `jaxmoe.io.mlx_codec`, where they are defined.
"""

from __future__ import annotations

import os

import jax.numpy as jnp

from jaxmoe.config import MoEConfig
from jaxmoe.io import hf, hf_config
from jaxmoe.io.mlx_codec import (
    BITS,
    QuantLookup,
    QuantSpec,
    dequantize,
    from_quantized_tensor,
    pack_codes,
    quant_lookup,
    quantize,
    to_quantized_tensor,
    unpack_codes,
)
from jaxmoe.params import MoEParams


def load_config(path: str | os.PathLike) -> MoEConfig:
    """The `MoEConfig` of an mlx-lm checkpoint directory (its HF-style config.json fields)."""
    return hf_config.load_config(path)


def load_layer(path: str | os.PathLike, layer: int = 0, dtype=jnp.float32) -> tuple[MoEConfig, MoEParams]:
    """``(MoEConfig, MoEParams)`` of MoE layer ``layer`` of an mlx-lm checkpoint directory.

    Routed experts stay 4-bit (`QuantizedTensor` ``int4``, group from the config, scales
    and biases in their stored dtype); other bit widths, the router and the shared
    expert are dequantized to float (``dtype``; the router to float32).
    """
    return hf.load_layer(path, layer=layer, dtype=dtype, quantized=True)


__all__ = [
    "BITS",
    "QuantLookup",
    "QuantSpec",
    "dequantize",
    "from_quantized_tensor",
    "load_config",
    "load_layer",
    "pack_codes",
    "quant_lookup",
    "quantize",
    "to_quantized_tensor",
    "unpack_codes",
]

"""jaxmoe: Mixture-of-Experts layers of real models in JAX.

Exact routing for every model family (`route`), SwiGLU experts, the Flax NNX
`MoEBlock`, grouped-matmul execution (XLA and Pallas/Triton), and loaders for
GGUF, Hugging Face safetensors and MLX 4-bit checkpoints.
"""

from jaxmoe.backends import available_impls, register_impl, resolve_impl
from jaxmoe.block import MoEBlock
from jaxmoe.config import MoEConfig, RouterConfig, config_from_dict, list_presets, load_config
from jaxmoe.experts import ExpertWeights, SharedWeights, experts_dense, experts_gather, shared_expert
from jaxmoe.layer import MoEParams, init_params, moe_apply
from jaxmoe.quant import QuantizedTensor
from jaxmoe.routing import Routing, route, route_checked, router_logits

__version__ = "0.1.0"


def from_pretrained(path, layer: int = 0, **kwargs):
    """An `MoEBlock` for layer ``layer`` of a GGUF file or an HF / MLX checkpoint directory."""
    from jaxmoe import io as _io

    return _io.from_pretrained(path, layer=layer, **kwargs)


def save_gguf(block, path, layer: int = 0, dtype: str = "f16", **kwargs):
    """Writes ``block`` as layer ``layer`` of a GGUF file with llama.cpp's names and keys."""
    from jaxmoe import io as _io

    return _io.save_gguf(block, path, layer=layer, dtype=dtype, **kwargs)


__all__ = [
    "MoEBlock",
    "MoEConfig",
    "RouterConfig",
    "Routing",
    "MoEParams",
    "ExpertWeights",
    "SharedWeights",
    "QuantizedTensor",
    "route",
    "route_checked",
    "router_logits",
    "moe_apply",
    "init_params",
    "experts_dense",
    "experts_gather",
    "shared_expert",
    "load_config",
    "config_from_dict",
    "list_presets",
    "available_impls",
    "register_impl",
    "resolve_impl",
    "from_pretrained",
    "save_gguf",
]

"""jaxmoe: Mixture-of-Experts layers of real models in JAX.

Exact routing for every model family (`route`), SwiGLU experts, the Flax NNX
`MoEBlock`, grouped-matmul execution (XLA, a C++ kernel for XLA:CPU, Pallas/Triton),
and loaders for GGUF, Hugging Face safetensors and MLX 4-bit checkpoints.

This module is the public facade; the package's own modules never import it. Layout
and import direction: docs/design.md.
"""

from jaxmoe.block import MoEBlock
from jaxmoe.config import MoEConfig, RouterConfig, config_from_dict, list_presets
from jaxmoe.execution import ExecConfig
from jaxmoe.experts import ExpertWeights, SharedWeights, experts_dense, experts_gather, shared_expert
from jaxmoe.host_memory import keep_freed_host_memory
from jaxmoe.impls.policy import resolve_impl
from jaxmoe.impls.registry import available_impls, register_impl
from jaxmoe.io import load_config
from jaxmoe.layer import moe_apply
from jaxmoe.parallel import moe_apply_ep
from jaxmoe.params import MoEParams, init_params
from jaxmoe.pretrained import from_pretrained, save_gguf
from jaxmoe.quant import QuantizedTensor
from jaxmoe.routing import Routing, route, route_checked, router_logits

__version__ = "0.1.0"

__all__ = [
    "ExecConfig",
    "ExpertWeights",
    "MoEBlock",
    "MoEConfig",
    "MoEParams",
    "QuantizedTensor",
    "RouterConfig",
    "Routing",
    "SharedWeights",
    "available_impls",
    "config_from_dict",
    "experts_dense",
    "experts_gather",
    "from_pretrained",
    "init_params",
    "keep_freed_host_memory",
    "list_presets",
    "load_config",
    "moe_apply",
    "moe_apply_ep",
    "register_impl",
    "resolve_impl",
    "route",
    "route_checked",
    "router_logits",
    "save_gguf",
    "shared_expert",
]

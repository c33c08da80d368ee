"""jaxmoe: Mixture-of-Experts layers of real models in JAX.

Exact routing for every model family (`route`), SwiGLU experts, the Flax NNX
`MoEBlock`, routing statistics and traces, grouped-matmul execution (XLA, a C++ kernel for XLA:CPU, Pallas/Triton),
and loaders for GGUF, Hugging Face safetensors and MLX 4-bit checkpoints.

This module is the public facade; the package's own modules never import it. Layout
and import direction: docs/design.md.
"""

from jaxmoe.block import ExpertLoad, MoEBlock
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
from jaxmoe.stats import contiguous_devices, device_load, expert_counts
from jaxmoe.traces import RoutingTrace, TraceError, TraceRecorder, load_routing_trace, save_routing_trace

__version__ = "0.1.0"

__all__ = [
    "ExecConfig",
    "ExpertLoad",
    "ExpertWeights",
    "MoEBlock",
    "MoEConfig",
    "MoEParams",
    "QuantizedTensor",
    "RouterConfig",
    "Routing",
    "RoutingTrace",
    "SharedWeights",
    "TraceError",
    "TraceRecorder",
    "available_impls",
    "config_from_dict",
    "contiguous_devices",
    "device_load",
    "expert_counts",
    "experts_dense",
    "experts_gather",
    "from_pretrained",
    "init_params",
    "keep_freed_host_memory",
    "list_presets",
    "load_config",
    "load_routing_trace",
    "moe_apply",
    "moe_apply_ep",
    "register_impl",
    "resolve_impl",
    "route",
    "route_checked",
    "router_logits",
    "save_gguf",
    "save_routing_trace",
    "shared_expert",
]

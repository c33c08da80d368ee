"""The CPU grouped-SwiGLU kernel (``impl="cpu"``): an XLA FFI custom call in C++.

XLA:CPU copies every expert slice ``W[e]`` before its dot (benchmarks/README.md), so
the plain-XLA path pays a weight copy per touched expert. ``grouped_swiglu.cc`` (beside
this module) reads the selected experts' weights in place instead: tasks over (expert, column
block) with float32 register tiles, on XLA's intra-op thread pool. Everything around
it (routing, sorting the pairs, the shared expert, the weighted combine) stays in XLA.

The C++ source is compiled on first use (`jaxmoe.impls.cpu.build`);
`cpu_kernel_status` says whether it built; ``impl="auto"`` takes it on CPU only when it
did, ``impl="cpu"`` raises with the compiler's message when it did not.

Scope: float32 or bfloat16 expert weights (not `QuantizedTensor`; those go through
``xla``, which dequantizes the touched experts), ``swiglu`` and ``swiglu_oai``,
optional biases, ``weight_on_input``. Gradients: the backward pass is the VJP of the
``gather`` path (a `jax.custom_vjp`; ``xla``'s loop over a traced number of experts
has no reverse mode), so ``jax.grad`` through ``impl="cpu"`` works, at ``gather``'s
speed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxmoe.config import MoEConfig
from jaxmoe.dispatch import plan_dispatch
from jaxmoe.experts import ExpertWeights, experts_gather
from jaxmoe.impls.common import check_inputs, combine, sorted_inputs
from jaxmoe.impls.cpu.build import TARGET, cpu_kernel_status
from jaxmoe.quant import QuantizedTensor
from jaxmoe.routing import Routing


def supports(ew: ExpertWeights, dtype) -> str | None:
    """None when the kernel takes these experts, else why not (for errors and ``auto``)."""
    ws = (ew.w_gate, ew.w_up, ew.w_down)
    if any(isinstance(w, QuantizedTensor) for w in ws):
        return "quantized experts (QuantizedTensor) are not supported by impl='cpu'; use impl='xla'"
    dts = {jnp.dtype(w.dtype) for w in ws}
    if len(dts) != 1 or dts.pop() not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        return f"impl='cpu' takes float32 or bfloat16 expert weights, got {[str(w.dtype) for w in ws]}"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        return f"impl='cpu' takes float32 or bfloat16 activations, got {jnp.dtype(dtype)}"
    if jnp.dtype(dtype) == jnp.bfloat16 and jnp.dtype(ew.w_gate.dtype) == jnp.float32:
        return (
            "impl='cpu' does not round float32 experts to a bfloat16 compute dtype; "
            "store the experts in bfloat16 or use impl='xla'"
        )
    return None


def experts_cpu(x: jax.Array, routing: Routing, ew: ExpertWeights, cfg: MoEConfig) -> jax.Array:
    """Routed experts through the C++ kernel. ``x [T, d]`` -> ``[T, d]`` float32.

    Same contract as `jaxmoe.impls.xla.experts_xla`; the backward pass is ``gather``'s VJP.
    Raises ValueError for unsupported weights and RuntimeError when the kernel could
    not be built.
    """
    check_inputs(x, routing, ew, "experts_cpu")
    why = supports(ew, x.dtype)
    if why:
        raise ValueError(why)
    ok, msg = cpu_kernel_status()
    if not ok:
        raise RuntimeError(f"impl='cpu' is unavailable: {msg}")
    return _experts_cpu(x, routing, ew, cfg)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _experts_cpu(x, routing, ew, cfg):
    return _forward(x, routing, ew, cfg)


def _fwd(x, routing, ew, cfg):
    return _forward(x, routing, ew, cfg), (x, routing, ew)


def _bwd(cfg, res, g):
    x, routing, ew = res
    _, vjp = jax.vjp(lambda x, r, w: experts_gather(x, r, w, cfg), x, routing, ew)
    return vjp(g)


_experts_cpu.defvjp(_fwd, _bwd)


#: Columns of one task: gate/up tasks cover ``UP_BLOCK`` columns of F, down tasks
#: ``DOWN_BLOCK`` columns of d (measured on the Qwen3.6 layer, benchmarks/README.md).
UP_BLOCK = 64
DOWN_BLOCK = 128


@functools.partial(jax.jit, static_argnames=("cfg",))
def _forward(x: jax.Array, routing: Routing, ew: ExpertWeights, cfg: MoEConfig) -> jax.Array:
    t, d = x.shape
    e = ew.num_experts
    plan = plan_dispatch(routing.expert_ids, e, 1)
    xs = sorted_inputs(x, routing, plan, cfg).astype(jnp.float32)  # [P, d]
    biases = ew.biases_f32() or (jnp.zeros((0,), jnp.float32),) * 3
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(xs.shape, jnp.float32), vmap_method="sequential")
    ys = call(
        xs,
        plan.group_offsets[:e].astype(jnp.int32),
        plan.group_sizes.astype(jnp.int32),
        ew.w_gate,
        ew.w_up,
        ew.w_down,
        *biases,
        act=np.int32(0 if cfg.activation == "swiglu" else 1),
        alpha=np.float32(cfg.swiglu_alpha),
        limit=np.float32(cfg.swiglu_limit),
        round_h=np.int32(x.dtype == jnp.bfloat16),
        up_block=np.int32(UP_BLOCK),
        down_block=np.int32(DOWN_BLOCK),
    )
    return combine(ys, routing, plan, cfg)

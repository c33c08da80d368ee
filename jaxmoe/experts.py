"""SwiGLU experts, the shared expert, and the two reference executions.

Weights follow the ``x @ W`` convention:

- routed experts (`ExpertWeights`): ``w_gate, w_up [E, d, F]``, ``w_down [E, F, d]``,
  optional biases ``b_gate, b_up [E, F]``, ``b_down [E, d]``; any weight may be a
  `jaxmoe.quant.QuantizedTensor`.
- shared expert (`SharedWeights`): ``w_gate, w_up [d, Fs]``, ``w_down [Fs, d]`` and an
  optional sigmoid gate vector ``gate [d]``.

`experts_dense` (every expert on every token, masked: the oracle) and
`experts_gather` (the k selected experts of each token only: the decode path) are
the pure-jnp references every faster path is tested against. Both raise a ValueError
for expert ids outside ``[0, E)`` when the routing is concrete; under ``jit`` such a
pair adds exactly zero (docs/routing.md, "Invalid expert ids").
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxmoe.config import MoEConfig
from jaxmoe.dispatch import check_expert_ids, id_valid, replace_invalid
from jaxmoe.execution import ExecConfig
from jaxmoe.ggml_activations import GgmlWeight, ggml_dot, prepare
from jaxmoe.invariance import row_blocks, slot_sum
from jaxmoe.platforms import host_group
from jaxmoe.quant import QuantizedTensor
from jaxmoe.routing import Routing
from pallas_kernels.activation import Activation

_HI = jax.lax.Precision.HIGHEST

#: An expert weight: a float array, or a `QuantizedTensor` that stays quantized.
Weight = jax.Array | QuantizedTensor


def dot_f32(op, a: jax.Array, b: jax.Array, platform: str | None = None) -> jax.Array:
    """``op(a, b)``, a dot that accumulates and returns float32, with operands as
    ``platform`` (a group of `jaxmoe.platforms.GROUPS`, the one the program is lowered
    for; None: the default device's) takes them.

    On the CPU low-precision operands are upcast first (exact): XLA:CPU (jax 0.10) takes
    ``bf16 x bf16 -> f32`` as a YNNPACK fusion, but its bf16 matrix-vector products are
    slower than upcasting (docs/intel.md); `jaxmoe.impls.xla_tiled.batched_mm` keeps bf16
    where rows make it faster. Other platforms accumulate in f32 from the stored dtype.
    """
    if (platform or host_group()) == "cpu" and not (a.dtype == jnp.float32 and b.dtype == jnp.float32):
        return op(a.astype(jnp.float32), b.astype(jnp.float32))
    return op(a, b)


def mm(spec: str, a: jax.Array, b: jax.Array, platform: str | None = None) -> jax.Array:
    """``einsum(spec, a, b)`` accumulated and returned in float32 (`dot_f32`)."""
    return dot_f32(
        lambda a, b: jnp.einsum(spec, a, b, preferred_element_type=jnp.float32, precision=_HI), a, b, platform
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExpertWeights:
    """Routed experts: ``w_gate, w_up [E, d, F]``, ``w_down [E, F, d]``, optional biases."""

    w_gate: Weight
    w_up: Weight
    w_down: Weight
    b_gate: jax.Array | None = None
    b_up: jax.Array | None = None
    b_down: jax.Array | None = None

    @property
    def num_experts(self) -> int:
        return self.w_gate.shape[0]

    @property
    def has_bias(self) -> bool:
        return self.b_gate is not None

    def check(self, cfg: MoEConfig) -> None:
        e, d, f = cfg.num_experts, cfg.d_model, cfg.expert_dim
        want: dict[str, tuple[int, ...]] = {"w_gate": (e, d, f), "w_up": (e, d, f), "w_down": (e, f, d)}
        if cfg.expert_bias:
            want.update(b_gate=(e, f), b_up=(e, f), b_down=(e, d))
        for name, shape in want.items():
            v = getattr(self, name)
            if v is None:
                raise ValueError(f"ExpertWeights.{name} is missing; expected shape {shape}")
            if tuple(v.shape) != shape:
                raise ValueError(f"ExpertWeights.{name} has shape {tuple(v.shape)}, expected {shape}")

    def biases_f32(self) -> tuple[jax.Array, jax.Array, jax.Array] | None:
        """``(b_gate, b_up, b_down)`` in float32, or None when the experts have no biases.

        Raises ValueError when only some of the three are set.
        """
        bs = (self.b_gate, self.b_up, self.b_down)
        if all(b is None for b in bs):
            return None
        if any(b is None for b in bs):
            missing = [n for n, b in zip(("b_gate", "b_up", "b_down"), bs) if b is None]
            raise ValueError(f"ExpertWeights: biases must be all set or all None; missing {missing}")
        bg, bu, bd = (jnp.asarray(b, jnp.float32) for b in bs if b is not None)
        return bg, bu, bd

    def take(self, ids) -> ExpertWeights:
        """The experts ``ids`` (any index), quantized or not."""
        return jax.tree.map(lambda a: a[ids], self, is_leaf=lambda a: hasattr(a, "qdata"))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SharedWeights:
    """Shared expert: ``w_gate, w_up [d, Fs]``, ``w_down [Fs, d]``, gate ``[d]`` or None:
    one SwiGLU of width ``Fs = num_shared_experts * f``, no leading expert axis."""

    w_gate: Weight
    w_up: Weight
    w_down: Weight
    gate: jax.Array | None = None


def activation(g: jax.Array, u: jax.Array, cfg: MoEConfig) -> jax.Array:
    """The elementwise middle of an expert: ``silu(g) * u`` or gpt-oss's clamped form
    (`pallas_kernels.activation.Activation`, the same function the kernels use)."""
    return Activation(cfg.activation, float(cfg.swiglu_alpha), float(cfg.swiglu_limit))(g, u)


def swiglu(x: jax.Array, wg, wu, wd, cfg: MoEConfig, matmul, bias=None, scale=None) -> jax.Array:
    """The SwiGLU body every strategy in XLA ops shares: ``act(x Wg + bg, x Wu + bu) Wd + bd``.

    ``matmul(a, w)`` is the strategy's float32-accumulating product (per expert, batched,
    grouped); ``bias`` None or ``(bg, bu, bd)`` broadcastable to its results; ``scale``
    (optional) multiplies the gate and up products before the biases (the routing weight
    on the input: ``gate(w x) = w (x Wg) + b``). The hidden activation is rounded to
    ``x.dtype`` before the down projection. Weights prepared for ggml arithmetic
    (`jaxmoe.ggml_activations.prepare`) convert each product's activations to their
    format, the hidden activation included (kept float32 in between).
    """
    ggml = isinstance(wd, GgmlWeight)
    if ggml and scale is not None:
        raise ValueError(
            "activations='ggml' with the routing weight on the expert input (weight_on_input): "
            "this strategy scales after the product; use impl 'xla', 'gather' or 'xla_tiled'"
        )
    g = ggml_dot(matmul, x, wg)
    u = ggml_dot(matmul, x, wu)
    if scale is not None:
        g, u = g * scale, u * scale
    if bias is not None:
        g, u = g + bias[0], u + bias[1]
    h = activation(g, u, cfg)
    y = ggml_dot(matmul, h if ggml else h.astype(x.dtype), wd)
    if bias is not None:
        y = y + bias[2]
    return y


def swiglu_ffn(
    x: jax.Array,
    w_gate,
    w_up,
    w_down,
    cfg: MoEConfig,
    bias=None,
    platform: str | None = None,
    activations: str = "float",
) -> jax.Array:
    """One SwiGLU MLP. ``x [T, d]``, ``w_gate, w_up [d, F]``, ``w_down [F, d]`` (quantized
    ones dequantized to ``x.dtype``), ``bias`` None or ``(b_gate, b_up, b_down)``
    float32 -> ``[T, d]`` float32. ``activations``: `jaxmoe.execution.ACTIVATION_MODES`."""
    dt = x.dtype
    wg, wu, wd = (prepare(w, dt, activations) for w in (w_gate, w_up, w_down))
    return swiglu(x, wg, wu, wd, cfg, lambda a, w: mm("mk,kn->mn", a, w, platform), bias)


def shared_expert(
    x: jax.Array,
    sw: SharedWeights | None,
    cfg: MoEConfig,
    *,
    invariant: bool = False,
    platform: str | None = None,
    activations: str = "float",
) -> jax.Array:
    """Shared output ``[T, d]`` float32: ``g * shared(x)``, g = sigmoid(x . gate) or 1.

    ``invariant``: computed on fixed-shape row blocks (`jaxmoe.invariance.row_blocks`),
    so a token's row does not depend on ``T``. ``platform``: the lowering platform group
    (`dot_f32`).
    ``activations``: `jaxmoe.execution.ACTIVATION_MODES`.
    """
    if sw is None:
        return jnp.zeros(x.shape, jnp.float32)
    with jax.named_scope("shared_expert"):
        if invariant:
            return row_blocks(
                lambda xb, sw: shared_expert(xb, sw, cfg, platform=platform, activations=activations), x, sw
            )
        sw = freeze_shared(sw)  # a quantized shared expert is frozen, as routed experts are
        y = swiglu_ffn(x, sw.w_gate, sw.w_up, sw.w_down, cfg, platform=platform, activations=activations)
        if sw.gate is not None:
            y = y * shared_gate(x, sw.gate)
    return y


def shared_frozen(sw: SharedWeights) -> bool:
    """True when any of the shared expert's ``w_gate, w_up, w_down`` is a `QuantizedTensor`:
    then all three are frozen under differentiation (no gradient, as `experts_frozen`
    routed experts); the float ``gate [d]`` is still trained."""
    return any(isinstance(w, QuantizedTensor) for w in (sw.w_gate, sw.w_up, sw.w_down))


def freeze_shared(sw: SharedWeights) -> SharedWeights:
    """``sw`` with its three matrices behind `jax.lax.stop_gradient` when `shared_frozen`
    (the gate vector untouched), else unchanged."""
    if not shared_frozen(sw):
        return sw
    return dataclasses.replace(sw, **{n: jax.lax.stop_gradient(getattr(sw, n)) for n in ("w_gate", "w_up", "w_down")})


def shared_gate(x: jax.Array, gate: jax.Array) -> jax.Array:
    """``sigmoid(x . gate)`` as ``[T, 1]`` float32 (Qwen's shared-expert gate, ``gate [d]``)."""
    g = jnp.dot(x.astype(jnp.float32), gate.astype(jnp.float32), precision=_HI)
    return jax.nn.sigmoid(g)[:, None]


def combine_matrix(routing: Routing, num_experts: int) -> jax.Array:
    """``[T, E]`` float32 combine weights (zero for experts a token did not select; a
    pair with an id outside ``[0, E)`` adds nothing)."""
    t, _ = routing.expert_ids.shape
    ids = replace_invalid(routing.expert_ids, num_experts, num_experts)
    return (
        jnp.zeros((t, num_experts), jnp.float32)
        .at[jnp.arange(t)[:, None], ids]
        .add(routing.weights.astype(jnp.float32), mode="drop")
    )


def experts_dense(
    x: jax.Array, routing: Routing, ew: ExpertWeights, cfg: MoEConfig, ex: ExecConfig | None = None
) -> jax.Array:
    """Every expert on every token, masked: the oracle. ``x [T, d]`` -> ``[T, d]`` float32.

    Memory ``O(T * E * F)``: for tests and small shapes only. ``ex.batch_invariant``:
    on fixed-shape token blocks; ``ex.platform``: the lowering platform group (`dot_f32`).
    """
    ex = ex or ExecConfig()
    platform = ex.group
    e = ew.num_experts
    check_expert_ids(routing.expert_ids, e, "experts_dense", shape=(x.shape[0], None), weights=routing.weights)
    ew = freeze(ew)
    if ex.batch_invariant:  # fixed-shape token blocks
        return row_blocks(lambda xr, ew: _dense(xr[0], xr[1], ew, cfg, platform, ex.activations), (x, routing), ew)
    return _dense(x, routing, ew, cfg, platform, ex.activations)


def _dense(
    x: jax.Array, routing: Routing, ew: ExpertWeights, cfg: MoEConfig, platform: str | None, activations: str
) -> jax.Array:
    dt = x.dtype
    e = ew.num_experts
    comb = combine_matrix(routing, e)  # [T, E]
    ids = replace_invalid(routing.expert_ids, e, e)  # invalid: out of range, dropped
    sel = jnp.zeros(comb.shape, bool).at[jnp.arange(comb.shape[0])[:, None], ids].set(True, mode="drop")
    wg, wu, wd = (prepare(w, dt, activations) for w in (ew.w_gate, ew.w_up, ew.w_down))

    def matmul(a, w):  # [T, d] x [E, d, F] -> [T, E, F], then [T, E, F] x [E, F, d] -> [T, E, d]
        return mm("td,edf->tef" if a.ndim == 2 else "tef,efd->ted", a, w, platform)

    # expert(w * x): gate(w x) = w (x Wg) + b
    y = swiglu(x, wg, wu, wd, cfg, matmul, ew.biases_f32(), comb[..., None] if cfg.weight_on_input else None)
    scale = sel.astype(jnp.float32) if cfg.weight_on_input else comb
    # where() keeps NaN weights of a NaN token from being multiplied away, and keeps
    # unselected experts (whose output may be inf) out of the sum.
    y = jnp.where(sel[..., None], y * scale[..., None], 0.0)
    return y.sum(axis=1)


def experts_gather(
    x: jax.Array, routing: Routing, ew: ExpertWeights, cfg: MoEConfig, ex: ExecConfig | None = None
) -> jax.Array:
    """Per (token, slot) pair, its selected expert only. ``x [T, d]`` -> ``[T, d]`` float32.

    A loop over the ``T * k`` pairs in order; each step takes one expert's weights
    (dequantizing a quantized one) and runs its SwiGLU on one row, so memory is
    ``O(d * F)`` and no ``[T, k, d, F]`` copy is made: the decode path for a handful
    of tokens. Slots are summed per token in slot order. A pair whose id is outside
    ``[0, E)`` (under ``jit``; eagerly it is a ValueError) is skipped and adds zero.
    """
    check_expert_ids(
        routing.expert_ids, ew.num_experts, "experts_gather", shape=(x.shape[0], None), weights=routing.weights
    )
    ex = ex or ExecConfig()
    return _experts_gather(x, routing, freeze(ew), cfg, ex.batch_invariant, ex.group, ex.activations)


@functools.partial(jax.jit, static_argnames=("cfg", "invariant", "platform", "activations"))
def _experts_gather(
    x: jax.Array, routing: Routing, ew: ExpertWeights, cfg: MoEConfig, invariant: bool, platform: str, activations: str
) -> jax.Array:
    dt = x.dtype
    ids, w = routing.expert_ids, routing.weights
    t, k = ids.shape
    p = t * k
    xin = jnp.broadcast_to(x[:, None, :], (t, k, x.shape[1]))
    if cfg.weight_on_input:
        xin = (xin.astype(jnp.float32) * w[..., None]).astype(dt)
    xin = xin.reshape(p, 1, x.shape[1])  # [P, 1, d]
    ok = id_valid(ids, ew.num_experts).reshape(p)
    flat = replace_invalid(ids.reshape(p), ew.num_experts, 0)  # never an index past the weights

    def run(i):
        one = ew.take(flat[i])  # this pair's expert: w_gate [d, F], w_up [d, F], w_down [F, d]
        return swiglu_ffn(xin[i], one.w_gate, one.w_up, one.w_down, cfg, one.biases_f32(), platform, activations)

    def pair(i, ys):
        # an invalid pair (e.g. expert-parallel padding) is not computed
        y = jax.lax.cond(ok[i], run, lambda i: jnp.zeros((1, x.shape[1]), jnp.float32), i)
        return jax.lax.dynamic_update_slice_in_dim(ys, y, i, axis=0)

    ys = jax.lax.fori_loop(0, p, pair, jnp.zeros((p, x.shape[1]), jnp.float32)).reshape(t, k, -1)
    # an invalid pair adds exactly zero; slots in order (batch invariant: one per-pair program)
    scale = None if cfg.weight_on_input else w
    return slot_sum(ys, scale, ok.reshape(t, k), invariant=invariant)


def zero_cotangent(tree):
    """The zero cotangent of a pytree: zeros of each floating leaf's shape and dtype, and
    ``float0`` zeros for integer / bool leaves (what JAX wants for a non-differentiable
    input of a `jax.custom_vjp`)."""

    def zero(a):
        dt = np.dtype(a.dtype) if hasattr(a, "dtype") else np.result_type(a)
        if jnp.issubdtype(dt, jnp.inexact):  # ml_dtypes' floats too (bfloat16, float8 codes)
            return jnp.zeros(np.shape(a), dt)
        return np.zeros(np.shape(a), jax.dtypes.float0)

    return jax.tree.map(zero, tree)


def experts_frozen(ew: ExpertWeights) -> bool:
    """True when any of ``w_gate, w_up, w_down`` is a `QuantizedTensor`: such experts are
    frozen under differentiation (`frozen_cotangent`)."""
    return any(isinstance(w, QuantizedTensor) for w in (ew.w_gate, ew.w_up, ew.w_down))


def frozen_cotangent(ew: ExpertWeights) -> ExpertWeights:
    """The cotangent every backward pass returns for frozen (quantized) experts.

    Quantized experts are frozen: the input and routing-weight gradients flow through the
    dequantized weights, and the experts themselves get no gradient, whatever leaf it is:
    zeros for the float scales / biases (and any float bias ``b_gate, b_up, b_down`` beside
    quantized weights), ``float0`` zeros for the integer codes / block bytes (`zero_cotangent`).
    No strategy computes a weight gradient for them (adapter-style fine-tuning of the
    router, shared expert or other layers over a quantized MoE; docs/training.md).
    """
    return zero_cotangent(ew)


def freeze(ew: ExpertWeights) -> ExpertWeights:
    """``ew`` behind `jax.lax.stop_gradient` when frozen (`experts_frozen`), else unchanged:
    a strategy differentiated by JAX's autodiff then gives the experts zero cotangents
    (`frozen_cotangent`'s values) and forms no weight gradient."""
    return jax.lax.stop_gradient(ew) if experts_frozen(ew) else ew


def gather_vjp(cfg: MoEConfig, res, g):
    """The backward pass of a strategy with no reverse mode of its own (a `jax.custom_vjp`
    whose forward saves ``res = (x, routing, experts)``): the VJP of `experts_gather`.

    Frozen (quantized) experts get `frozen_cotangent`; only ``x`` and the routing are
    differentiated then.
    """
    x, routing, ew = res
    if experts_frozen(ew):
        _, vjp = jax.vjp(lambda x, r: experts_gather(x, r, ew, cfg), x, routing)
        return (*vjp(g), frozen_cotangent(ew))
    _, vjp = jax.vjp(lambda x, r, w: experts_gather(x, r, w, cfg), x, routing, ew)
    return vjp(g)

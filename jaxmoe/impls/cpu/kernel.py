"""The CPU grouped-SwiGLU kernel (``impl="cpu"``): an XLA FFI custom call in C++.

XLA:CPU copies every expert slice ``W[e]`` before its dot (docs/log/2026-11-29-xla-path.md), so
the plain-XLA path pays a weight copy per touched expert. ``grouped_swiglu.cc`` (beside
this module) reads the selected experts' weights in place instead: tasks over (expert, column
block) with float32 register tiles, on XLA's intra-op thread pool. Everything around
it (routing, sorting the pairs, a float32 shared expert) stays in
XLA; a quantized or bfloat16-stored shared expert runs in the same call
(`experts_shared_cpu`, which `jaxmoe.moe_apply` takes), or on its own (`shared_expert_cpu`).

Weight formats, each read where it lies: float32 / bfloat16 ``[E, in, out]``, and
`QuantizedTensor` kinds ``int8`` (GGUF Q8_0: int8 codes ``[E, out, in]``, a scale per
group of 32) and ``int4`` (MLX affine 4-bit and GGUF Q4_0: packed nibbles, a scale and a
bias per group of 32 / 64 / 128), with float32, float16 or bfloat16 scales, and the GGUF
block kinds ``q4_1``, ``q5_0``, ``q5_1``, ``iq4_nl``, ``mxfp4`` (blocks of 32) and ``q2_k``,
``q3_k``, ``q4_k``, ``q5_k``, ``q6_k``, ``iq4_xs``, the IQ1-3 / TQ kinds ``iq2_xxs`` ...
``tq2_0`` (super-blocks of 256; iq_kinds.h) as the file's block bytes, decoded one block per column inside the
tiles bit-exact with ``gguf.quants.dequantize``; gate, up and down may each have their
own format (Q4_K_M: gate/up ``q4_k``, down ``q6_k``). Quantized codes are widened and scaled in
registers inside the tiles (tasks with >= 8 rows dequantize their block of columns into
a float32 tile buffer first); activations stay float32, so the result is within float
rounding of the float64 forward of the dequantized weights. Other QuantizedTensor kinds
are refused (`supports` says why) and ``auto`` sends them to ``gather`` / ``xla``.

The C++ source is compiled on first use (`jaxmoe.impls.cpu.build`);
`cpu_kernel_status` says whether it built; ``impl="auto"`` takes it on CPU only when it
did, ``impl="cpu"`` raises with the compiler's message when it did not.

``ExecConfig(activations="ggml")`` (`ggml_problem` says for which weights): the
activations converted as llama.cpp's CPU backend converts them
(`jaxmoe.ggml_activations`), then the float path over them: each input row converted by
the gate / up weights' format before the call (``ggml_round`` in XLA; the shared expert's
rows by its own), the hidden activations by the down weight's format inside the call
(the ``h_fmt`` attribute: bf16, q8_0 or q8_K blocks, the same float32 operations as
``ggml_round``; q8_1: quantized for the integer dots only). With `GGML_INT_DOT` the kinds of ggml format Q8_0 (int8, int4, Q4_0,
Q5_0, IQ4_NL, MXFP4) then multiply the Q8_0 codes in integers as ggml does, Q4_1 / Q5_1
the Q8_1 codes (plus each block's minimum times ggml's rounded block sum), and Q2_K ...
Q6_K / IQ4_XS and the IQ1-3 / TQ kinds the Q8_K codes; the call makes the codes from the
unconverted rows (gate and up both such kinds; h for such a down weight): every GGUF kind
multiplies in integers. Gradients pass straight through the conversions (the float
backward).

Also ``swiglu`` and ``swiglu_oai``, optional biases, ``weight_on_input``. Gradients: a
`jax.custom_vjp` whose forward keeps each pair's gate | up products (``[T k, 2F]``
float32) and whose backward is a second C++ call (`jaxmoe.impls.cpu.backward`: input,
routing-weight and weight gradients per expert on XLA's thread pool; quantized experts
frozen); a backward library that did not build takes ``gather``'s VJP.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from jaxmoe.config import MoEConfig
from jaxmoe.dispatch import plan_dispatch
from jaxmoe.execution import ExecConfig
from jaxmoe.experts import ExpertWeights, SharedWeights, shared_expert, shared_frozen, shared_gate, zero_cotangent
from jaxmoe.ggml_activations import FORMATS, ggml_round, vec_dot_format
from jaxmoe.impls.common import check_inputs, sorted_inputs
from jaxmoe.impls.cpu.backward import backward_kernel_status, backward_supports, cpu_vjp, grouped_swiglu_bwd
from jaxmoe.impls.cpu.build import TARGET, TARGET_SHARED, cpu_kernel_status
from jaxmoe.impls.cpu.kinds import GGUF_KINDS, INT4, INT8, operands
from jaxmoe.invariance import row_blocks
from jaxmoe.quant import FP8_KINDS, GGUF_BLOCKS, QuantizedTensor
from jaxmoe.routing import Routing

_FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
_SCALE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
_QKINDS = {"int8": (INT8, jnp.dtype(jnp.int8)), "int4": (INT4, jnp.dtype(jnp.uint8))}


def _block_problem(name: str, w: QuantizedTensor, n_in: int | None) -> str | None:
    """Why GGUF block weight ``name`` is malformed for the kernel, or None. ``n_in``: the
    input width the other weights imply (None when unknown)."""
    block, block_bytes = GGUF_BLOCKS[w.kind]
    shape = tuple(w.qdata.shape)
    where = f"impl='cpu': {name} ({w.kind.upper()}, block {block} in {block_bytes} bytes) of bytes {shape}"
    if jnp.dtype(w.qdata.dtype) != jnp.dtype(jnp.uint8) or len(shape) != 3:
        return f"{where}: block bytes must be uint8 [E, out, n_blocks * {block_bytes}], got {w.qdata.dtype}"
    if shape[-1] % block_bytes:
        return f"{where}: rows of {shape[-1]} bytes are not whole blocks (truncated or wrong-sized block buffer)"
    if n_in is not None and shape[-1] != n_in // block * block_bytes:
        return (
            f"{where}: the layer needs input width {n_in}, i.e. rows of {n_in // block * block_bytes} bytes "
            f"({n_in}/{block} blocks); truncated or wrong-sized block buffer"
            if n_in % block == 0
            else f"{where}: input width {n_in} is not a multiple of the block size {block}"
        )
    return None


def _weight_problem(name: str, w, n_in: int | None = None) -> str | None:
    """Why the kernel cannot read weight ``name`` in its stored format, or None."""
    if not isinstance(w, QuantizedTensor):
        if jnp.dtype(w.dtype) not in _FLOAT_DTYPES:
            return f"impl='cpu' takes float32, bfloat16 or int8/int4/GGUF-quantized experts; {name} is {w.dtype}"
        return None
    if w.kind in GGUF_KINDS:
        return _block_problem(name, w, n_in)
    if w.kind in FP8_KINDS:
        return _fp8_problem(name, w)
    if w.kind not in _QKINDS:
        return (
            f"impl='cpu' reads QuantizedTensor kinds {sorted(_QKINDS) + sorted(GGUF_KINDS) + list(FP8_KINDS)}; {name} is "
            f"kind={w.kind!r} (qdata {tuple(w.qdata.shape)}); use impl='xla'"
        )
    code_dtype = _QKINDS[w.kind][1]
    if jnp.dtype(w.qdata.dtype) != code_dtype or w.qdata.ndim != 3:
        got = f"{w.qdata.dtype} {tuple(w.qdata.shape)}"
        return f"impl='cpu': {name} ({w.kind}) needs {code_dtype} codes [E, out, in], got {got}"
    if w.group_size % 32:
        return (
            f"impl='cpu': {name} ({w.kind}) has group size {w.group_size}; the kernel takes multiples of 32 "
            f"(GGUF 32, MLX 32/64/128); use impl='xla'"
        )
    scales = w.scales
    if scales is None or jnp.dtype(scales.dtype) not in _SCALE_DTYPES:
        got = None if scales is None else scales.dtype
        return f"impl='cpu': {name} ({w.kind}) scales must be float32, float16 or bfloat16, got {got}"
    if w.biases is not None and jnp.dtype(w.biases.dtype) != jnp.dtype(scales.dtype):
        return f"impl='cpu': {name} ({w.kind}) biases {w.biases.dtype} must have the scales' dtype {scales.dtype}"
    return None


def _fp8_problem(name: str, w: QuantizedTensor) -> str | None:
    """Why block-scaled FP8 weight ``name`` is malformed for the kernel, or None: codes
    ``[E, out, in]`` with ``in`` and the block edge multiples of 32 (whole vectors of codes
    per block); the block scales' shape and dtype `jaxmoe.quant.check_fp8_blocks` checked."""
    shape, b = tuple(w.qdata.shape), w.group_size
    where = f"impl='cpu': {name} ({w.kind}, {b} x {b} blocks) of codes {shape}"
    if len(shape) != 3:
        return f"{where}: codes must be [E, out, in]"
    if b % 32 or shape[-1] % 32:
        return f"{where}: the kernel takes a block edge and an input width that are multiples of 32; use impl='xla'"
    assert w.scales is not None
    if jnp.dtype(w.scales.dtype) not in _SCALE_DTYPES:
        return f"{where}: scales must be float32, float16 or bfloat16, got {w.scales.dtype}"
    return None


#: ggml activation formats the kernel converts h to (its ``h_fmt`` attribute); ``f32``: none;
#: ``q8_1`` (Q4_1 / Q5_1) only with their integer dots (`GGML_INT_DOT`): h quantized for them,
#: block sums and all. ``f16`` (no float16 experts) is not among them.
GGML_H_FMT = {"f32": 0, "bf16": 1, "q8_0": 2, "q8_K": 3, "q8_1": 4}
#: ``activations="ggml"``: integer-coded experts multiply ggml's activation codes in
#: integers (the ``int_dot`` attribute 2, int_dot.h: ggml's own arithmetic); False keeps
#: the float path over the converted values (a test's comparison), and refuses Q4_1 / Q5_1.
GGML_INT_DOT = True
#: Kinds whose integer dots read ggml's Q8_K codes, made in the call from the unconverted
#: rows (int_dot.h): their input rows are passed unconverted when gate and up both are one.
_Q8K_INT_DOT = (
    *("q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs"),
    *("iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m", "tq1_0", "tq2_0"),
)
#: Kinds whose integer dots read ggml's Q8_0 codes (ggml format ``q8_0``): the call makes
#: them by ggml's rule too (``kRuleQ8_0``, bit for bit with `ggml_round`'s codes and
#: scale), so their rows are passed unconverted as well when gate and up both are one.
_Q8_0_INT_DOT = ("int8", "int4", "q4_0", "q5_0", "iq4_nl", "mxfp4")
#: Kinds whose integer dots read ggml's Q8_1 codes and block sums (``kRuleQ8_1``), made in the
#: call from the unconverted rows: the only form of the mode the kernel has for them (the
#: float path over converted values lacks the rounded block sums' term).
_Q8_1_INT_DOT = ("q4_1", "q5_1")


def _unconverted_input(ew) -> bool:
    """Whether the call takes the input rows unconverted: gate and up both `_Q8K_INT_DOT`
    kinds, both `_Q8_1_INT_DOT` kinds, or both `_Q8_0_INT_DOT` kinds of ggml format ``q8_0``."""
    ws = (ew.w_gate, ew.w_up)
    if not GGML_INT_DOT or not all(isinstance(w, QuantizedTensor) for w in ws):
        return False
    if all(w.kind in _Q8K_INT_DOT for w in ws) or all(w.kind in _Q8_1_INT_DOT for w in ws):
        return True
    return all(w.kind in _Q8_0_INT_DOT and vec_dot_format(w) == "q8_0" for w in ws)


def ggml_problem(ew: ExpertWeights, what: str = "") -> str | None:
    """Why the kernel has no ``activations="ggml"`` arithmetic for these weights (``auto``
    then takes an XLA strategy, an explicit ``impl="cpu"`` raises it), or None. It has it
    where every weight's ggml activation format (`jaxmoe.ggml_activations.vec_dot_format`)
    is ``f32``, ``bf16``, ``q8_0``, ``q8_K`` or ``q8_1`` (the latter with `GGML_INT_DOT`),
    gate and up share it and the widths hold whole blocks. ``what``: prefix naming the
    weights in the message."""
    fmts = {}
    for name, w in (("w_gate", ew.w_gate), ("w_up", ew.w_up), ("w_down", ew.w_down)):
        try:
            fmts[name] = vec_dot_format(w)
        except ValueError as err:
            return f"impl='cpu': {what}{name}: {err}"
        if fmts[name] == "q8_1" and not GGML_INT_DOT:  # (q8_1: a QuantizedTensor of kind q4_1 / q5_1)
            kind = w.kind if isinstance(w, QuantizedTensor) else fmts[name]
            return (
                f"impl='cpu' has no activations='ggml' arithmetic for {what}{name} of kind {kind!r} "
                "without its integer dots (GGML_INT_DOT: q8_1's block sums); use an XLA strategy"
            )
        if fmts[name] not in GGML_H_FMT:
            kind = w.kind if isinstance(w, QuantizedTensor) else jnp.dtype(w.dtype).name
            return (
                f"impl='cpu' has no activations='ggml' arithmetic for {what}{name} of kind {kind!r} "
                f"(its activation format {fmts[name]!r}; the kernel's: {sorted(GGML_H_FMT)}); use an XLA strategy"
            )
    if fmts["w_gate"] != fmts["w_up"]:
        return (
            f"impl='cpu', activations='ggml': {what}w_gate and w_up convert their input to different formats "
            f"({fmts['w_gate']}, {fmts['w_up']}); use an XLA strategy"
        )
    d, f = ew.w_down.shape[-1], ew.w_gate.shape[-1]
    for name, width in (("w_gate", d), ("w_down", f)):
        if width % FORMATS[fmts[name]]:
            return (
                f"impl='cpu', activations='ggml': {what}{name}'s input width {width} is not a multiple of "
                f"{fmts[name]}'s block of {FORMATS[fmts[name]]}"
            )
    return None


def supports(ew: ExpertWeights, dtype) -> str | None:
    """None when the kernel takes these experts, else why not (for errors and ``auto``).

    Each of ``w_gate``, ``w_up``, ``w_down`` may be float32, bfloat16 or a `QuantizedTensor`
    of kind ``int8`` / ``int4`` (group size a multiple of 32, scales float32 / float16 /
    bfloat16) or a GGUF block kind (`jaxmoe.quant.GGUF_BLOCKS`, ``q4_1`` ... ``mxfp4``: raw
    block bytes ``[E, out, in / block * block_bytes]``, rows that must hold exactly the width
    the other weights imply), independently (mixed formats in one layer). Activations: float32 or
    bfloat16; bfloat16 activations are refused with float32 experts (the kernel does not
    round float32 weights to bfloat16), and taken with quantized ones (weights
    dequantized to float32 in registers: more exact than a bfloat16 copy).
    """
    return _weights_problem({"w_gate": ew.w_gate, "w_up": ew.w_up, "w_down": ew.w_down}, dtype)


def _weights_problem(ws: dict, dtype) -> str | None:
    """`supports` for named weights (routed experts, or a shared expert's matrices)."""
    d, f = ws["w_down"].shape[-1], ws["w_gate"].shape[-1]  # logical [.., in, out]
    widths = {"w_gate": d, "w_up": d, "w_down": f}
    for name, w in ws.items():
        why = _weight_problem(name, w, widths.get(name))
        if why:
            return why
    if jnp.dtype(dtype) not in _FLOAT_DTYPES:
        return f"impl='cpu' takes float32 or bfloat16 activations, got {jnp.dtype(dtype)}"
    if jnp.dtype(dtype) == jnp.bfloat16 and any(
        not isinstance(w, QuantizedTensor) and jnp.dtype(w.dtype) == jnp.float32 for w in ws.values()
    ):
        return (
            "impl='cpu' does not round float32 experts to a bfloat16 compute dtype; "
            "store the experts in bfloat16 or use impl='xla'"
        )
    return None


def experts_cpu(
    x: jax.Array, routing: Routing, ew: ExpertWeights, cfg: MoEConfig, ex: ExecConfig | None = None
) -> jax.Array:
    """Routed experts through the C++ kernel. ``x [T, d]`` -> ``[T, d]`` float32.

    Same contract as `jaxmoe.impls.xla.experts_xla`; the backward pass is `cpu_vjp`.
    ``ex.activations == "int8"``: integer-coded experts multiply int8 activations
    (`jaxmoe.execution.ExecConfig`); ``ex.batch_invariant``: the invariant combine (the
    kernel itself is invariant always). Raises ValueError for unsupported weights and
    RuntimeError when the kernel could not be built.
    """
    return _routed_cpu(x, routing, ew, cfg, ex)


def _routed_cpu(x, routing, ew, cfg, ex, check: bool = True) -> jax.Array:
    _check_call(x, routing, ew, "experts_cpu", check, _mode(ex)[0])
    return _experts_cpu(x, routing, ew, cfg, _mode(ex))


def _mode(ex: ExecConfig | None) -> tuple[str, bool]:
    """``(activation mode, batch invariant)`` of ``ex``: the kernel's static choices."""
    ex = ex or ExecConfig()
    return ex.activations, ex.batch_invariant


def cpu_layer(
    x: Array,
    routing: Routing,
    ew: ExpertWeights,
    sw: SharedWeights | None,
    cfg: MoEConfig,
    ex: ExecConfig,
    *,
    check=True,
) -> Array:
    """``impl="cpu"``'s layer: routed plus shared expert, ``[T, d]`` float32.

    The shared expert runs in the same C++ call (`experts_shared_cpu`) when batch
    invariance asks for it or its weights are stored narrow (quantized or bfloat16 with
    float32 activations: XLA would widen each whole matrix on every call,
    `shared_stored_narrow`), and the kernel takes them; otherwise the XLA shared expert
    is added after (`jaxmoe.experts.shared_expert`). ``check=False``: the kernel's build is
    not asked for (``auto`` asks at lowering time, `jaxmoe.impls.cpu.build.kernel_ready`).
    """
    if sw is None:
        return _routed_cpu(x, routing, ew, cfg, ex, check)
    ggml = ex.activations == "ggml"
    fused = ex.batch_invariant or shared_stored_narrow(sw, x.dtype)
    if fused and x.shape[0] > 0 and _shared_problem(sw, x.dtype, check, ggml) is None:
        _check_call(x, routing, ew, "experts_shared_cpu", check, ex.activations)
        return _experts_shared_cpu(x, routing, ew, sw, cfg, _mode(ex))
    y = _routed_cpu(x, routing, ew, cfg, ex, check)
    # the XLA shared expert: ggml as asked, int8 as float (`jaxmoe.ggml_activations.prepare`)
    return y + shared_expert(x, sw, cfg, invariant=ex.batch_invariant, platform=ex.group, activations=ex.activations)


def _check_call(
    x: jax.Array, routing: Routing, ew: ExpertWeights, name: str, built: bool = True, activations: str = "float"
) -> None:
    """The checks before a kernel call: inputs, weight formats (for ``activations="ggml"``
    `ggml_problem` too), the kernel built (``built``)."""
    check_inputs(x, routing, ew, name)
    why = supports(ew, x.dtype) or (ggml_problem(ew) if activations == "ggml" else None)
    if why:
        raise ValueError(why)
    if not built:
        return
    ok, msg = cpu_kernel_status()
    if not ok:
        raise RuntimeError(f"impl='cpu' is unavailable: {msg}")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _experts_cpu(x, routing, ew, cfg, mode):
    return _forward(x, routing, ew, cfg, mode)


def _fwd(x, routing, ew, cfg, mode):
    y, gate_up = _forward(x, routing, ew, cfg, mode, save=True)
    return y, (x, routing, ew, gate_up)


def _bwd(cfg, mode, res, g):
    return cpu_vjp(cfg, res, g)


_experts_cpu.defvjp(_fwd, _bwd)


#: Columns of one task: gate/up tasks cover ``UP_BLOCK`` columns of F, down tasks
#: ``DOWN_BLOCK`` columns of d (measured on the Qwen3.6 layer, docs/log/2026-12-01-cpu-kernel.md:
#: a float task reads 256 / 512 contiguous bytes of each weight row at these widths;
#: half that was slower for bfloat16 decode). An expert with fewer than 8 rows
#: gets wider tasks in the kernel (whole rows when there are at least two such tasks per
#: thread), which stream their weight rows contiguously.
UP_BLOCK = 128
DOWN_BLOCK = 256
BLOCKS = (UP_BLOCK, DOWN_BLOCK)


def grouped_swiglu(
    xs, offsets, sizes, ew: ExpertWeights, cfg: MoEConfig, *, round_h=False, int_dot=False, blocks=BLOCKS, h_fmt=0
):
    """The custom call itself: ``xs [P, d]`` float32 rows sorted by expert -> ``[P, d]`` float32.

    Expert ``e`` owns rows ``[offsets[e], offsets[e] + sizes[e])`` (``[E]`` int32 each);
    the non-empty ranges must be sorted by expert, disjoint and inside ``[0, P)``, else the
    call fails with an error naming the expert (checked in C++ when it runs). Rows no
    expert owns come back zero. ``round_h`` (bool) rounds the hidden activations to
    bfloat16; ``int_dot`` (bool): integer-coded weights multiply int8-quantized
    activations (``ExecConfig(activations="int8")``); ``blocks``: the columns of a gate/up
    and of a down task (`BLOCKS`); ``h_fmt``: the hidden activations converted to a ggml
    format before the down projection (`GGML_H_FMT`'s numbers; 0: none). Builds and
    registers the kernel on first use (RuntimeError naming why when it cannot).
    """
    _require_kernel("grouped_swiglu")
    return _call(xs, offsets, sizes, ew, cfg, round_h, *blocks, save=False, int_dot=int_dot, h_fmt=(h_fmt, 0))[0]


def grouped_swiglu_saving(xs, offsets, sizes, ew: ExpertWeights, cfg: MoEConfig, *, round_h=False, int_dot=False):
    """`grouped_swiglu` that also returns ``gu [P, 2F]`` float32: each row's gate | up
    products before the biases (``xs W_g``, ``xs W_u``), the residual the backward reads
    instead of recomputing them (rows no expert owns are unspecified)."""
    _require_kernel("grouped_swiglu_saving")
    ys, gate_up, _ = _call(xs, offsets, sizes, ew, cfg, round_h, UP_BLOCK, DOWN_BLOCK, save=True, int_dot=int_dot)
    return ys, gate_up


def _require_kernel(name: str) -> None:
    """Builds and registers the kernel (once per process); RuntimeError naming why it is
    unavailable, instead of XLA's missing-handler error when the custom call runs."""
    ok, msg = cpu_kernel_status()
    if not ok:
        raise RuntimeError(f"{name}: the C++ kernel is unavailable: {msg}")


def _weight_operands(ew: ExpertWeights, prefix: str = "") -> tuple[list, dict]:
    """The custom call's operands of gate, up and down (data, scales, quantization biases
    each) and their ``{prefix}kind_*`` / ``{prefix}group_*`` attributes."""
    ops, attrs = [], {}
    for name, w in zip(("gate", "up", "down"), (ew.w_gate, ew.w_up, ew.w_down)):
        arrays, kind, group = operands(w)
        ops += list(arrays)
        attrs[f"{prefix}kind_{name}"] = np.int32(kind)
        attrs[f"{prefix}group_{name}"] = np.int32(group)
    return ops, attrs


def _call(
    xs,
    offsets,
    sizes,
    ew: ExpertWeights,
    cfg: MoEConfig,
    round_h,
    up_block,
    down_block,
    save: bool,
    shared: tuple[jax.Array, SharedWeights, jax.Array | None] | None = None,
    int_dot: int = 0,
    h_fmt: tuple[int, int] = (0, 0),
    to_tokens: tuple[jax.Array, jax.Array | None, int] | None = None,
):
    """The custom call: ``(ys, gate_up, None)``, and with ``shared = (x [T, d], sw, gx)`` the
    shared expert in the same call: ``(ys, gate_up, ys_shared [T, d])`` (gated by
    ``sigmoid(gx . sw.gate)`` unless ``sw.gate`` is None; ``gx [T, d]`` the rows the gate
    reads, None: ``x``). ``h_fmt``: the ``h_fmt`` / ``sh_fmt`` attributes (the
    routed and the shared expert's hidden activations converted to a ggml format).
    ``to_tokens = (inv [T k], w [T, k] | None, T)``: the call also combines the rows back to
    tokens (`jaxmoe.impls.common.combine`'s batch-invariant form: ``inv`` the sorted row
    of each pair, ``w`` the routing weights, None when they were applied on the input) and
    returns that ``y [T, d]`` in place of ``ys``; with ``shared`` too, ``y`` includes
    ``ys_shared`` (``y[t] = combined + ys_shared[t]``, one float32 add)."""
    p, f = xs.shape[0], ew.w_gate.shape[-1]  # F of these weights (a shared expert has its own)
    weights, attrs = _weight_operands(ew)
    no_bias = (jnp.zeros((0,), jnp.float32),) * 3
    biases = ew.biases_f32() or no_bias
    results = [
        jax.ShapeDtypeStruct((p, xs.shape[1]), jnp.float32),
        jax.ShapeDtypeStruct((p, f), jnp.float32),
        jax.ShapeDtypeStruct((p, 2 * f) if save else (0,), jnp.float32),
    ]
    extra = []
    if shared is not None:
        x, sw, gx = shared
        one = _one_expert(sw)
        sweights, sattrs = _weight_operands(one, "s")
        empty = jnp.zeros((0,), jnp.float32)
        gate = empty if sw.gate is None else sw.gate.astype(jnp.float32).reshape(-1)
        gx = empty if gx is None or sw.gate is None else gx.astype(jnp.float32)
        extra = [x.astype(jnp.float32), *sweights, *no_bias, gate, gx]
        attrs.update(sattrs, sh_fmt=np.int32(h_fmt[1]))
        t, fs = x.shape[0], one.w_gate.shape[-1]
        results += [jax.ShapeDtypeStruct((t, xs.shape[1]), jnp.float32), jax.ShapeDtypeStruct((t, fs), jnp.float32)]
    if to_tokens is None:
        cargs = [jnp.zeros((0,), jnp.int32), jnp.zeros((0,), jnp.float32)]
        results.append(jax.ShapeDtypeStruct((0,), jnp.float32))
    else:  # (no pairs: inv empty, the call's "no combine", and y [0, d] as it is)
        inv, w, tokens = to_tokens
        cw = jnp.zeros((0,), jnp.float32) if w is None else w.astype(jnp.float32).reshape(-1)
        cargs = [inv.astype(jnp.int32).reshape(-1), cw]
        results.append(jax.ShapeDtypeStruct((tokens, xs.shape[1]), jnp.float32))
    call = jax.ffi.ffi_call(TARGET if shared is None else TARGET_SHARED, tuple(results), vmap_method="sequential")
    out = call(
        xs.astype(jnp.float32),
        offsets.astype(jnp.int32),
        sizes.astype(jnp.int32),
        *weights,
        *biases,
        *extra,
        *cargs,
        act=np.int32(0 if cfg.activation == "swiglu" else 1),
        alpha=np.float32(cfg.swiglu_alpha),
        limit=np.float32(cfg.swiglu_limit),
        round_h=np.int32(round_h),
        up_block=np.int32(up_block),
        down_block=np.int32(down_block),
        int_dot=np.int32(int_dot),
        h_fmt=np.int32(h_fmt[0]),
        **attrs,
    )
    return out[-1 if to_tokens is not None else 0], out[2], (out[3] if shared is not None else None)


def shared_supported(sw: SharedWeights, dtype) -> bool:
    """Whether `shared_expert_cpu` takes these shared-expert weights for activations of
    ``dtype`` (the formats `supports` takes for routed experts: float32 / bfloat16 arrays,
    int8 / int4 / GGUF block `QuantizedTensor`s) and the kernel built."""
    return _shared_problem(sw, dtype) is None


def _shared_problem(sw: SharedWeights, dtype, built: bool = True, ggml: bool = False) -> str | None:
    """Why `shared_expert_cpu` does not take ``sw`` for activations of ``dtype``, or None
    (``built``: the kernel must have built too; ``ggml``: `ggml_problem` too)."""
    ew = jax.eval_shape(_one_expert, sw)  # shapes only: no copy of the weights to check them
    why = _weights_problem({"w_gate": ew.w_gate, "w_up": ew.w_up, "w_down": ew.w_down}, dtype)
    if why is None and ggml:
        why = ggml_problem(ew)
    if why is not None:
        return f"shared expert: {why}"
    if not built:
        return None
    ok, msg = cpu_kernel_status()
    return None if ok else f"impl='cpu' is unavailable: {msg}"


def shared_stored_narrow(sw: SharedWeights | None, dtype) -> bool:
    """Whether any shared-expert matrix is stored in a format XLA would convert whole on
    every call for activations of ``dtype``: a `QuantizedTensor` (dequantized), or an array
    of another dtype (bfloat16 weights with float32 activations)."""
    if sw is None:
        return False
    return any(
        isinstance(w, QuantizedTensor) or jnp.dtype(w.dtype) != jnp.dtype(dtype)
        for w in (sw.w_gate, sw.w_up, sw.w_down)
    )


def _one_expert(sw: SharedWeights) -> ExpertWeights:
    """The shared expert as one routed expert (``[1, d, F]``, ``[1, F, d]``; a
    `QuantizedTensor` gets the leading axis on its codes, scales and biases)."""
    return ExpertWeights(*(jax.tree.map(lambda a: a[None], w) for w in (sw.w_gate, sw.w_up, sw.w_down)))


def shared_expert_cpu(x: jax.Array, sw: SharedWeights, cfg: MoEConfig) -> jax.Array:
    """The shared expert through the C++ kernel (one expert owning every row), gated as
    `jaxmoe.experts.shared_expert`. ``x [T, d]`` -> ``[T, d]`` float32.

    The kernel accumulates each output element in one fixed order whatever ``T`` is, so
    this is the batch-invariant shared expert on the CPU at the kernel's speed; it also
    reads quantized weights (a GGUF file's ``ffn_*_shexp`` tensors) in their stored format,
    where XLA would dequantize each whole matrix on every call (`jaxmoe.moe_apply` takes it
    for a quantized or bfloat16-stored shared expert, `shared_stored_narrow`, whenever the
    routed experts run in this kernel). Requires
    `shared_supported` (a ValueError otherwise). Gradients: the C++ backward kernel with the
    shared expert as one expert (`_shared_cpu_bwd`; quantized weights frozen).
    """
    why = _shared_problem(sw, x.dtype)
    if why is not None:
        raise ValueError(f"shared_expert_cpu: {why}")
    return _shared_cpu(x, sw, cfg)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _shared_cpu(x: jax.Array, sw: SharedWeights, cfg: MoEConfig) -> jax.Array:
    t = x.shape[0]
    ew = _one_expert(sw)
    start = jnp.zeros((1,), jnp.int32)
    y = grouped_swiglu(
        x.astype(jnp.float32), start, jnp.full((1,), t, jnp.int32), ew, cfg, round_h=bool(x.dtype == jnp.bfloat16)
    )
    if sw.gate is not None:  # the product inside a loop (jaxmoe.invariance.slot_sum)
        y = row_blocks(lambda r, gate: r[0] * shared_gate(r[1], gate), (y, x), sw.gate)
    return y


def _shared_cpu_fwd(x, sw, cfg):
    return _shared_cpu(x, sw, cfg), (x, sw)


def _shared_cpu_bwd(cfg, res, g):
    """The shared expert's cotangents ``(dx, dsw)``: the C++ backward kernel with the
    shared expert as one expert owning every row (`_shared_backward`), or the VJP of the
    XLA shared expert where that kernel does not take the weights (mixed float and
    quantized matrices) or did not build."""
    x, sw = res
    mats = (sw.w_gate, sw.w_up, sw.w_down)
    mixed = shared_frozen(sw) and not all(isinstance(w, QuantizedTensor) for w in mats)
    if mixed or backward_supports(_one_expert(sw)) is not None or not backward_kernel_status()[0]:
        return jax.vjp(lambda x, sw: shared_expert(x, sw, cfg), x, sw)[1](g)
    return _shared_backward(x, sw, g, cfg)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _shared_backward(x: jax.Array, sw: SharedWeights, g: jax.Array, cfg: MoEConfig):
    """``x, g [T, d]`` -> ``(dx [T, d], dsw)`` of ``y = s * ffn(x)``, ``s = sigmoid(x . gate)``
    (1 without a gate), through `grouped_swiglu_bwd` (gate/up recomputed: the forward
    saves nothing for the shared expert). With ``dot_t = <g_t, ffn(x_t)>`` from the kernel,
    the gate's logit gets ``dot_t s_t (1 - s_t)``: ``dx += dlogit gate``, ``dgate = x^T dlogit``.
    Quantized matrices are frozen (zero cotangents, `jaxmoe.experts.freeze_shared`); float
    ones get their gradients in their dtype."""
    t = x.shape[0]
    xf = x.astype(jnp.float32)
    s = None if sw.gate is None else shared_gate(x, sw.gate)[:, 0]
    frozen = shared_frozen(sw)
    dxs, dot, dws, _ = grouped_swiglu_bwd(
        xf,
        g.astype(jnp.float32),
        s,
        jnp.zeros((1,), jnp.int32),
        jnp.full((1,), t, jnp.int32),
        _one_expert(sw),
        cfg,
        round_h=bool(x.dtype == jnp.bfloat16),
        weight_grads=not frozen,
    )
    dx = dxs
    dgate = None
    if sw.gate is not None:
        assert s is not None
        dlogit = dot * s * (1.0 - s)  # [T]
        gate = sw.gate.astype(jnp.float32)
        dx = dx + dlogit[:, None] * gate[None, :]
        dgate = jnp.dot(dlogit, xf, precision=jax.lax.Precision.HIGHEST).astype(sw.gate.dtype)
    if frozen:
        dwg, dwu, dwd = (zero_cotangent(w) for w in (sw.w_gate, sw.w_up, sw.w_down))
    else:
        assert dws is not None
        dwg, dwu, dwd = (dw[0] for dw in dws)
    return dx.astype(x.dtype), SharedWeights(dwg, dwu, dwd, dgate)


_shared_cpu.defvjp(_shared_cpu_fwd, _shared_cpu_bwd)


def experts_shared_cpu(
    x: jax.Array, routing: Routing, ew: ExpertWeights, sw: SharedWeights, cfg: MoEConfig, ex: ExecConfig | None = None
) -> jax.Array:
    """The routed experts and the shared expert in one C++ call: ``x [T, d]`` -> ``[T, d]``
    float32, ``experts_cpu(x, routing, ew, cfg) + shared_expert_cpu(x, sw, cfg)``.

    One custom call per layer instead of two: the shared expert's tasks run in the same
    two rounds of the thread pool as the routed experts' (at ``T = 1`` the second call
    and its gate were a measurable share of a decode step, docs/log/2026-12-04-shared-expert-call.md). The shared
    gate ``sigmoid(x . gate)`` is computed in the kernel, in one fixed order per row, so
    the result is batch-invariant as `shared_expert_cpu`'s. Requires `supports` for
    ``ew`` and `shared_supported` for ``sw``. Gradients: the routed experts' `cpu_vjp`
    plus the shared expert's (as `experts_cpu` and `shared_expert_cpu`).
    """
    mode = _mode(ex)
    _check_call(x, routing, ew, "experts_shared_cpu", activations=mode[0])
    why = _shared_problem(sw, x.dtype, ggml=mode[0] == "ggml")
    if why is not None:
        raise ValueError(f"experts_shared_cpu: {why}")
    return _experts_shared_cpu(x, routing, ew, sw, cfg, mode)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _experts_shared_cpu(x, routing, ew, sw, cfg, mode):
    return _forward(x, routing, ew, cfg, mode, sw=sw)


def _fwd_shared(x, routing, ew, sw, cfg, mode):
    y, gate_up = _forward(x, routing, ew, cfg, mode, save=True, sw=sw)
    return y, (x, routing, ew, gate_up, sw)


def _bwd_shared(cfg, mode, res, g):
    x, routing, ew, gate_up, sw = res
    dx, drouting, dew = cpu_vjp(cfg, (x, routing, ew, gate_up), g)
    dx_shared, dsw = _shared_cpu_bwd(cfg, (x, sw), g)
    return dx + dx_shared, drouting, dew, dsw


_experts_shared_cpu.defvjp(_fwd_shared, _bwd_shared)


@functools.partial(jax.jit, static_argnames=("cfg", "mode", "save"))
def _forward(
    x: jax.Array,
    routing: Routing,
    ew: ExpertWeights,
    cfg: MoEConfig,
    mode: tuple[str, bool],
    save: bool = False,
    sw: SharedWeights | None = None,
):
    """``y [T, d]``; with ``save`` (the forward of a differentiated call) ``(y, gate_up)``,
    ``gate_up [T k, 2F]`` float32 the gate | up products of each pair in sorted order
    (`grouped_swiglu_saving`), which the backward reads instead of recomputing them; its
    dispatch plan (`plan_dispatch` of the same ids) orders the pairs the same way. With
    ``sw`` the shared expert runs in the same call and ``y`` includes it
    (`experts_shared_cpu`). ``mode[0] == "ggml"``: the input rows converted to the gate /
    up weights' ggml format here (the shared expert's to its own), or in the call when it
    quantizes them for integer dots (`_unconverted_input`), the hidden activations
    in the call (``h_fmt``), the shared gate's dot on the unconverted rows (an operand of
    the call, as `jaxmoe.experts.shared_expert` reads them)."""
    e = ew.num_experts
    plan = plan_dispatch(routing.expert_ids, e, 1)
    ggml = mode[0] == "ggml"
    round_h = bool(x.dtype == jnp.bfloat16) and not ggml  # ggml keeps h float32 until its conversion
    shared = None if sw is None else (x, sw, None)
    h_fmt = (0, 0)
    if not ggml:
        xs = sorted_inputs(x, routing, plan, cfg).astype(jnp.float32)  # [P, d]
    else:
        fmt = vec_dot_format(ew.w_gate)
        h_fmt = (GGML_H_FMT[vec_dot_format(ew.w_down)], 0)
        conv = (lambda a, f: a.astype(jnp.float32)) if _unconverted_input(ew) else ggml_round  # noqa: E731
        if cfg.weight_on_input:  # the rows are weighted first, then converted
            xs, xc = conv(sorted_inputs(x, routing, plan, cfg), fmt), None
        else:  # the same rows converted before the gather: T rows, not T k
            xc = conv(x, fmt)
            xs = sorted_inputs(xc, routing, plan, cfg)
        if sw is not None:
            sfmt = vec_dot_format(sw.w_gate)
            same = sfmt == fmt and _unconverted_input(sw) == _unconverted_input(ew)
            if xc is not None and same:
                xsh = xc
            else:
                xsh = x.astype(jnp.float32) if _unconverted_input(sw) else ggml_round(x, sfmt)
            # the gate reads the rows as given: x itself where xsh holds them converted
            shared = (xsh, sw, None if _unconverted_input(sw) else x)
            h_fmt = (h_fmt[0], GGML_H_FMT[vec_dot_format(sw.w_down)])
    # y: the rows combined back to tokens in the call (combine's batch-invariant form, whatever
    # mode[1]), the shared expert's rows added there too
    y, gate_up, _ = _call(
        xs,
        plan.group_offsets[:e],
        plan.group_sizes,
        ew,
        cfg,
        round_h,
        UP_BLOCK,
        DOWN_BLOCK,
        save,
        shared,
        {"int8": 1, "ggml": 2 if GGML_INT_DOT else 0}.get(mode[0], 0),
        h_fmt,
        (plan.inv, None if cfg.weight_on_input else routing.weights, x.shape[0]),
    )
    return (y, gate_up) if save else y

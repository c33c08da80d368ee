"""An independent float64 numpy forward of one MoE layer: the eval runs' oracle.

Written from the rules of docs/routing.md, not from `jaxmoe.routing` / `jaxmoe.experts`:
router logits, score function, selection bias, group limit, top-k with ties to the
lower id, unbiased weights (or softmax / sigmoid of the selected logits), the
renormalization variants with their floors, the routed scaling factor, SwiGLU or the
gpt-oss clamped SwiGLU, the routing weight on the expert input (Llama 4), and the
(sigmoid-gated) shared expert. Every tensor is read from `MoEParams` and converted to
float64 (a `QuantizedTensor` dequantized in numpy by `dequantize_f64`), one expert at a time, so the
full-width Qwen3.6 layer never exists in float64 at once.
"""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np

from jaxmoe.config import MoEConfig, RouterConfig
from jaxmoe.params import MoEParams


@dataclasses.dataclass(frozen=True)
class RefRouting:
    """Float64 routing of T tokens.

    Attributes:
      expert_ids: ``[T, k]`` int64, slots by descending selection score (ties: lower id first).
      weights: ``[T, k]`` float64 combine weights.
      scores: ``[T, E]`` float64 router scores ``score_fn(z)`` (softmax over E for the
        ``softmax*`` rules, sigmoid for the ``sigmoid*`` rules), before any bias.
    """

    expert_ids: np.ndarray
    weights: np.ndarray
    scores: np.ndarray


def dequantize_f64(qt, index=None) -> np.ndarray:
    """A `QuantizedTensor` (optionally one leading index) as float64 ``[..., in, out]``, in numpy.

    ``int8``: ``scales[o, i // g] * q[o, i]``; ``int4``: byte ``j`` holds element ``2j`` in its
    low nibble and ``2j + 1`` in its high nibble, value ``scales * q + biases``.
    The GGUF block kinds (``q4_k``, ...) are decoded by ``gguf.quants.dequantize``;
    ``fp8_e4m3``: ``float64(q[o, i]) * scales[o // b, i // b]`` (``ml_dtypes`` codes).
    """
    take = (lambda a: a) if index is None else (lambda a: a[index])
    if qt.scales is None:  # a GGUF block kind: gguf-py decodes the raw blocks (float32, exact)
        raw = np.asarray(take(qt.qdata), np.uint8)
        return np.swapaxes(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qt.kind.upper()]), -1, -2).astype(
            np.float64
        )
    q = np.asarray(take(qt.qdata))
    if qt.kind == "fp8_e4m3":  # float8 codes (ml_dtypes, exact in float64) times their square block's scale
        b = qt.group_size
        s = np.asarray(take(qt.scales)).astype(np.float64)
        s = np.repeat(np.repeat(s, b, axis=-2), b, axis=-1)[..., : q.shape[-2], : q.shape[-1]]
        return np.swapaxes(q.astype(np.float64) * s, -1, -2)
    if qt.kind == "int4":
        lo, hi = q & 0xF, q >> 4
        q = np.stack([lo, hi], axis=-1).reshape(*q.shape[:-1], 2 * q.shape[-1])
    q = q.astype(np.float64)
    *lead, out, n = q.shape
    g = qt.group_size
    w = q.reshape(*lead, out, n // g, g) * np.asarray(take(qt.scales)).astype(np.float64)[..., None]
    if qt.biases is not None:
        w = w + np.asarray(take(qt.biases)).astype(np.float64)[..., None]
    return np.swapaxes(w.reshape(*lead, out, n), -1, -2)


def to_f64(w, index=None) -> np.ndarray:
    """A weight (array or `QuantizedTensor`, optionally one leading index) as float64 numpy.

    Arrays go through numpy (``np.asarray`` of a CPU jax array is a view), so indexing one
    expert copies only that expert.
    """
    if w is None:
        return None
    if hasattr(w, "qdata"):
        return dequantize_f64(w, index)
    a = np.asarray(w)
    if index is not None:
        a = a[index]
    return a.astype(np.float64)


_VEC_DOT = {"int8": "q8_0", "int4": "q8_0", "q4_0": "q8_0", "q5_0": "q8_0", "iq4_nl": "q8_0", "mxfp4": "q8_0"}
_VEC_DOT.update({k: "q8_1" for k in ("q4_1", "q5_1")})
_VEC_DOT.update({k: "q8_K" for k in ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs")})
# ggml-cpu.c's type_traits_cpu: every IQ1-3 and TQ type's vec_dot_type is GGML_TYPE_Q8_K
_VEC_DOT.update(
    {k: "q8_K" for k in ("iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m", "tq1_0", "tq2_0")}
)


def ggml_format(w) -> str:
    """The activation type ggml's CPU backend converts activations to for weight ``w``
    (its ``vec_dot_type``): ``q8_0``, ``q8_1`` or ``q8_K`` by a quantized kind, ``f32`` /
    ``f16`` / ``bf16`` by a float weight's dtype."""
    if hasattr(w, "qdata"):
        return _VEC_DOT[w.kind]
    return {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}[str(w.dtype)]


def _nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's ``nearest_int``: the float32 magic-number rounding (half to even)."""
    f = (v.astype(np.float32) + np.float32(12582912.0)).astype(np.float32)
    return (f.view(np.int32) & 0x007FFFFF) - 0x00400000


def ggml_blocks_np(x: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """ggml's conversion of float32 activation rows ``x [..., n]`` to the block type ``fmt``
    (``q8_0``, ``q8_1``, ``q8_K``), written from ggml-cpu's x86 ``quantize_row_q8_0`` /
    ``quantize_row_q8_1`` and ``quantize_row_q8_K_ref`` in numpy float32: codes
    ``q [..., n]`` int64, scales ``d [..., n / block]`` (float16 values for ``q8_0`` /
    ``q8_1``, float32 for ``q8_K``) and, for ``q8_1``, the stored block sums
    ``s = f16(d sum(q))`` (else None). A block holding a NaN or an infinity gets codes 0."""
    x = np.asarray(x, np.float32)
    qk = 256 if fmt == "q8_K" else 32
    b = x.reshape(*x.shape[:-1], -1, qk)
    bad = ~np.all(np.isfinite(b), axis=-1, keepdims=True)
    b = np.where(bad, np.float32(0), b)
    if fmt == "q8_K":
        first = np.argmax(np.abs(b), axis=-1)[..., None]  # the first element of largest magnitude
        mx = np.take_along_axis(b, first, axis=-1)
        nz = mx != 0
        iscale = np.where(nz, np.float32(-127.0) / np.where(nz, mx, np.float32(1)), np.float32(0)).astype(np.float32)
        q = np.minimum(_nearest_int(iscale * b), 127).astype(np.int64)
        d = np.where(nz, np.float32(1.0) / np.where(nz, iscale, np.float32(1)), np.float32(0)).astype(np.float32)
        return q.reshape(x.shape), d[..., 0], None
    amax = np.max(np.abs(b), axis=-1, keepdims=True)
    d = (amax / np.float32(127.0)).astype(np.float32)
    nz = amax != 0
    inv = np.where(nz, np.float32(127.0) / np.where(nz, amax, np.float32(1)), np.float32(0)).astype(np.float32)
    q = np.rint((b * inv).astype(np.float32)).astype(np.int64)  # _mm256_round_ps: half to even
    s = None
    if fmt == "q8_1":
        s = (d[..., 0] * q.sum(-1).astype(np.float32)).astype(np.float16)
    return q.reshape(x.shape), d[..., 0].astype(np.float16), s


def ggml_quantize_np(x: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray | None]:
    """The float64 values ggml's conversion of ``x [..., n]`` (float32) to ``fmt`` stands
    for (``f16(d) q``, ``d q``, or ``x`` rounded to ``f16`` / ``bf16``; `ggml_blocks_np`),
    and for ``q8_1`` the stored block sums ``s`` as float64 (else None). Blocks holding a
    NaN or an infinity stand for NaN."""
    x = np.asarray(x, np.float32)
    if fmt == "f32":
        return x.astype(np.float64), None
    if fmt == "f16":
        return x.astype(np.float16).astype(np.float64), None
    if fmt == "bf16":
        u = x.view(np.uint32).astype(np.uint64)  # round to nearest even on the upper 16 bits
        r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
        return np.where(np.isnan(x), np.nan, r.astype(np.uint32).view(np.float32).astype(np.float64)), None
    q, d, s = ggml_blocks_np(x, fmt)
    qk = 256 if fmt == "q8_K" else 32
    v = q.reshape(*x.shape[:-1], -1, qk).astype(np.float64) * d.astype(np.float64)[..., None]
    bad = ~np.all(np.isfinite(x.reshape(*x.shape[:-1], -1, qk)), axis=-1, keepdims=True)
    v = np.where(bad, np.nan, v).reshape(x.shape)
    return v, None if s is None else s.astype(np.float64)


def block_minimums_np(qt, index=None) -> np.ndarray:
    """A Q4_1 / Q5_1 weight's per-block minimums ``m`` as float64 ``[in / 32, out]`` (bytes
    2-3 of each block)."""
    raw = np.asarray(qt.qdata if index is None else qt.qdata[index], np.uint8)
    size = {"q4_1": 20, "q5_1": 24}[qt.kind]
    blk = np.ascontiguousarray(raw.reshape(*raw.shape[:-1], -1, size)[..., 2:4])
    return np.swapaxes(blk.view(np.float16)[..., 0].astype(np.float64), -1, -2)


def dot_f64(x: np.ndarray, w, index=None, activations: str = "float") -> np.ndarray:
    """``x @ W`` in float64 (``W`` the weight ``w``, optionally expert ``index``). With
    ``activations="ggml"`` ``x`` is first converted as ggml converts it for ``w``
    (`ggml_quantize_np`), and a Q4_1 / Q5_1 weight's minimums meet the stored, rounded
    block sums ``s`` in place of the exact ones, as ggml's ``q4_1 x q8_1`` dot does."""
    wf = to_f64(w, index)
    if activations == "float":
        return np.asarray(x, np.float64) @ wf
    fmt = ggml_format(w)
    v, s = ggml_quantize_np(np.asarray(x, np.float32), fmt)
    y = v @ wf
    if s is not None and hasattr(w, "qdata"):
        exact = v.reshape(*v.shape[:-1], -1, 32).sum(-1)  # f16(d) sum(q), exact in float64
        y = y + (s - exact) @ block_minimums_np(w, index)
    return y


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


def route_f64(logits: np.ndarray, rc: RouterConfig, selection_bias: np.ndarray | None = None) -> RefRouting:
    """Routing of ``logits [T, E]`` in float64 (the routing steps of docs/routing.md)."""
    z = np.asarray(logits, np.float64)
    t, e = z.shape
    if e != rc.num_experts:
        raise ValueError(f"route_f64: logits have {e} experts, the router config {rc.num_experts}")
    k = rc.top_k
    s = _softmax(z) if rc.score_fn.startswith("softmax") else _sigmoid(z)
    # softmax_topk / sigmoid_topk select on the logits (monotone in the scores, same order)
    c = z.copy() if rc.score_fn.endswith("_topk") else s.copy()
    if selection_bias is not None:
        c = c + np.asarray(selection_bias, np.float64)[None, :]
    if rc.n_group > 1 and rc.topk_group < rc.n_group:
        per = e // rc.n_group
        g = c.reshape(t, rc.n_group, per)
        gs = g.max(axis=-1) if rc.group_score == "max" else -np.sort(-g, axis=-1)[..., :2].sum(axis=-1)
        order = np.lexsort((np.broadcast_to(np.arange(rc.n_group), gs.shape), -gs), axis=-1)
        keep = np.zeros((t, rc.n_group), bool)
        np.put_along_axis(keep, order[:, : rc.topk_group], True, axis=-1)
        c = np.where(np.repeat(keep, per, axis=1), c, -np.inf)
    # stable sort of -c: equal scores keep ascending expert id
    ids = np.argsort(-c, axis=-1, kind="stable")[:, :k]
    if rc.score_fn == "softmax_topk":
        w = _softmax(np.take_along_axis(z, ids, axis=-1))
    elif rc.score_fn == "sigmoid_topk":
        w = _sigmoid(np.take_along_axis(z, ids, axis=-1))
    else:
        w = np.take_along_axis(s, ids, axis=-1)
    if rc.renorm != "none":
        den = w.sum(axis=-1, keepdims=True)
        if rc.renorm == "clamp":
            den = np.maximum(den, rc.renorm_eps)
        elif rc.renorm == "add":
            den = den + rc.renorm_eps
        w = w / den
    w = w * rc.routed_scaling_factor
    return RefRouting(ids.astype(np.int64), w, s)


def act_f64(g: np.ndarray, u: np.ndarray, activation: str = "swiglu", alpha: float = 1.702, limit: float = 7.0):
    """The expert activation of the gate and up projections: ``swiglu`` ``silu(g) * u``, or
    ``swiglu_oai`` (gpt-oss) ``(clip(u, -limit, limit) + 1) * g' * sigmoid(alpha * g')``
    with ``g' = min(g, limit)``."""
    if activation == "swiglu":
        return g * _sigmoid(g) * u
    g = np.minimum(g, limit)
    u = np.clip(u, -limit, limit)
    return (u + 1.0) * g * _sigmoid(alpha * g)


def _act(g: np.ndarray, u: np.ndarray, cfg: MoEConfig) -> np.ndarray:
    return act_f64(g, u, cfg.activation, cfg.swiglu_alpha, cfg.swiglu_limit)


def router_logits_f64(params: MoEParams, x: np.ndarray) -> np.ndarray:
    """``[T, E]`` float64 logits ``x W_r (+ b_r)``."""
    z = np.asarray(x, np.float64) @ to_f64(params.w_router)
    if params.b_router is not None:
        z = z + to_f64(params.b_router)
    return z


def _ffn(x: np.ndarray, wg, wu, wd, cfg: MoEConfig, index=None, activations: str = "float", bias=None):
    g = dot_f64(x, wg, index, activations)
    u = dot_f64(x, wu, index, activations)
    if bias is not None:
        g, u = g + bias[0], u + bias[1]
    h = _act(g, u, cfg)
    if activations == "ggml":
        h = h.astype(np.float32)  # ggml's SwiGLU output is float32
    out = dot_f64(h, wd, index, activations)
    return out if bias is None else out + bias[2]


def shared_f64(
    params: MoEParams, x: np.ndarray, cfg: MoEConfig, activations: str = "float"
) -> tuple[np.ndarray, np.ndarray | None]:
    """Shared-expert output ``[T, d]`` and its gate ``[T]`` (None when ungated)."""
    x = np.asarray(x, np.float64)
    sh = params.shared
    if sh is None:
        return np.zeros_like(x), None
    y = _ffn(x, sh.w_gate, sh.w_up, sh.w_down, cfg, activations=activations)
    if sh.gate is None:
        return y, None
    gate = _sigmoid(x @ to_f64(sh.gate))
    return y * gate[:, None], gate


def routed_f64(params: MoEParams, x: np.ndarray, routing, cfg: MoEConfig, activations: str = "float") -> np.ndarray:
    """Routed output ``[T, d]`` float64 under ``routing`` (anything with ``expert_ids [T, k]``
    and ``weights [T, k]``: a `RefRouting`, a `jaxmoe.routing.Routing`): for each expert
    used, its tokens. A pair whose id lies outside ``[0, E)`` adds nothing (docs/routing.md,
    "Invalid expert ids")."""
    x = np.asarray(x, np.float64)
    ids = np.asarray(routing.expert_ids)
    weights = np.asarray(routing.weights, np.float64)
    ew = params.experts
    n_experts = ew.w_gate.shape[0]
    y = np.zeros_like(x)
    for e in np.unique(ids[(ids >= 0) & (ids < n_experts)]):
        tok, slot = np.nonzero(ids == e)
        w = weights[tok, slot][:, None]
        xin = x[tok] * w if cfg.weight_on_input else x[tok]
        bias = None if ew.b_gate is None else (to_f64(ew.b_gate, e), to_f64(ew.b_up, e), to_f64(ew.b_down, e))
        out = _ffn(xin, ew.w_gate, ew.w_up, ew.w_down, cfg, e, activations, bias)
        if not cfg.weight_on_input:
            out = out * w
        np.add.at(y, tok, out)
    return y


def reference_forward(
    params: MoEParams, x: np.ndarray, cfg: MoEConfig, activations: str = "float"
) -> tuple[np.ndarray, RefRouting]:
    """The layer in float64. ``x [T, d]`` -> (``y [T, d]`` float64, `RefRouting`).

    ``activations="ggml"``: every expert product first converts its activations as
    llama.cpp's CPU backend does (`dot_f64`), then computes exactly; the router and the
    shared expert's gate stay float (their weights are float32 in a GGUF file)."""
    x = np.asarray(x, np.float64)
    if x.ndim != 2 or x.shape[1] != cfg.d_model:
        raise ValueError(f"reference_forward: x must be [T, {cfg.d_model}], got {x.shape}")
    sb = None if params.selection_bias is None else to_f64(params.selection_bias)
    r = route_f64(router_logits_f64(params, x), cfg.router, sb)
    y = routed_f64(params, x, r, cfg, activations) + shared_f64(params, x, cfg, activations)[0]
    return y, r

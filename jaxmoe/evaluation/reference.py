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
    The GGUF block kinds (``q4_k``, ...) are decoded by ``gguf.quants.dequantize``.
    """
    take = (lambda a: a) if index is None else (lambda a: a[index])
    if qt.scales is None:  # a GGUF block kind: gguf-py decodes the raw blocks (float32, exact)
        raw = np.asarray(take(qt.qdata), np.uint8)
        return np.swapaxes(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qt.kind.upper()]), -1, -2).astype(
            np.float64
        )
    q = np.asarray(take(qt.qdata))
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


def shared_f64(params: MoEParams, x: np.ndarray, cfg: MoEConfig) -> tuple[np.ndarray, np.ndarray | None]:
    """Shared-expert output ``[T, d]`` and its gate ``[T]`` (None when ungated)."""
    x = np.asarray(x, np.float64)
    sh = params.shared
    if sh is None:
        return np.zeros_like(x), None
    y = _act(x @ to_f64(sh.w_gate), x @ to_f64(sh.w_up), cfg) @ to_f64(sh.w_down)
    if sh.gate is None:
        return y, None
    gate = _sigmoid(x @ to_f64(sh.gate))
    return y * gate[:, None], gate


def routed_f64(params: MoEParams, x: np.ndarray, routing, cfg: MoEConfig) -> np.ndarray:
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
        g = xin @ to_f64(ew.w_gate, e)
        u = xin @ to_f64(ew.w_up, e)
        if ew.b_gate is not None:
            g = g + to_f64(ew.b_gate, e)
            u = u + to_f64(ew.b_up, e)
        out = _act(g, u, cfg) @ to_f64(ew.w_down, e)
        if ew.b_down is not None:
            out = out + to_f64(ew.b_down, e)
        if not cfg.weight_on_input:
            out = out * w
        np.add.at(y, tok, out)
    return y


def reference_forward(params: MoEParams, x: np.ndarray, cfg: MoEConfig) -> tuple[np.ndarray, RefRouting]:
    """The layer in float64. ``x [T, d]`` -> (``y [T, d]`` float64, `RefRouting`)."""
    x = np.asarray(x, np.float64)
    if x.ndim != 2 or x.shape[1] != cfg.d_model:
        raise ValueError(f"reference_forward: x must be [T, {cfg.d_model}], got {x.shape}")
    sb = None if params.selection_bias is None else to_f64(params.selection_bias)
    r = route_f64(router_logits_f64(params, x), cfg.router, sb)
    y = routed_f64(params, x, r, cfg) + shared_f64(params, x, cfg)[0]
    return y, r

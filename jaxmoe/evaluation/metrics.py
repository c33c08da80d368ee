"""The numbers an eval run reports, as pure numpy functions.

Every function returns plain Python floats / ints / lists; `quantity` wraps a number
with its unit the way ``results.json`` stores it (``{"value": 1.5, "unit": "ms"}``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def quantity(value: Any, unit: str) -> dict[str, Any]:
    """``{"value": value, "unit": unit}``; non-finite floats become None (valid JSON)."""
    if isinstance(value, (float, np.floating)):
        value = float(value)
        if not math.isfinite(value):
            value = None
    elif isinstance(value, np.integer):
        value = int(value)
    elif isinstance(value, np.ndarray):
        value = value.tolist()
    return {"value": value, "unit": unit}


# --------------------------------------------------------------------------- accuracy


def errors(y: np.ndarray, ref: np.ndarray) -> dict[str, float]:
    """Error of ``y [T, d]`` against ``ref [T, d]`` (float64 math).

    Returns ``max_abs`` = max |y - ref|, ``rel`` = max |y - ref| / max |ref| (the gated
    number), ``rms_rel`` = ||y - ref||_2 / ||ref||_2, and ``finite`` (all of y finite).
    """
    y = np.asarray(y, np.float64)
    ref = np.asarray(ref, np.float64)
    if y.shape != ref.shape:
        raise ValueError(f"errors: output {y.shape} and reference {ref.shape} differ in shape")
    finite = bool(np.isfinite(y).all())
    diff = np.abs(y - ref)
    max_abs = float(diff.max()) if diff.size else 0.0
    scale = float(np.abs(ref).max()) if ref.size else 0.0
    norm = float(np.linalg.norm(ref))
    if not finite:
        return {"max_abs": math.inf, "rel": math.inf, "rms_rel": math.inf, "finite": False}
    return {
        "max_abs": max_abs,
        "rel": max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf),
        "rms_rel": float(np.linalg.norm(y - ref)) / norm if norm > 0 else (0.0 if max_abs == 0 else math.inf),
        "finite": True,
    }


def routing_agreement(ids: np.ndarray, ref_ids: np.ndarray) -> float:
    """Fraction of tokens whose selected expert SET equals the reference's (``[T, k]`` each)."""
    a = np.sort(np.asarray(ids), axis=-1)
    b = np.sort(np.asarray(ref_ids), axis=-1)
    if a.shape != b.shape:
        raise ValueError(f"routing_agreement: ids {a.shape} and reference ids {b.shape} differ in shape")
    if a.shape[0] == 0:
        return 1.0
    return float((a == b).all(axis=-1).mean())


# --------------------------------------------------------------------------- timing


def timing(samples_s: list[float], tokens: int) -> dict[str, float]:
    """Median, quartiles, min, max of wall times (seconds) and tokens per second at the median."""
    t = np.asarray(samples_s, np.float64)
    if t.size == 0:
        raise ValueError("timing: no samples")
    q1, med, q3 = np.percentile(t, [25, 50, 75])
    return {
        "median_s": float(med),
        "q1_s": float(q1),
        "q3_s": float(q3),
        "iqr_s": float(q3 - q1),
        "min_s": float(t.min()),
        "max_s": float(t.max()),
        "tokens_per_s": tokens / float(med),
    }


# --------------------------------------------------------------------------- weight traffic


def nbytes(a) -> int:
    """Bytes of an array or `QuantizedTensor` (0 for None)."""
    if a is None:
        return 0
    return int(a.nbytes)


def weight_bytes(params) -> dict[str, int]:
    """Bytes the layer's weights occupy: ``router``, ``shared``, ``per_expert``, ``experts`` (all E)."""
    ew = params.experts
    experts = sum(nbytes(getattr(ew, f)) for f in ("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down"))
    e = ew.w_gate.shape[0]
    router = nbytes(params.w_router) + nbytes(params.b_router) + nbytes(params.selection_bias)
    shared = 0
    if params.shared is not None:
        sh = params.shared
        shared = sum(nbytes(getattr(sh, f)) for f in ("w_gate", "w_up", "w_down", "gate"))
    return {"router": router, "shared": shared, "per_expert": experts // e, "experts": experts}


def bytes_to_read(wb: dict[str, int], expert_ids: np.ndarray) -> tuple[int, int]:
    """Weight bytes one forward must read at least: the distinct experts in ``expert_ids``,
    the shared expert and the router. Returns (bytes, distinct experts)."""
    n = int(np.unique(np.asarray(expert_ids)).size)
    return n * wb["per_expert"] + wb["shared"] + wb["router"], n


# --------------------------------------------------------------------------- routing statistics


def load_stats(expert_ids: np.ndarray, num_experts: int) -> dict[str, Any]:
    """Expert load over ``expert_ids [T, k]``: counts ``[E]``, max/mean, coefficient of
    variation (std/mean), idle experts, and the load entropy in bits (log2 E when uniform)."""
    ids = np.asarray(expert_ids).reshape(-1)
    counts = np.bincount(ids, minlength=num_experts)[:num_experts]
    mean = counts.mean()
    p = counts / counts.sum() if counts.sum() else np.full(num_experts, 1.0 / num_experts)
    nz = p[p > 0]
    return {
        "counts": counts.astype(int).tolist(),
        "max_over_mean": float(counts.max() / mean) if mean > 0 else math.nan,
        "cv": float(counts.std() / mean) if mean > 0 else math.nan,
        "idle": int((counts == 0).sum()),
        "load_entropy_bits": float(-(nz * np.log2(nz)).sum()),
        "max_entropy_bits": float(np.log2(num_experts)),
    }


def routing_entropy(scores: np.ndarray) -> float:
    """Mean over tokens of the entropy (nats) of the router's scores ``[T, E]`` normalized to sum 1.

    For softmax routers that is the entropy of the router distribution; ``log E`` is the
    uniform maximum.
    """
    s = np.asarray(scores, np.float64)
    p = s / s.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -np.where(p > 0, p * np.log(p), 0.0).sum(axis=-1)
    return float(h.mean())


def mean_top1_weight(weights: np.ndarray) -> float:
    """Mean combine weight of slot 0 (the highest-scoring expert) over tokens."""
    return float(np.asarray(weights, np.float64)[:, 0].mean())

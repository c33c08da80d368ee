"""Routing traces: a synthetic generator with tunable locality, and load / save.

A routing trace is ``ids [tokens, layers, k]`` int32 here: the experts each decode token
selected at each layer. On disk it is the safetensors routing trace of `jaxmoe.traces`
(uint8 / uint16 ids ``[layers, tokens, k]``, a header naming the model, ``E`` and ``k``;
`save_trace` writes it id-only, `load_trace` reads one with or without weights) or an
``.npy`` of the int32 array. Random weights route with almost no temporal locality, real
models route with a lot; the generator lets the predictors be compared on a known
amount of it:

- ``locality`` p: each slot reuses one of the previous token's experts at the same
  layer with probability p (the temporal locality a previous-token predictor exploits);
- ``layer_corr`` q: otherwise, with probability q, it takes the image under a fixed
  random permutation of one of this token's experts at the layer before (the
  cross-layer correlation a learned predictor can pick up);
- otherwise it draws from a per-layer popularity law ``P(rank r) ~ (r + 1) ** -zipf``
  (``zipf = 0`` is uniform).

A slot whose draw repeats an expert already chosen redraws from the popularity law,
so every row holds k distinct experts. Hidden-state traces are ``[tokens, d]`` float
arrays (the inputs of the first layer, recorded from a real model or a resident run).
"""

from __future__ import annotations

import os

import numpy as np

from jaxmoe.traces import RoutingTrace, load_routing_trace, save_routing_trace


def synthetic_trace(
    num_tokens: int,
    num_layers: int,
    num_experts: int,
    top_k: int,
    *,
    locality: float = 0.5,
    layer_corr: float = 0.0,
    zipf: float = 0.0,
    seed: int = 0,
) -> np.ndarray:
    """A synthetic routing trace ``[num_tokens, num_layers, top_k]`` int32 (see module doc)."""
    for name, v in (
        ("num_tokens", num_tokens),
        ("num_layers", num_layers),
        ("num_experts", num_experts),
        ("top_k", top_k),
    ):
        if not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"synthetic_trace: {name} must be a positive int, got {v!r}")
    if top_k > num_experts:
        raise ValueError(f"synthetic_trace: top_k={top_k} exceeds num_experts={num_experts}")
    for name, v in (("locality", locality), ("layer_corr", layer_corr)):
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"synthetic_trace: {name} must lie in [0, 1], got {v}")
    if locality + layer_corr > 1.0 + 1e-12:
        raise ValueError(f"synthetic_trace: locality + layer_corr must be <= 1, got {locality} + {layer_corr}")
    if zipf < 0:
        raise ValueError(f"synthetic_trace: zipf must be >= 0, got {zipf}")
    rng = np.random.default_rng(seed)
    e = num_experts
    ranks = [rng.permutation(e) for _ in range(num_layers)]  # ranks[l][r] = expert of rank r
    pop = (np.arange(e) + 1.0) ** -zipf
    pop /= pop.sum()
    perms = [rng.permutation(e) for _ in range(num_layers)]
    out = np.zeros((num_tokens, num_layers, top_k), np.int32)

    def draw(l, taken):
        while True:
            x = int(ranks[l][rng.choice(e, p=pop)])
            if x not in taken:
                return x

    for t in range(num_tokens):
        for l in range(num_layers):
            taken: list[int] = []
            prev = list(out[t - 1, l]) if t > 0 else []
            below = list(out[t, l - 1]) if l > 0 else []
            for _ in range(top_k):
                u = rng.random()
                x = None
                if u < locality and prev:
                    cands = [p for p in prev if p not in taken]
                    if cands:
                        x = int(cands[rng.integers(len(cands))])
                elif u < locality + layer_corr and below:
                    cands = [int(perms[l][b]) for b in below if int(perms[l][b]) not in taken]
                    if cands:
                        x = cands[rng.integers(len(cands))]
                if x is None:
                    x = draw(l, taken)
                taken.append(x)
            out[t, l] = taken
    return out


def reuse_rate(ids: np.ndarray) -> float:
    """Mean fraction of a token's experts (per layer) that the previous token also selected."""
    ids = check_trace(ids)
    n, L, k = ids.shape
    if n < 2:
        raise ValueError(f"reuse_rate: needs at least 2 tokens, got trace shape {ids.shape}")
    hit = 0
    for t in range(1, n):
        for l in range(L):
            hit += len(set(ids[t, l].tolist()) & set(ids[t - 1, l].tolist()))
    return hit / ((n - 1) * L * k)


def check_trace(
    ids,
    num_layers: int | None = None,
    num_experts: int | None = None,
    top_k: int | None = None,
    *,
    source: str = "trace",
) -> np.ndarray:
    """Validates a routing trace ``[tokens, layers, k]`` and returns it as int32."""
    a = np.asarray(ids)
    if a.ndim != 3:
        raise ValueError(f"{source}: a routing trace must be [tokens, layers, k], got shape {a.shape}")
    if not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"{source}: a routing trace must hold integers, got {a.dtype}")
    if num_layers is not None and a.shape[1] < num_layers:
        raise ValueError(f"{source}: trace has {a.shape[1]} layers, the model needs {num_layers} (shape {a.shape})")
    if top_k is not None and a.shape[2] != top_k:
        raise ValueError(f"{source}: trace has k={a.shape[2]}, the model routes top_k={top_k} (shape {a.shape})")
    if a.size and a.min() < 0:
        raise ValueError(f"{source}: trace holds a negative expert id {a.min()}")
    if num_experts is not None and a.size and a.max() >= num_experts:
        raise ValueError(f"{source}: trace holds expert id {a.max()} >= num_experts={num_experts}")
    srt = np.sort(a, axis=-1)
    if a.shape[2] > 1 and (srt[..., 1:] == srt[..., :-1]).any():
        raise ValueError(f"{source}: a trace row repeats an expert (each row needs k distinct ids)")
    return a.astype(np.int32)


def save_trace(
    path: str | os.PathLike, ids, num_experts: int | None = None, *, model: str = "", preset: str = ""
) -> None:
    """Saves a routing trace ``[tokens, layers, k]``: a ``.npy`` path gets the int32 array,
    any other path an id-only safetensors routing trace (`jaxmoe.traces`; it needs
    ``num_experts``, and ``model`` / ``preset`` go into its header)."""
    a = check_trace(ids, num_experts=num_experts, source=str(path))
    if str(path).endswith(".npy"):
        np.save(path, a)
        return
    if num_experts is None:
        raise ValueError(f"{path}: a safetensors routing trace needs num_experts (its header and id dtype)")
    save_routing_trace(path, RoutingTrace(a.transpose(1, 0, 2), None, num_experts, model=model, preset=preset))


def load_trace(
    path: str | os.PathLike, num_layers: int | None = None, num_experts: int | None = None, top_k: int | None = None
) -> np.ndarray:
    """Loads and validates a routing trace ``[tokens, layers, k]`` int32 from a ``.npy``
    or a safetensors routing trace (`jaxmoe.traces.load_routing_trace`; its weights, if
    any, are not used here)."""
    if not os.path.isfile(path):
        raise ValueError(f"routing trace {path} not found")
    if str(path).endswith(".npy"):
        a = np.load(path)
    else:
        a = load_routing_trace(path, num_experts=num_experts, top_k=top_k).expert_ids.transpose(1, 0, 2)
    return check_trace(a, num_layers, num_experts, top_k, source=str(path))


def load_hidden(path: str | os.PathLike, d_model: int) -> np.ndarray:
    """Loads recorded hidden states ``[tokens, d]`` (float) from ``.npy``."""
    if not os.path.isfile(path):
        raise ValueError(f"hidden-state trace {path} not found")
    a = np.load(path)
    if a.ndim != 2 or a.shape[1] != d_model or not np.issubdtype(a.dtype, np.floating):
        raise ValueError(f"{path}: hidden states must be float [tokens, {d_model}], got {a.dtype} {a.shape}")
    if not np.isfinite(a).all():
        raise ValueError(f"{path}: hidden states hold NaN or Inf")
    return a.astype(np.float32)

"""Compact routing traces: which experts each token chose at each layer, with their weights,
as one safetensors file.

A `RoutingTrace` holds

- ``expert_ids [L, T, k]`` in the smallest unsigned integer type that holds ``E``
  (`ids_dtype`: uint8 while it holds ``E - 1``, else uint16, else uint32),
- ``weights [L, T, k]`` in bfloat16 or float32 (or none: an id-only trace, such as the
  offload evaluator's, `jaxmoe.offload.traces`),
- the header: ``model``, ``preset``, ``layers`` (the model layer of each row of the
  first axis), ``num_experts``, ``top_k``, the two dtypes, the format name and version.

On disk (`save_routing_trace`, `load_routing_trace`) the arrays are the safetensors
tensors ``expert_ids`` and ``weights`` and the header is the safetensors metadata (all
values strings; ``layers`` a JSON list). A trace that cannot be what it claims is a
`TraceError` naming the file and the key, tensor or shape at fault: a missing or
unknown header key value, an unknown format version or dtype, ids at or past
``num_experts``, a row that repeats an expert, ``expert_ids`` and ``weights`` of
different shapes, a ``k`` other than ``top_k``, a truncated or corrupt file.

Replay: ``trace.routing(layer)`` is the `jaxmoe.Routing` ``[T, k]`` (int32 ids, float32
weights) to pass as ``routing=`` to `jaxmoe.moe_apply` or
`jaxmoe.parallel.moe_apply_ep`. With float32 weights the replayed call gives the
recorded call's output bit for bit; bfloat16 weights halve the file and replay the
weights rounded to bfloat16. `TraceRecorder` collects the routings of
``return_routing=True`` calls (one host copy per call) and builds the trace.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxmoe.routing import Routing

FORMAT = "jaxmoe.routing_trace"
#: Format versions this module reads; it writes the last.
VERSIONS = ("1",)
HEADER_KEYS = ("format", "version", "model", "preset", "layers", "num_experts", "top_k", "ids_dtype", "weights_dtype")
WEIGHT_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
IDS_TENSOR, WEIGHTS_TENSOR = "expert_ids", "weights"


class TraceError(ValueError):
    """A routing trace that is not what it claims or not what the caller needs: the message
    names the file (when there is one) and the key, tensor or shape at fault."""


def ids_dtype(num_experts: int) -> np.dtype:
    """The smallest unsigned integer dtype that holds the ids ``[0, num_experts)``."""
    if not isinstance(num_experts, int | np.integer) or isinstance(num_experts, bool) or num_experts < 1:
        raise TraceError(f"num_experts must be a positive int, got {num_experts!r}")
    for dt in (np.uint8, np.uint16, np.uint32):
        if num_experts - 1 <= np.iinfo(dt).max:
            return np.dtype(dt)
    raise TraceError(f"num_experts={num_experts} does not fit uint32 ids")


@dataclasses.dataclass(frozen=True)
class RoutingTrace:
    """The routing of ``T`` tokens at ``L`` layers (see the module docstring).

    Attributes:
      expert_ids: ``[L, T, k]`` ids in `ids_dtype` of ``num_experts`` (any integer array
        is accepted and converted after the range check).
      weights: ``[L, T, k]`` bfloat16 or float32 (a float64 / float16 array is converted
        to float32), or None for an id-only trace.
      num_experts: ``E``.
      layers: the model layer of each row of the first axis (default ``0 .. L - 1``).
      model: free-form model name.
      preset: the jaxmoe preset, if any.
    """

    expert_ids: np.ndarray
    weights: np.ndarray | None
    num_experts: int
    layers: tuple[int, ...] = ()
    model: str = ""
    preset: str = ""

    def __post_init__(self):
        idt = ids_dtype(self.num_experts)
        ids = np.asarray(self.expert_ids)
        if ids.ndim != 3:
            raise TraceError(f"expert_ids must be [layers, tokens, k], got shape {ids.shape}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise TraceError(f"expert_ids must be an integer array, got {ids.dtype}")
        if ids.shape[2] < 1 or ids.shape[2] > self.num_experts:
            raise TraceError(f"expert_ids has k={ids.shape[2]}, which must lie in [1, num_experts={self.num_experts}]")
        if ids.size:
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= self.num_experts:
                bad = lo if lo < 0 else hi
                raise TraceError(f"expert_ids holds id {bad} outside [0, num_experts={self.num_experts})")
            srt = np.sort(ids, axis=-1)
            if (srt[..., 1:] == srt[..., :-1]).any():
                l, t = np.argwhere((srt[..., 1:] == srt[..., :-1]).any(-1))[0]
                raise TraceError(f"expert_ids row (layer row {l}, token {t}) repeats an expert: {ids[l, t].tolist()}")
        object.__setattr__(self, "expert_ids", ids.astype(idt))
        if self.weights is not None:
            w = np.asarray(self.weights)
            if w.shape != ids.shape:
                raise TraceError(f"weights has shape {w.shape}, expert_ids {ids.shape}: they must be equal")
            if w.dtype not in WEIGHT_DTYPES.values():
                if not np.issubdtype(w.dtype, np.floating):
                    raise TraceError(f"weights must be float32 or bfloat16, got {w.dtype}")
                w = w.astype(np.float32)
            object.__setattr__(self, "weights", w)
        layers = tuple(range(ids.shape[0])) if not self.layers else tuple(int(v) for v in self.layers)
        if len(layers) != ids.shape[0] or len(set(layers)) != len(layers) or min(layers, default=0) < 0:
            raise TraceError(
                f"layers {list(layers)} must be {ids.shape[0]} distinct non-negative layer numbers "
                f"(one per row of expert_ids {ids.shape})"
            )
        object.__setattr__(self, "layers", layers)

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(L, T, k)``: layers, tokens, experts per token."""
        layers, tokens, k = self.expert_ids.shape
        return layers, tokens, k

    @property
    def top_k(self) -> int:
        """``k``."""
        return self.shape[2]

    @property
    def weights_dtype(self) -> str:
        """``float32``, ``bfloat16`` or ``none``."""
        return "none" if self.weights is None else str(self.weights.dtype)

    def header(self) -> dict[str, str]:
        """The safetensors metadata of this trace (every value a string)."""
        return {
            "format": FORMAT,
            "version": VERSIONS[-1],
            "model": self.model,
            "preset": self.preset,
            "layers": json.dumps(list(self.layers)),
            "num_experts": str(self.num_experts),
            "top_k": str(self.top_k),
            "ids_dtype": str(self.expert_ids.dtype),
            "weights_dtype": self.weights_dtype,
        }

    def with_weights(self, dtype: str) -> RoutingTrace:
        """The same trace with its weights converted to ``float32`` or ``bfloat16``."""
        if dtype not in WEIGHT_DTYPES:
            raise TraceError(f"weights dtype must be one of {sorted(WEIGHT_DTYPES)}, got {dtype!r}")
        if self.weights is None:
            raise TraceError("this trace holds no weights (an id-only trace)")
        return dataclasses.replace(self, weights=self.weights.astype(WEIGHT_DTYPES[dtype]))

    def routing(self, layer: int) -> Routing:
        """The `jaxmoe.Routing` of model layer ``layer``: ``expert_ids [T, k]`` int32,
        ``weights [T, k]`` float32 (bfloat16 weights widened exactly), for
        ``moe_apply(..., routing=...)`` or ``moe_apply_ep(..., routing=...)``."""
        if layer not in self.layers:
            raise TraceError(f"layer {layer} is not in the trace (layers {list(self.layers)})")
        if self.weights is None:
            raise TraceError("this trace holds no weights (an id-only trace): it cannot be replayed into a layer")
        i = self.layers.index(layer)
        return Routing(jnp.asarray(self.expert_ids[i], jnp.int32), jnp.asarray(self.weights[i].astype(np.float32)))


def save_routing_trace(path: str | os.PathLike, trace: RoutingTrace) -> None:
    """Writes ``trace`` as a safetensors file (tensors ``expert_ids``, ``weights``; the
    header as metadata)."""
    if not isinstance(trace, RoutingTrace):
        raise TraceError(f"{path}: save_routing_trace takes a RoutingTrace, got {type(trace).__name__}")
    tensors = {IDS_TENSOR: np.ascontiguousarray(trace.expert_ids)}
    if trace.weights is not None:
        tensors[WEIGHTS_TENSOR] = np.ascontiguousarray(trace.weights)
    save_file(tensors, str(path), metadata=trace.header())


def _int(meta: dict[str, str], key: str, path) -> int:
    try:
        v = int(meta[key])
    except ValueError:
        raise TraceError(f"{path}: header key {key!r} is not an integer: {meta[key]!r}") from None
    if v < 1:
        raise TraceError(f"{path}: header key {key!r} must be positive, got {v}")
    return v


def _layers(meta: dict[str, str], path) -> list[int]:
    try:
        layers = json.loads(meta["layers"])
    except json.JSONDecodeError:
        raise TraceError(f"{path}: header key 'layers' is not a JSON list: {meta['layers']!r}") from None
    if not isinstance(layers, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in layers):
        raise TraceError(f"{path}: header key 'layers' must be a JSON list of ints, got {meta['layers']!r}")
    return layers


def load_routing_trace(
    path: str | os.PathLike, *, num_experts: int | None = None, top_k: int | None = None
) -> RoutingTrace:
    """Reads and checks a trace written by `save_routing_trace`.

    Args:
      path: the ``.safetensors`` file.
      num_experts: when given, the trace must be of this ``E`` (and so its ids below it).
      top_k: when given, the trace's ``k`` must equal it.
    Raises:
      TraceError: naming the file and what is wrong (module docstring).
    """
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"routing trace {path} not found")
    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = dict(f.metadata() or {})
            names = set(f.keys())
            tensors = {n: f.get_tensor(n) for n in names & {IDS_TENSOR, WEIGHTS_TENSOR}}
    except Exception as e:  # safetensors raises its own error types for truncated / corrupt files
        raise TraceError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None
    missing = [k for k in HEADER_KEYS if k not in meta]
    if missing:
        raise TraceError(f"{path}: the header lacks key(s) {missing} (a routing trace needs {list(HEADER_KEYS)})")
    if meta["format"] != FORMAT:
        raise TraceError(f"{path}: header key 'format' is {meta['format']!r}, expected {FORMAT!r}")
    if meta["version"] not in VERSIONS:
        raise TraceError(f"{path}: unknown format version {meta['version']!r} (this jaxmoe reads {list(VERSIONS)})")
    e, k = _int(meta, "num_experts", path), _int(meta, "top_k", path)
    layers = _layers(meta, path)
    wdt = meta["weights_dtype"]
    if wdt not in (*WEIGHT_DTYPES, "none"):
        raise TraceError(f"{path}: unknown weights_dtype {wdt!r} (expected one of {[*WEIGHT_DTYPES, 'none']})")
    try:
        want_ids = ids_dtype(e)
    except TraceError as err:
        raise TraceError(f"{path}: {err}") from None
    if meta["ids_dtype"] != str(want_ids):
        raise TraceError(f"{path}: ids_dtype {meta['ids_dtype']!r}, but num_experts={e} is stored as {want_ids}")
    want_names = {IDS_TENSOR} | (set() if wdt == "none" else {WEIGHTS_TENSOR})
    if names != want_names:
        raise TraceError(f"{path}: tensors {sorted(names)}, expected {sorted(want_names)} (weights_dtype {wdt!r})")
    ids, w = tensors[IDS_TENSOR], tensors.get(WEIGHTS_TENSOR)
    if ids.dtype != want_ids:
        raise TraceError(f"{path}: tensor 'expert_ids' is {ids.dtype}, the header says {want_ids}")
    if w is not None and w.dtype != WEIGHT_DTYPES[wdt]:
        raise TraceError(f"{path}: tensor 'weights' is {w.dtype}, the header says {wdt}")
    if ids.ndim != 3 or ids.shape[2] != k:
        raise TraceError(f"{path}: tensor 'expert_ids' has shape {ids.shape}, expected [layers, tokens, top_k={k}]")
    if num_experts is not None and num_experts != e:
        raise TraceError(f"{path}: the trace is of num_experts={e}, the model has {num_experts}")
    if top_k is not None and top_k != k:
        raise TraceError(f"{path}: the trace has top_k={k}, the model routes top_k={top_k}")
    try:
        return RoutingTrace(ids, w, e, tuple(layers), meta["model"], meta["preset"])
    except TraceError as err:
        raise TraceError(f"{path}: {err}") from None


class TraceRecorder:
    """Collects the routings of ``return_routing=True`` calls into a `RoutingTrace`.

    ``rec.record(layer, routing)`` after each call (``routing [T, k]``; copied to the host,
    one sync per call); calls of the same layer append tokens. ``rec.trace()`` needs every
    recorded layer to hold the same number of tokens.
    """

    def __init__(self, num_experts: int, top_k: int, *, model: str = "", preset: str = ""):
        ids_dtype(num_experts)
        self.num_experts, self.top_k, self.model, self.preset = num_experts, top_k, model, preset
        self._ids: dict[int, list[np.ndarray]] = {}
        self._w: dict[int, list[np.ndarray]] = {}

    def record(self, layer: int, routing: Routing) -> None:
        """Appends ``routing`` (a `jaxmoe.Routing` ``[T, k]``) to model layer ``layer``."""
        ids, w = np.asarray(routing.expert_ids), np.asarray(routing.weights)
        if ids.ndim != 2 or ids.shape[1] != self.top_k or w.shape != ids.shape:
            raise TraceError(
                f"TraceRecorder.record(layer {layer}): expert_ids {ids.shape} and weights {w.shape} must both be "
                f"[T, top_k={self.top_k}]"
            )
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_experts):
            raise TraceError(f"TraceRecorder.record(layer {layer}): an id lies outside [0, {self.num_experts})")
        self._ids.setdefault(layer, []).append(ids)
        self._w.setdefault(layer, []).append(w.astype(np.float32))

    def trace(self, weights_dtype: str = "float32") -> RoutingTrace:
        """The recorded layers (ascending) as one `RoutingTrace` with ``weights_dtype`` weights."""
        if weights_dtype not in WEIGHT_DTYPES:
            raise TraceError(f"weights dtype must be one of {sorted(WEIGHT_DTYPES)}, got {weights_dtype!r}")
        if not self._ids:
            raise TraceError("TraceRecorder.trace: nothing was recorded")
        layers = sorted(self._ids)
        ids = [np.concatenate(self._ids[l]) for l in layers]
        counts = {l: a.shape[0] for l, a in zip(layers, ids)}
        if len(set(counts.values())) != 1:
            raise TraceError(f"TraceRecorder.trace: layers hold different token counts {counts}")
        w = np.stack([np.concatenate(self._w[l]) for l in layers]).astype(WEIGHT_DTYPES[weights_dtype])
        return RoutingTrace(np.stack(ids), w, self.num_experts, tuple(layers), self.model, self.preset)

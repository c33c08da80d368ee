"""Experts streamed from storage: expert stores, a byte-budgeted device cache, prerouters
that prefetch, a multi-layer decode driver, and routing traces.

- `jaxmoe.offload.store`: `SafetensorsStore` / `GGUFStore` (memory-mapped, quantized as stored).
- `jaxmoe.offload.cache`: `ExpertCache` (LRU / LFU, byte budget), `LayeredCache`.
- `jaxmoe.offload.prerouter`: predictors (``prev_token``, ``next_router``, ``learned``,
  ``oracle``) and the background `Prefetcher`.
- `jaxmoe.offload.driver`: `OffloadedModel` (resident and streamed decode runs, metrics).
- `jaxmoe.offload.traces`: synthetic traces with tunable locality; load / save as safetensors
  routing traces (`jaxmoe.traces`) or ``.npy``.

The sweep over budgets and predictors is the eval kind `jaxmoe.evaluation.offload`
(``jaxmoe eval offload``).
"""

from jaxmoe.offload.cache import ExpertCache, LayeredCache, make_cache
from jaxmoe.offload.driver import OffloadConfig, OffloadedModel, OffloadStats, RunResult
from jaxmoe.offload.prerouter import (
    PREDICTORS,
    LearnedPredictor,
    PredictQuery,
    Prefetcher,
    make_predictor,
    train_learned,
)
from jaxmoe.offload.store import (
    ExpertStore,
    ExpertStoreError,
    GGUFStore,
    ResidentLayer,
    SafetensorsStore,
    open_store,
    random_layers,
    write_checkpoint_store,
    write_gguf_store,
    write_safetensors_store,
)
from jaxmoe.offload.traces import load_hidden, load_trace, reuse_rate, save_trace, synthetic_trace

__all__ = [
    "ExpertCache",
    "LayeredCache",
    "make_cache",
    "OffloadConfig",
    "OffloadedModel",
    "OffloadStats",
    "RunResult",
    "PREDICTORS",
    "LearnedPredictor",
    "Prefetcher",
    "PredictQuery",
    "make_predictor",
    "train_learned",
    "ExpertStore",
    "ExpertStoreError",
    "GGUFStore",
    "ResidentLayer",
    "SafetensorsStore",
    "open_store",
    "random_layers",
    "write_gguf_store",
    "write_checkpoint_store",
    "write_safetensors_store",
    "load_hidden",
    "load_trace",
    "reuse_rate",
    "save_trace",
    "synthetic_trace",
]

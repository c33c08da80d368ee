"""Decode driver over a layer stack whose routed experts are streamed from a store.

The model is ``L`` MoE layers with a residual stream: for each token,
``h_{l+1} = h_l + moe_l(rms_norm(h_l) * norm_l)``. The resident part of every layer
(norm, router, shared expert) sits on device; routed experts come from an
`ExpertStore` through a byte-budgeted device cache, with a predictor prefetching the
next layer's experts in a background thread while the current layer computes.

Why the output is bit-identical to the fully resident model whatever the budget or
predictor: a layer step computes its routing with the resident router, then runs the
same jitted ``moe_apply`` on a *compact* expert stack ``[n, ...]`` holding exactly the
experts that step selected (sorted, padded to a fixed ``n = min(T * k, E)`` by
repeating the first) with the routing remapped to positions in that stack. The stack's
contents depend only on the routing, never on where the bytes came from (cache hit,
prefetch, synchronous load), so budget and predictor cannot change a bit. The
``gather`` execution (the decode path) reads per token exactly the selected experts'
weights, so the compact stack gives the same bits as the full ``[E, ...]`` stack;
`OffloadedModel.run_resident` is that full-stack reference (``compact=False``), or the
same compact path with every expert resident (``compact=True``, for other impls).

Inputs: ``random`` hidden states, recorded ``hidden`` states ``[tokens, d]`` (``.npy``),
or a routing ``trace`` ``[tokens, layers, k]`` replayed in place of the router's choice
(weights: the router's probabilities of the replayed experts, renormalized).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxmoe.config import MoEConfig
from jaxmoe.execution import ExecConfig, exec_config
from jaxmoe.layer import moe_apply
from jaxmoe.offload.cache import POLICIES, SCOPES, make_cache
from jaxmoe.offload.prerouter import FetchStats, Predictor, PredictQuery, Prefetcher
from jaxmoe.offload.store import ExpertStore, ResidentLayer, stack_experts
from jaxmoe.offload.traces import check_trace
from jaxmoe.params import MoEParams, compute_routing
from jaxmoe.routing import Routing, router_logits


def rms_norm(h: jax.Array, w: jax.Array, eps: float = 1e-6) -> jax.Array:
    """``h [T, d]`` -> ``h / rms(h) * w`` in float32."""
    hf = h.astype(jnp.float32)
    return hf * jax.lax.rsqrt(jnp.mean(hf * hf, axis=-1, keepdims=True) + eps) * w.astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("cfg",))
def route_step(res: ResidentLayer, h: jax.Array, cfg: MoEConfig):
    """``h [T, d]`` -> (normalized input ``x [T, d]``, `Routing`)."""
    x = rms_norm(h, res.norm)
    p = MoEParams(res.w_router, None, res.b_router, res.selection_bias, None)
    return x, compute_routing(p, x, cfg)


@functools.partial(jax.jit, static_argnames=("cfg",))
def route_replay(res: ResidentLayer, h: jax.Array, ids: jax.Array, cfg: MoEConfig):
    """Routing replayed from ``ids [T, k]``: weights = renormalized router softmax at ``ids``."""
    x = rms_norm(h, res.norm)
    z = router_logits(x, res.w_router, res.b_router)
    s = jnp.take_along_axis(jax.nn.softmax(z, axis=-1), ids, axis=-1)
    return x, Routing(ids.astype(jnp.int32), s / s.sum(axis=-1, keepdims=True))


@functools.partial(jax.jit, static_argnames=("cfg", "ex"))
def expert_step(
    res: ResidentLayer, experts, h: jax.Array, x: jax.Array, routing: Routing, cfg: MoEConfig, ex: ExecConfig
) -> jax.Array:
    """``h + moe(x)`` with the given expert stack (full or compact) and routing into it."""
    p = MoEParams(res.w_router, experts, res.b_router, res.selection_bias, res.shared)
    return h + moe_apply(p, x, cfg, ex, routing=routing).astype(h.dtype)


@functools.partial(jax.jit, static_argnames=("cfg", "ex"))
def compact_step(
    res: ResidentLayer, experts: list, h: jax.Array, x: jax.Array, routing: Routing, cfg: MoEConfig, ex: ExecConfig
) -> jax.Array:
    """`expert_step` on the compact stack of ``experts`` (a list of per-expert pytrees), stacked
    inside the jitted step (one dispatch per layer)."""
    return expert_step(res, stack_experts(list(experts), jnp), h, x, routing, cfg, ex)


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
    """One streaming configuration.

    Attributes:
      budget_bytes: device cache budget for routed experts. Outside it: the step's
        working set (its ``k`` experts) and the staged prefetches (at most ``2 * prefetch_k``
        experts, see `jaxmoe.offload.prerouter.Prefetcher`).
      policy: ``lru`` or ``lfu``.
      scope: ``global`` (one cache) or ``per_layer`` (budget split evenly).
      prefetch_k: experts predicted per layer (default: top_k).
      asynchronous: prefetch in a background thread (False: inline, for tests).
    """

    budget_bytes: int
    policy: str = "lru"
    scope: str = "global"
    prefetch_k: int | None = None
    asynchronous: bool = True

    def __post_init__(self):
        if not isinstance(self.budget_bytes, int) or self.budget_bytes < 0:
            raise ValueError(f"OffloadConfig.budget_bytes must be a non-negative int, got {self.budget_bytes!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"OffloadConfig.policy: unknown {self.policy!r}; expected one of {POLICIES}")
        if self.scope not in SCOPES:
            raise ValueError(f"OffloadConfig.scope: unknown {self.scope!r}; expected one of {SCOPES}")
        if self.prefetch_k is not None and self.prefetch_k < 0:
            raise ValueError(f"OffloadConfig.prefetch_k must be >= 0, got {self.prefetch_k}")


@dataclasses.dataclass
class RunResult:
    """Outputs of a decode run.

    Attributes:
      outputs: ``[N, d]`` final residual stream per token.
      ids: ``[N, L, k]`` experts selected.
      hidden: ``[N, L, d]`` input of every layer.
      seconds: wall time of the decode loop (after warm-up).
    """

    outputs: np.ndarray
    ids: np.ndarray
    hidden: np.ndarray
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.outputs.shape[0] / self.seconds if self.seconds > 0 else float("inf")


@dataclasses.dataclass
class OffloadStats:
    """Per-layer `FetchStats` plus cache and timing totals of a streamed run."""

    layers: list[FetchStats]
    tokens: int
    seconds: float
    budget_bytes: int
    peak_cache_bytes: int
    expert_bytes: int
    prefetch_errors: list[str]
    peak_staged_bytes: int = 0

    def total(self) -> FetchStats:
        t = FetchStats()
        for s in self.layers:
            for f in dataclasses.fields(FetchStats):
                setattr(t, f.name, getattr(t, f.name) + getattr(s, f.name))
        return t

    @staticmethod
    def summarize(s: FetchStats, tokens: int) -> dict:
        n = max(s.needed, 1)
        return {
            "hit_rate": s.hits / n,
            "late_rate": s.late / n,
            "miss_rate": s.misses / n,
            "recall": s.recall_sum / s.recall_n if s.recall_n else None,
            "bytes_loaded_per_token": (s.bytes_sync + s.bytes_prefetch) / max(tokens, 1),
            "bytes_sync_per_token": s.bytes_sync / max(tokens, 1),
            "bytes_prefetch_per_token": s.bytes_prefetch / max(tokens, 1),
            "wait_s": s.wait_s,
            "needed": s.needed,
        }

    def to_dict(self) -> dict:
        d = self.summarize(self.total(), self.tokens)
        d.update(
            tokens=self.tokens,
            seconds=self.seconds,
            tokens_per_s=self.tokens / self.seconds if self.seconds > 0 else None,
            budget_bytes=self.budget_bytes,
            peak_cache_bytes=self.peak_cache_bytes,
            expert_bytes=self.expert_bytes,
            prefetch_errors=len(self.prefetch_errors),
            peak_staged_bytes=self.peak_staged_bytes,
            per_layer=[self.summarize(s, self.tokens) for s in self.layers],
        )
        return d


class OffloadedModel:
    """A layer stack over an `ExpertStore`: resident runs and streamed runs.

    Args:
      store: the `ExpertStore` (its config and layer count define the model).
      impl: execution strategy of the routed experts (``gather`` when neither ``impl`` nor
        ``ex`` is given: the decode path); a shorthand for ``ex=ExecConfig(impl=...)``.
      ex: how each layer runs (`jaxmoe.execution.ExecConfig`).
      num_layers: use the first ``num_layers`` layers (default all).
    """

    def __init__(
        self,
        store: ExpertStore,
        *,
        impl: str | None = None,
        ex: ExecConfig | None = None,
        num_layers: int | None = None,
    ):
        self.store = store
        self.cfg = store.cfg
        self.num_layers = store.num_layers if num_layers is None else num_layers
        if not 1 <= self.num_layers <= store.num_layers:
            raise ValueError(f"OffloadedModel: num_layers={num_layers} outside [1, {store.num_layers}]")
        self.ex = exec_config(ex, "gather" if impl is None and ex is None else impl)
        self.resident = [jax.device_put(jax.tree.map(jnp.asarray, store.resident(l))) for l in range(self.num_layers)]
        self._full = None

    # ------------------------------------------------------------------ helpers
    def _inputs(self, inputs) -> np.ndarray:
        x = np.asarray(inputs, np.float32)
        if x.ndim != 2 or x.shape[1] != self.cfg.d_model:
            raise ValueError(f"OffloadedModel: inputs must be [tokens, {self.cfg.d_model}], got shape {x.shape}")
        return x

    def _trace(self, trace, n: int):
        if trace is None:
            return None
        t = check_trace(trace, self.num_layers, self.cfg.num_experts, self.cfg.top_k)
        if t.shape[0] < n:
            raise ValueError(f"OffloadedModel: routing trace has {t.shape[0]} tokens, inputs have {n}")
        return t

    def _route(self, l: int, h, trace, t: int):
        if trace is None:
            return route_step(self.resident[l], h, self.cfg)
        return route_replay(self.resident[l], h, jnp.asarray(trace[t, l][None]), self.cfg)

    def full_experts(self, l: int):
        """All experts of layer ``l`` stacked on device (loaded once; the resident reference)."""
        if self._full is None:
            self._full = [None] * self.num_layers
        if self._full[l] is None:
            self._full[l] = jax.device_put(jax.tree.map(jnp.asarray, self.store.load_stack(l)))
        return self._full[l]

    def _n_pad(self, tokens: int) -> int:
        return min(tokens * self.cfg.top_k, self.cfg.num_experts)

    @staticmethod
    def compact(ids: np.ndarray, n_pad: int):
        """Sorted distinct experts of ``ids [T, k]`` padded to ``n_pad`` (first repeated), and
        ``ids`` remapped to positions in that list."""
        needed = np.unique(ids)
        local = np.searchsorted(needed, ids).astype(np.int32)
        padded = np.concatenate([needed, np.full((n_pad - needed.size,), needed[0], needed.dtype)])
        return needed, padded, local

    # ------------------------------------------------------------------ runs
    def run_resident(self, inputs, *, trace=None, compact: bool = False) -> RunResult:
        """Every expert resident. ``compact=False``: the full ``[E, ...]`` stack (the natural
        resident block); ``compact=True``: the streaming code path with all experts on device."""
        x = self._inputs(inputs)
        n = x.shape[0]
        trace = self._trace(trace, n)
        full = [self.full_experts(l) for l in range(self.num_layers)]
        dev_experts = (
            [
                [jax.tree.map(lambda a, e=e: a[e], full[l]) for e in range(self.cfg.num_experts)]
                for l in range(self.num_layers)
            ]
            if compact
            else None
        )
        self._warmup(x, trace, full)

        def step(t, l, h, xn, r, run):
            if not compact:
                return expert_step(self.resident[l], full[l], h, xn, r, self.cfg, self.ex)
            _, padded, local = self.compact(run.ids[t, l][None], self._n_pad(1))
            experts = [dev_experts[l][e] for e in padded]
            return compact_step(
                self.resident[l], experts, h, xn, Routing(jnp.asarray(local), r.weights), self.cfg, self.ex
            )

        return self._decode(x, trace, step)

    def _decode(self, x: np.ndarray, trace, step: Callable) -> RunResult:
        """Decodes ``x [N, d]`` one token at a time through every layer, timed: routes each
        layer's input (or replays ``trace``), records it in the `RunResult` being filled, and
        takes ``h = step(t, l, h, x_normed, routing, run)`` as the next layer's input."""
        n, L, k, d = x.shape[0], self.num_layers, self.cfg.top_k, self.cfg.d_model
        run = RunResult(
            np.zeros((n, d), np.float32), np.zeros((n, L, k), np.int32), np.zeros((n, L, d), np.float32), 0.0
        )
        t0 = time.perf_counter()
        for t in range(n):
            h = jnp.asarray(x[t : t + 1])
            for l in range(L):
                run.hidden[t, l] = np.asarray(h[0])
                xn, r = self._route(l, h, trace, t)
                run.ids[t, l] = np.asarray(r.expert_ids)[0]
                h = step(t, l, h, xn, r, run)
            run.outputs[t] = np.asarray(h[0])
        run.seconds = time.perf_counter() - t0
        return run

    def _warmup(self, x, trace, full=None) -> None:
        """Compiles the jitted steps for the shapes of a run (outside the timed loop)."""
        h = jnp.asarray(x[:1])
        xn, r = self._route(0, h, trace, 0)
        if full is not None:
            jax.block_until_ready(expert_step(self.resident[0], full[0], h, xn, r, self.cfg, self.ex))
        n_pad = self._n_pad(1)
        ids = np.asarray(r.expert_ids)
        _, padded, local = self.compact(ids, n_pad)
        experts = [jax.device_put(self.store.load_expert(0, int(e))) for e in padded]
        jax.block_until_ready(
            compact_step(self.resident[0], experts, h, xn, Routing(jnp.asarray(local), r.weights), self.cfg, self.ex)
        )

    def run_offloaded(
        self, inputs, ocfg: OffloadConfig, predictor: Predictor, *, trace=None, on_step: Callable | None = None
    ) -> tuple[RunResult, OffloadStats]:
        """Streams experts through a fresh cache while decoding ``inputs [N, d]`` one token at a time.

        Args:
          inputs: ``[N, d]`` first-layer inputs.
          ocfg: cache / prefetch settings.
          predictor: a `Predictor` (see `jaxmoe.offload.prerouter`).
          trace: optional routing trace ``[N, L, k]`` replayed instead of the router's choice.
          on_step: called as ``on_step(token, layer, cache)`` after every layer step (tests
            check the budget there).
        """
        x = self._inputs(inputs)
        n = x.shape[0]
        trace = self._trace(trace, n)
        L, k, E = self.num_layers, self.cfg.top_k, self.cfg.num_experts
        m = k if ocfg.prefetch_k is None else ocfg.prefetch_k
        self._warmup(x, trace)
        cache = make_cache(ocfg.budget_bytes, ocfg.policy, ocfg.scope, L)
        pf = Prefetcher(self.store, cache, asynchronous=ocfg.asynchronous)
        stats = [FetchStats() for _ in range(L)]
        preds: dict[tuple[int, int], np.ndarray] = {}
        n_pad = self._n_pad(1)
        peak = [0]

        def step(t, l, h, xn, r, run):
            ids = run.ids[t, l]
            p = preds.pop((t, l), None)
            if p is not None:
                stats[l].predicted += len(p)
                stats[l].recall_sum += len(set(p.tolist()) & set(ids.tolist())) / k
                stats[l].recall_n += 1
            # predict the next layer (or layer 0 of the next token) and prefetch it
            tl, tt = (l + 1, t) if l + 1 < L else (0, t + 1)
            if tt < n and m > 0:
                q = PredictQuery(
                    tl,
                    tt,
                    m,
                    hidden=run.hidden[t, l] if tl > 0 else None,
                    cur_ids=ids if tl > 0 else None,
                    prev_ids=run.ids[tt - 1, tl] if tt > 0 else None,
                )
                pred = np.asarray(predictor.predict(q), np.int32)
                if pred.size and (pred.min() < 0 or pred.max() >= E):
                    raise ValueError(
                        f"predictor {getattr(predictor, 'name', predictor)!r} returned expert "
                        f"ids outside [0, {E}) for layer {tl}: {pred.tolist()}"
                    )
                preds[(tt, tl)] = pred
                if tl != l:  # (a one-layer model predicts its own next step: request after release)
                    pf.request(tl, pred)
            needed, padded, local = self.compact(ids[None], n_pad)
            protect = [(l, int(e)) for e in needed]
            dev = {int(e): pf.fetch((l, int(e)), stats[l], protect) for e in needed}
            experts = [dev[int(e)] for e in padded]
            h = compact_step(
                self.resident[l], experts, h, xn, Routing(jnp.asarray(local), r.weights), self.cfg, self.ex
            )
            pf.release(l)
            if L == 1 and (t + 1, 0) in preds:
                pf.request(0, preds[(t + 1, 0)])
            peak[0] = max(peak[0], cache.used_bytes)
            if on_step is not None:
                on_step(t, l, cache)
            return h

        try:
            run = self._decode(x, trace, step)
        finally:
            pf.close()
        for l in range(L):
            stats[l].bytes_prefetch = pf.bytes_prefetch.get(l, 0)
        ost = OffloadStats(
            stats,
            n,
            run.seconds,
            ocfg.budget_bytes,
            max(peak[0], cache.peak_bytes),
            self.store.expert_nbytes(0),
            pf.prefetch_errors,
            pf.peak_staged_bytes,
        )
        return run, ost

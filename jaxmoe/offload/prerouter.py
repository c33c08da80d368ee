"""Prerouters (pluggable expert predictors) and the asynchronous prefetcher.

A predictor answers a `PredictQuery`: which ``m`` experts will layer ``q.layer`` of
decode step ``q.step`` select? It is asked while the layer before is being computed
(after that layer's routing is known), so its loads overlap that layer's compute.
For layer 0 of a step the query comes at the last layer of the step before, where no
hidden state of the new token exists yet: every built-in predictor then falls back to
the previous token's experts.

Built-in predictors (`make_predictor` names):

- ``none``: predicts nothing (pure demand loading).
- ``prev_token``: the experts the previous token selected at the same layer.
- ``next_router``: the target layer's RMSNorm and router applied to the current layer's
  input hidden state (mixtral-offloading's trick), top-m of the selection scores.
- ``learned``: a small linear / MLP model per target layer on the RMS-normalized hidden
  state, this token's experts at the layer before and the previous token's experts at
  the target layer (multi-hot), trained with optax (`train_learned`) on routing traces.
- ``oracle``: reads the true routing from a trace (an upper bound; tests and sweeps).

`Prefetcher` loads predicted experts in a background thread: read from the store,
``jax.device_put``, wait until ready, insert into the cache (as a non-access). A
prefetched expert the cache has no room for is *staged*: held outside the budget until
the step of the layer it was predicted for has run (`Prefetcher.release`), so at most
two layers' predictions (``2 m`` experts) are staged at once; this is the double buffer
that makes prefetching useful when the budget holds (almost) nothing. The decode loop
takes an expert with `Prefetcher.fetch`: ready on device (cache or staged: a hit), a wait
on an in-flight prefetch (late), or a synchronous load (miss).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import functools
import threading
import time
from collections.abc import Callable
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jaxmoe.offload.store import ExpertStore, ResidentLayer, expert_nbytes

PREDICTORS = ("none", "prev_token", "next_router", "learned", "oracle")


@dataclasses.dataclass(frozen=True)
class PredictQuery:
    """What a predictor sees.

    Attributes:
      layer: the target layer whose experts are predicted.
      step: the decode step (token index) of the target.
      m: how many experts to predict.
      hidden: ``[d]`` float32 input (residual stream) of layer ``layer - 1`` of this step,
        None when ``layer == 0``.
      cur_ids: ``[k]`` this step's experts at layer ``layer - 1`` (None when ``layer == 0``).
      prev_ids: ``[k]`` the previous step's experts at ``layer`` (None at step 0).
    """

    layer: int
    step: int
    m: int
    hidden: np.ndarray | None
    cur_ids: np.ndarray | None
    prev_ids: np.ndarray | None


class Predictor(Protocol):
    name: str

    def predict(self, q: PredictQuery) -> np.ndarray:
        """Expert ids ``[<= q.m]`` int (distinct) for ``q.layer``."""
        ...


def _prev(q: PredictQuery) -> np.ndarray:
    if q.prev_ids is None:
        return np.zeros((0,), np.int32)
    return np.asarray(q.prev_ids, np.int32)[: q.m]


def _rms(h: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    h = np.asarray(h, np.float32)
    return h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + eps)


def _topm(scores: np.ndarray, m: int) -> np.ndarray:
    m = min(m, scores.shape[-1])
    idx = np.argpartition(-scores, m - 1)[:m]
    return idx[np.argsort(-scores[idx], kind="stable")].astype(np.int32)


class NoPredictor:
    name = "none"

    def predict(self, q: PredictQuery) -> np.ndarray:
        return np.zeros((0,), np.int32)


class PrevTokenPredictor:
    name = "prev_token"

    def predict(self, q: PredictQuery) -> np.ndarray:
        return _prev(q)


class NextRouterPredictor:
    """Top-m of the target layer's router scores on the current layer's input.

    Args:
      resident: the model's `ResidentLayer` list (host or device arrays).
      router_cfg: the `RouterConfig` (softmax / sigmoid scores, selection bias).
    """

    name = "next_router"

    def __init__(self, resident: list[ResidentLayer], router_cfg):
        self.norm = [np.asarray(r.norm, np.float32) for r in resident]
        self.w = [np.asarray(r.w_router, np.float32) for r in resident]
        self.b = [None if r.b_router is None else np.asarray(r.b_router, np.float32) for r in resident]
        self.sb = [None if r.selection_bias is None else np.asarray(r.selection_bias, np.float32) for r in resident]
        self.rc = router_cfg

    def predict(self, q: PredictQuery) -> np.ndarray:
        if q.layer == 0 or q.hidden is None:
            return _prev(q)
        l = q.layer
        x = _rms(q.hidden) * self.norm[l]
        z = x @ self.w[l]
        if self.b[l] is not None:
            z = z + self.b[l]
        if self.rc.score_fn == "softmax":
            s = np.exp(z - z.max())
            s = s / s.sum()
        elif self.rc.score_fn == "sigmoid":
            s = 1.0 / (1.0 + np.exp(-z))
        else:
            s = z
        if self.sb[l] is not None:
            s = s + self.sb[l]
        return _topm(s, q.m)


class OraclePredictor:
    """The true experts, read from a routing trace ``ids [steps, layers, k]``."""

    name = "oracle"

    def __init__(self, ids: np.ndarray):
        self.ids = np.asarray(ids, np.int32)

    def predict(self, q: PredictQuery) -> np.ndarray:
        return self.ids[q.step, q.layer][: q.m]


@dataclasses.dataclass(frozen=True)
class LearnedPredictor:
    """Per target layer ``l >= 1``: ``logits = MLP([rms(h), onehot(cur), onehot(prev)]) + a * onehot(prev)``.

    The scalar ``a`` per layer (``reuse``) shares one weight across experts for "the
    previous token chose it", so a few hundred tokens suffice to learn temporal reuse.

    Attributes:
      params: dict of stacked arrays ``w1 [L-1, n_in, H]``, ``b1 [L-1, H]``, ``w2 [L-1, H, E]``,
        ``b2 [L-1, E]``, ``reuse [L-1]`` (``hidden_dim == 0``: no ``w1``, ``b1``; ``w2 [L-1, n_in, E]``).
      num_experts: E.
      use_hidden: whether the hidden state is a feature (False for id-only traces).
      d_model: width of the hidden-state feature.
    """

    params: dict
    num_experts: int
    use_hidden: bool
    d_model: int
    name: str = "learned"

    def scores(self, layer: int, hidden, cur_ids, prev_ids) -> np.ndarray:
        x = _features(hidden, cur_ids, prev_ids, self.num_experts, self.use_hidden, self.d_model)
        p = {k: np.asarray(v[layer - 1]) for k, v in self.params.items()}
        prev = x[-self.num_experts :]
        if "w1" in p:
            x = np.maximum(x @ p["w1"] + p["b1"], 0.0)
        return x @ p["w2"] + p["b2"] + p["reuse"] * prev

    def predict(self, q: PredictQuery) -> np.ndarray:
        if q.layer == 0 or q.cur_ids is None:
            return _prev(q)
        return _topm(self.scores(q.layer, q.hidden, q.cur_ids, q.prev_ids), q.m)


def _multi_hot(ids, e: int) -> np.ndarray:
    v = np.zeros((e,), np.float32)
    if ids is not None:
        v[np.asarray(ids, np.int64)] = 1.0
    return v


def _features(hidden, cur_ids, prev_ids, e: int, use_hidden: bool, d: int) -> np.ndarray:
    parts = []
    if use_hidden:
        parts.append(_rms(hidden) if hidden is not None else np.zeros((d,), np.float32))
    parts += [_multi_hot(cur_ids, e), _multi_hot(prev_ids, e)]
    return np.concatenate(parts)


def _fwd(p, x):
    """``x [L-1, N, n_in]`` -> logits ``[L-1, N, E]`` (the previous-token block is the last E features)."""
    e = p["b2"].shape[-1]
    prev = x[..., -e:]  # the previous token's experts: a shared identity ("reuse") term
    if "w1" in p:
        x = jax.nn.relu(jnp.einsum("lni,lih->lnh", x, p["w1"]) + p["b1"][:, None])
    return jnp.einsum("lnh,lhe->lne", x, p["w2"]) + p["b2"][:, None] + p["reuse"][:, None, None] * prev


@jax.jit
def _loss(p, x, y):
    import optax

    return optax.sigmoid_binary_cross_entropy(_fwd(p, x), y).mean()


@functools.cache
def _optimizer(learning_rate: float):
    import optax

    return optax.adam(learning_rate)


@functools.partial(jax.jit, static_argnames=("opt", "weight_decay"))
def _train_step(p, s, x, y, opt, weight_decay: float):
    import optax

    def train_loss(p):  # L2 on the matrices only: the shared reuse term and biases stay free
        l2 = sum(jnp.sum(p[k] ** 2) for k in ("w1", "w2") if k in p)
        return _loss(p, x, y) + weight_decay * l2

    g = jax.grad(train_loss)(p)
    upd, s = opt.update(g, s, p)
    return optax.apply_updates(p, upd), s


def train_learned(
    ids: np.ndarray,
    num_experts: int,
    hidden: np.ndarray | None = None,
    *,
    hidden_dim: int = 0,
    steps: int = 400,
    learning_rate: float = 3e-2,
    weight_decay: float = 1e-3,
    val_fraction: float = 0.2,
    seed: int = 0,
) -> LearnedPredictor:
    """Trains a `LearnedPredictor` with optax (Adam, sigmoid cross-entropy on multi-hot targets).

    Args:
      ids: routing trace ``[N, L, k]`` (N >= 2, L >= 2).
      num_experts: E.
      hidden: ``[N, L, d]`` input hidden state of every layer, or None (id features only).
      hidden_dim: MLP width; 0 gives a linear model.
      steps, learning_rate, seed: full-batch Adam training.
      weight_decay: L2 penalty on the weight matrices (not on the reuse term or biases).
      val_fraction: the last tokens held out; the parameters with the lowest held-out
        loss (checked every 20 steps) are kept (early stopping: the predictor overfits
        a few hundred tokens quickly).
    """
    ids = np.asarray(ids)
    if ids.ndim != 3 or ids.shape[0] < 2 or ids.shape[1] < 2:
        raise ValueError(f"train_learned: ids must be [N >= 2, L >= 2, k], got shape {ids.shape}")
    n, L, k = ids.shape
    use_hidden = hidden is not None
    d = 0
    if use_hidden:
        hidden = np.asarray(hidden, np.float32)
        if hidden.shape[:2] != (n, L):
            raise ValueError(f"train_learned: hidden must be [N={n}, L={L}, d], got shape {hidden.shape}")
        d = hidden.shape[2]
    e = num_experts
    xs, ys = [], []
    for l in range(1, L):
        xl, yl = [], []
        for t in range(n):
            xl.append(
                _features(
                    hidden[t, l - 1] if use_hidden else None,
                    ids[t, l - 1],
                    ids[t - 1, l] if t > 0 else None,
                    e,
                    use_hidden,
                    d,
                )
            )
            yl.append(_multi_hot(ids[t, l], e))
        xs.append(np.stack(xl))
        ys.append(np.stack(yl))
    X = np.stack(xs)  # [L-1, N, n_in]
    Y = np.stack(ys)  # [L-1, N, E]
    n_val = int(round(n * val_fraction)) if n >= 10 else 0
    Xv, Yv = jnp.asarray(X[:, n - n_val :]), jnp.asarray(Y[:, n - n_val :])
    X, Y = jnp.asarray(X[:, : n - n_val]), jnp.asarray(Y[:, : n - n_val])
    n_in = X.shape[-1]
    key = jax.random.PRNGKey(seed)
    k1, k2 = jax.random.split(key)
    if hidden_dim > 0:
        params = {
            "w1": jax.random.normal(k1, (L - 1, n_in, hidden_dim)) / np.sqrt(n_in),
            "b1": jnp.zeros((L - 1, hidden_dim)),
            "w2": jax.random.normal(k2, (L - 1, hidden_dim, e)) * (0.1 / np.sqrt(hidden_dim)),
            "b2": jnp.zeros((L - 1, e)),
        }
    else:
        params = {"w2": jnp.zeros((L - 1, n_in, e)), "b2": jnp.zeros((L - 1, e))}  # convex: start at 0
    params["reuse"] = jnp.ones((L - 1,))

    opt = _optimizer(float(learning_rate))
    state = opt.init(params)
    best, best_loss = params, float("inf")
    for i in range(steps):
        params, state = _train_step(params, state, X, Y, opt, float(weight_decay))
        if n_val and (i % 20 == 19 or i == steps - 1):
            v = float(_loss(params, Xv, Yv))
            if v < best_loss:
                best, best_loss = params, v
    if not n_val:
        best = params
    return LearnedPredictor({k: np.asarray(v) for k, v in best.items()}, e, use_hidden, d)


def make_predictor(
    name: str, *, resident=None, router_cfg=None, learned: LearnedPredictor | None = None, oracle_ids=None
) -> Predictor:
    """A built-in predictor by name (see module doc); raises ValueError naming what is missing."""
    if name == "none":
        return NoPredictor()
    if name == "prev_token":
        return PrevTokenPredictor()
    if name == "next_router":
        if resident is None or router_cfg is None:
            raise ValueError("make_predictor('next_router') needs resident= and router_cfg=")
        return NextRouterPredictor(resident, router_cfg)
    if name == "learned":
        if learned is None:
            raise ValueError("make_predictor('learned') needs learned= (a trained LearnedPredictor)")
        return learned
    if name == "oracle":
        if oracle_ids is None:
            raise ValueError("make_predictor('oracle') needs oracle_ids= (a routing trace)")
        return OraclePredictor(oracle_ids)
    raise ValueError(f"unknown predictor {name!r}; expected one of {PREDICTORS}")


@dataclasses.dataclass
class FetchStats:
    """Counters of one layer (or of all layers)."""

    needed: int = 0
    hits: int = 0  # ready on device when needed (in the cache, or staged by a finished prefetch)
    late: int = 0  # prefetch still in flight when needed (waited for)
    misses: int = 0  # loaded synchronously
    wait_s: float = 0.0
    bytes_sync: int = 0
    bytes_prefetch: int = 0
    predicted: int = 0
    recall_sum: float = 0.0
    recall_n: int = 0


class Prefetcher:
    """Loads experts into the cache, in a background thread (``asynchronous=True``) or inline.

    Args:
      store: the `ExpertStore`.
      cache: an `ExpertCache` / `LayeredCache` keyed ``(layer, expert)``.
      put: host `ExpertWeights` -> device pytree (default ``jax.device_put``).
      asynchronous: prefetch in a worker thread; False runs prefetch loads inline.
      workers: worker threads.
    """

    def __init__(
        self, store: ExpertStore, cache, *, put: Callable | None = None, asynchronous: bool = True, workers: int = 1
    ):
        self.store = store
        self.cache = cache
        self.put = put or jax.device_put
        self.asynchronous = asynchronous
        self._pool = cf.ThreadPoolExecutor(max_workers=workers) if asynchronous else None
        self._inflight: dict[tuple[int, int], cf.Future] = {}
        self._lock = threading.Lock()
        self.bytes_prefetch: dict[int, int] = {}
        self.prefetch_errors: list[str] = []
        self._staged: dict[tuple[int, int], tuple] = {}
        self._pending: set[tuple[int, int]] = set()  # requested, layer step not yet released
        self.staged_bytes = 0
        self.peak_staged_bytes = 0

    def _load(self, key, *, access: bool, protect=()):
        host = self.store.load_expert(*key)
        dev = jax.block_until_ready(self.put(host))
        nb = expert_nbytes(host)
        return dev, nb, self.cache.insert(key, dev, nb, access=access, protect=protect)

    def _job(self, key):
        try:
            dev, nb, cached = self._load(key, access=False)
            with self._lock:
                self.bytes_prefetch[key[0]] = self.bytes_prefetch.get(key[0], 0) + nb
                if not cached and key in self._pending:  # no room in the cache: hold it for its layer's step
                    self._staged[key] = (dev, nb)
                    self.staged_bytes += nb
                    self.peak_staged_bytes = max(self.peak_staged_bytes, self.staged_bytes)
            return dev
        except Exception as e:
            self.prefetch_errors.append(str(e))
            raise
        finally:
            with self._lock:
                self._inflight.pop(key, None)

    def request(self, layer: int, experts) -> None:
        """Starts loading ``experts`` of ``layer`` that are neither cached nor in flight."""
        for e in experts:
            key = (int(layer), int(e))
            with self._lock:
                if key in self._inflight or key in self._staged or key in self.cache:
                    continue
                self._pending.add(key)
                if self.asynchronous:
                    self._inflight[key] = self._pool.submit(self._job, key)
                    continue
            try:
                self._job(key)
            except Exception:  # inline prefetch errors surface when the expert is demanded
                pass

    def fetch(self, key, stats: FetchStats, protect=()):
        """The device pytree of ``key`` for the current step, updating ``stats``."""
        stats.needed += 1
        with self._lock:
            fut = self._inflight.get(key)
        if fut is not None:
            t0 = time.perf_counter()
            dev = fut.result()  # re-raises a store error naming layer and expert
            stats.wait_s += time.perf_counter() - t0
            stats.late += 1
            return dev
        with self._lock:
            staged = self._staged.pop(key, None)
            if staged is not None:
                self.staged_bytes -= staged[1]
        if staged is not None:
            stats.hits += 1
            return staged[0]
        dev = self.cache.lookup(key)
        if dev is not None:
            stats.hits += 1
            return dev
        t0 = time.perf_counter()
        dev, nb, _ = self._load(key, access=True, protect=protect)
        stats.wait_s += time.perf_counter() - t0
        stats.misses += 1
        stats.bytes_sync += nb
        return dev

    def release(self, layer: int) -> None:
        """Drops staged prefetches of ``layer`` (its step is done: they were mispredictions)."""
        with self._lock:
            self._pending = {k for k in self._pending if k[0] != layer}
            for key in [k for k in self._staged if k[0] == layer]:
                self.staged_bytes -= self._staged.pop(key)[1]

    def drain(self) -> None:
        """Waits for every in-flight prefetch (errors stay in ``prefetch_errors``)."""
        with self._lock:
            futs = list(self._inflight.values())
        cf.wait(futs)

    def close(self) -> None:
        self.drain()
        if self._pool is not None:
            self._pool.shutdown(wait=True)

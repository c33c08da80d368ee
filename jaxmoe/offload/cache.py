"""Device cache of experts with a byte budget and LRU / LFU eviction.

Keys are ``(layer, expert)``; values are whatever the caller stores (device pytrees of
one expert); every entry carries its byte size. The cache never holds more than its
budget: `ExpertCache.insert` evicts by the policy until the new entry fits, refuses an
entry larger than the budget, and never evicts the keys passed as ``protect``.

Policies (ties broken towards the older entry, then the smaller key):

- ``lru``: evict the entry whose last access (lookup hit or insert) is oldest.
- ``lfu``: evict the entry with the fewest accesses while resident (an insert counts 1
  when it is a demand load, 0 when it is a prefetch), then the least recent.

A logical clock ``tick`` advances on every `lookup` and `insert`, so the eviction
order is a pure function of the call sequence (tests replay it against a tiny
reference). Thread safe: the prefetch thread inserts while the decode loop looks up.

`LayeredCache` splits one budget evenly into per-layer `ExpertCache` objects (scope
``per_layer``); `make_cache` builds either.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Hashable
from typing import Any

POLICIES = ("lru", "lfu")
SCOPES = ("global", "per_layer")


@dataclasses.dataclass
class _Entry:
    value: Any
    nbytes: int
    freq: int
    last: int


class ExpertCache:
    """A byte-budgeted key -> value cache with LRU or LFU eviction.

    Args:
      budget_bytes: the most bytes the resident entries may occupy (>= 0).
      policy: ``lru`` or ``lfu``.
    """

    def __init__(self, budget_bytes: int, policy: str = "lru"):
        if policy not in POLICIES:
            raise ValueError(f"ExpertCache: unknown policy {policy!r}; expected one of {POLICIES}")
        if not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"ExpertCache: budget_bytes must be a non-negative int, got {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        self.policy = policy
        self._d: dict[Hashable, _Entry] = {}
        self._lock = threading.RLock()
        self.tick = 0
        self.used_bytes = 0
        self.peak_bytes = 0
        self.evictions: list[Hashable] = []

    def __contains__(self, key) -> bool:
        with self._lock:
            return key in self._d

    def __len__(self) -> int:
        return len(self._d)

    def keys(self) -> list:
        with self._lock:
            return list(self._d)

    def lookup(self, key):
        """The value of ``key`` (counted as an access) or None on a miss."""
        with self._lock:
            self.tick += 1
            e = self._d.get(key)
            if e is None:
                return None
            e.freq += 1
            e.last = self.tick
            return e.value

    def peek(self, key):
        """The value of ``key`` without counting an access (None if absent)."""
        with self._lock:
            e = self._d.get(key)
            return None if e is None else e.value

    def _victim(self, protect) -> Hashable | None:
        cands = [(k, e) for k, e in self._d.items() if k not in protect]
        if not cands:
            return None
        if self.policy == "lru":
            return min(cands, key=lambda ke: (ke[1].last, ke[0]))[0]
        return min(cands, key=lambda ke: (ke[1].freq, ke[1].last, ke[0]))[0]

    def insert(self, key, value, nbytes: int, *, access: bool = True, protect=()) -> bool:
        """Adds ``key`` (replacing an old value), evicting until it fits.

        Returns False (and changes nothing but the clock) when it cannot fit: larger than
        the budget, or only protected entries are left to evict.
        """
        if nbytes < 0:
            raise ValueError(f"ExpertCache.insert: nbytes must be >= 0, got {nbytes} for key {key!r}")
        with self._lock:
            self.tick += 1
            old = self._d.pop(key, None)
            if old is not None:
                self.used_bytes -= old.nbytes
            if nbytes > self.budget_bytes:
                if old is not None:  # keep the old entry as it was
                    self._d[key] = old
                    self.used_bytes += old.nbytes
                return False
            protect = set(protect)
            need = self.used_bytes + nbytes - self.budget_bytes
            freeable = sum(e.nbytes for k, e in self._d.items() if k not in protect)
            if need > 0 and freeable < need:
                if old is not None:
                    self._d[key] = old
                    self.used_bytes += old.nbytes
                return False
            while self.used_bytes + nbytes > self.budget_bytes:
                v = self._victim(protect)
                ent = self._d.pop(v)
                self.used_bytes -= ent.nbytes
                self.evictions.append(v)
            freq = (old.freq if old is not None else 0) + (1 if access else 0)
            self._d[key] = _Entry(value, nbytes, freq, self.tick)
            self.used_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.used_bytes)
            assert self.used_bytes <= self.budget_bytes, (self.used_bytes, self.budget_bytes)
            return True

    def clear(self) -> None:
        with self._lock:
            self._d.clear()
            self.used_bytes = 0


class LayeredCache:
    """One `ExpertCache` per layer, each with ``budget_bytes // num_layers``; keys ``(layer, expert)``."""

    def __init__(self, budget_bytes: int, policy: str, num_layers: int):
        if num_layers < 1:
            raise ValueError(f"LayeredCache: num_layers must be >= 1, got {num_layers}")
        self.budget_bytes = budget_bytes
        self.policy = policy
        self.layers = [ExpertCache(budget_bytes // num_layers, policy) for _ in range(num_layers)]

    def _c(self, key) -> ExpertCache:
        layer = key[0]
        if not 0 <= layer < len(self.layers):
            raise ValueError(f"LayeredCache: key {key!r} names layer {layer} outside [0, {len(self.layers)})")
        return self.layers[layer]

    def __contains__(self, key) -> bool:
        return key in self._c(key)

    def __len__(self) -> int:
        return sum(len(c) for c in self.layers)

    def keys(self) -> list:
        return [k for c in self.layers for k in c.keys()]

    def lookup(self, key):
        return self._c(key).lookup(key)

    def peek(self, key):
        return self._c(key).peek(key)

    def insert(self, key, value, nbytes: int, *, access: bool = True, protect=()) -> bool:
        return self._c(key).insert(key, value, nbytes, access=access, protect=protect)

    @property
    def used_bytes(self) -> int:
        return sum(c.used_bytes for c in self.layers)

    @property
    def peak_bytes(self) -> int:
        return sum(c.peak_bytes for c in self.layers)

    @property
    def evictions(self) -> list:
        return [k for c in self.layers for k in c.evictions]

    def clear(self) -> None:
        for c in self.layers:
            c.clear()


def make_cache(budget_bytes: int, policy: str = "lru", scope: str = "global", num_layers: int = 1):
    """A global `ExpertCache` or a per-layer `LayeredCache` sharing ``budget_bytes``."""
    if scope not in SCOPES:
        raise ValueError(f"make_cache: unknown scope {scope!r}; expected one of {SCOPES}")
    if scope == "global":
        return ExpertCache(budget_bytes, policy)
    return LayeredCache(budget_bytes, policy, num_layers)

"""Side-by-side timing for the benchmarks: every variant once per repeat, the order rotated
each repeat, new inputs for every call (made and ready before the clock starts), so the
variants share the machine's noise and none reads weights the previous call left hot in
the caches (docs/performance.md, "How to benchmark honestly")."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np


def interleaved_ms(
    fns: dict[str, Callable[..., Any]], new_args: Callable[[], tuple], repeats: int
) -> dict[str, list[float]]:
    """``{name: [ms of each call]}``: ``repeats`` rounds, each calling every ``fns[name](*new_args())``
    once (fresh arguments per call), in an order rotated by one every round."""
    names = list(fns)
    ms: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            args = jax.block_until_ready(new_args())
            t0 = time.perf_counter()
            jax.block_until_ready(fns[n](*args))
            ms[n].append((time.perf_counter() - t0) * 1e3)
    return ms


def ab_cells(a: list[float], b: list[float], digits: int = 2) -> str:
    """Markdown cells ``a best / median | b best / median | a / b (best, median)`` (> 1: b faster)."""
    med_a, med_b = float(np.median(a)), float(np.median(b))
    return (
        f"{min(a):.{digits}f} / {med_a:.{digits}f} | {min(b):.{digits}f} / {med_b:.{digits}f} | "
        f"{min(a) / min(b):.2f}, {med_a / med_b:.2f}"
    )

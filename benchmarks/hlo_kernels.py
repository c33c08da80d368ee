"""Kernel launches of a compiled XLA program, counted from its optimized HLO text.

`count_kernels(hlo_text)` reads the ENTRY computation of ``compiled.as_text()``: every
instruction that is a kernel on a GPU backend (a fusion, a custom call, a library dot or
convolution, a sort / scatter / gather / copy left unfused, ...) counts once; a ``while``
counts its body's (and condition's) kernels times its trip count when XLA knows it
(``known_trip_count``), else the loop is reported as data dependent with the kernels of
one iteration. ``conditional`` counts its largest branch. Shared by
benchmarks/intel_compile_check.py and benchmarks/bench_xla_tiled.py. On XLA:CPU the same
count is a proxy (the CPU backend fuses differently).
"""

from __future__ import annotations

import dataclasses
import re

#: Opcodes that are no kernel (metadata, aliasing, control).
FREE = {
    "parameter",
    "constant",
    "tuple",
    "get-tuple-element",
    "bitcast",
    "after-all",
    "partition-id",
    "replica-id",
    "opt-barrier",
    "add-dependency",
    "domain",
}
_COMP = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\s([a-z][a-z0-9\-]*)\(")
_BODY = re.compile(r"body=%?([\w.\-]+)")
_COND = re.compile(r"condition=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}|true_computation=%?([\w.\-]+), false_computation=%?([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


@dataclasses.dataclass
class KernelCount:
    top: int = 0  #: kernels outside any loop
    in_loops: int = 0  #: kernels of one iteration of every loop (nested loops multiplied)
    launches: int = 0  #: total launches per call (loops times their trip count)
    loops: list = dataclasses.field(default_factory=list)  #: (kernels per iteration, trip count or None)
    data_dependent: bool = False  #: some loop's trip count is not known to XLA

    def row(self) -> dict:
        return dict(
            kernels_top=self.top,
            kernels_in_loops=self.in_loops,
            loops=";".join(f"{k}x{n if n is not None else '?'}" for k, n in self.loops),
            launches=None if self.data_dependent else self.launches,
        )


def _computations(text: str) -> tuple[dict[str, list[str]], str | None]:
    comps: dict[str, list[str]] = {}
    entry = None
    cur = None
    for line in text.splitlines():
        if cur is None:
            m = _COMP.match(line)
            if m and "=" not in line.split("{")[0].split("(")[0]:
                cur = m.group(2)
                comps[cur] = []
                if m.group(1):
                    entry = cur
            continue
        if line.strip() == "}":
            cur = None
            continue
        comps[cur].append(line)
    return comps, entry


def _count(comps, name, out: KernelCount, mult: int, depth: int) -> int:
    """Launches of computation ``name`` (one call); fills ``out.loops``."""
    total = 0
    for line in comps.get(name, []):
        m = _INSTR.match(line)
        if not m:
            continue
        op = m.group(2)
        if op in FREE:
            continue
        if op == "while":
            body, cond = _BODY.search(line), _COND.search(line)
            trip = _TRIP.search(line)
            n = int(trip.group(1)) if trip else None
            sub = KernelCount()
            per = _count(comps, body.group(1), sub, 1, depth + 1) if body else 0
            per += _count(comps, cond.group(1), sub, 1, depth + 1) if cond else 0
            out.loops.append((per, n))
            out.loops.extend(sub.loops)
            out.in_loops += per
            if n is None:
                out.data_dependent = True
                n = 1
            total += per * n
        elif op == "conditional":
            b = _BRANCHES.search(line)
            names = []
            if b:
                names = [s.strip().lstrip("%") for s in (b.group(1) or "").split(",") if s.strip()]
                names += [g for g in (b.group(2), b.group(3)) if g]
            total += max((_count(comps, nm, out, 1, depth + 1) for nm in names), default=0)
        elif op == "call":
            to = re.search(r"to_apply=%?([\w.\-]+)", line)
            total += _count(comps, to.group(1), out, 1, depth + 1) if to else 1
        else:
            total += 1
            if depth == 0:
                out.top += 1
    return total


def count_kernels(hlo_text: str) -> KernelCount:
    """The `KernelCount` of a compiled program's optimized HLO (``compiled.as_text()``)."""
    comps, entry = _computations(hlo_text)
    out = KernelCount()
    if entry is None:
        raise ValueError("count_kernels: no ENTRY computation in the HLO text")
    out.launches = _count(comps, entry, out, 1, 0)
    return out


__all__ = ["KernelCount", "count_kernels"]

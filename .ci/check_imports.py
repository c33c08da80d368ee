"""Import hygiene of jaxmoe and pallas_kernels, checked from the source (no import is run).

Walks every ``import`` statement (module level and inside functions) of the first-party
packages and fails (exit 1) when:

- the module graph has a cycle;
- a module imports one of a higher layer (`LAYERS`: core <- impls <- layer/block <-
  io/offload <- evaluation <- cli; the ``jaxmoe`` facade imports everything and nothing
  imports it);
- ``pallas_kernels`` imports anything from ``jaxmoe``;
- a name with a leading underscore is imported from another first-party module
  (tests and benchmarks included).

Usage: ``python .ci/check_imports.py`` from the repository root.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("jaxmoe", "pallas_kernels")
ALSO_SCANNED = ("tests", "benchmarks")

#: Layer of each module prefix (longest prefix wins); a module may import its own layer
#: or lower ones only.
LAYERS: dict[str, int] = {
    "pallas_kernels": 0,
    "jaxmoe.platforms": 0,
    "jaxmoe.host_memory": 0,
    "jaxmoe.execution": 0,
    "jaxmoe.config": 0,
    "jaxmoe.invariance": 0,
    "jaxmoe.quant": 0,
    "jaxmoe.ggml_activations": 0,
    "jaxmoe.routing": 0,
    "jaxmoe.experts": 0,
    "jaxmoe.dispatch": 0,
    "jaxmoe.params": 0,
    "jaxmoe.placement": 0,
    "jaxmoe.losses": 0,
    "jaxmoe.stats": 0,
    "jaxmoe.impls": 1,
    "jaxmoe.layer": 2,
    "jaxmoe.parallel": 2,
    "jaxmoe.block": 2,
    "jaxmoe.io": 3,
    "jaxmoe.offload": 3,
    "jaxmoe.pretrained": 3,
    "jaxmoe.traces": 3,
    "jaxmoe.evaluation": 4,
    "jaxmoe.demo": 4,
    "jaxmoe.cli": 5,
    "jaxmoe": 6,  # the facade (jaxmoe/__init__.py)
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def layer_of(mod: str) -> int:
    best, rank = "", None
    for prefix, r in LAYERS.items():
        if (mod == prefix or mod.startswith(prefix + ".")) and len(prefix) > len(best):
            best, rank = prefix, r
    if rank is None:
        raise SystemExit(f"check_imports: module {mod} has no layer in LAYERS; add it")
    return rank


def first_party(name: str) -> bool:
    return name.split(".")[0] in PACKAGES


def imports_of(path: Path, modules: set[str]) -> list[tuple[int, str, list[str]]]:
    """``(line, target module, imported names)`` of every first-party import in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    me = module_name(path)
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if first_party(a.name):
                    out.append((node.lineno, a.name, []))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = me.split(".") if is_pkg else me.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            if not first_party(base):
                continue
            names = [a.name for a in node.names]
            subs = [f"{base}.{n}" for n in names if f"{base}.{n}" in modules]
            attrs = [n for n in names if f"{base}.{n}" not in modules]
            for s in subs:
                out.append((node.lineno, s, []))
            if attrs:
                out.append((node.lineno, base, attrs))
    return out


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    sccs: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                sccs.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sccs


def main() -> int:
    files = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    modules = {module_name(p) for p in files}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    errors: list[str] = []
    for p in files:
        me = module_name(p)
        for line, target, names in imports_of(p, modules):
            where = f"{p.relative_to(ROOT)}:{line}"
            if target not in modules:
                errors.append(f"{where}: imports {target}, which is not a module of this tree")
                continue
            if target != me:
                graph[me].add(target)
            if me.startswith("pallas_kernels") and target.startswith("jaxmoe"):
                errors.append(f"{where}: pallas_kernels must not import jaxmoe ({target})")
            if target == "jaxmoe" and me != "jaxmoe":
                errors.append(f"{where}: imports the jaxmoe facade; import the module that defines the name")
            elif layer_of(target) > layer_of(me):
                errors.append(
                    f"{where}: {me} (layer {layer_of(me)}) imports {target} (layer {layer_of(target)}): "
                    "imports go from higher layers to lower ones only"
                )
            for n in names:
                if n.startswith("_") and target != me:
                    errors.append(f"{where}: imports private name {n} from {target}")
    for cyc in find_cycles(graph):
        errors.append("import cycle: " + " <-> ".join(cyc))
    for d in ALSO_SCANNED:
        for p in sorted((ROOT / d).rglob("*.py")):
            for line, target, names in imports_of(p, modules):
                for n in names:
                    if n.startswith("_"):
                        errors.append(f"{p.relative_to(ROOT)}:{line}: imports private name {n} from {target}")
    for e in errors:
        print(e)
    n_edges = sum(len(v) for v in graph.values())
    print(f"check_imports: {len(modules)} modules, {n_edges} import edges, {len(errors)} problem(s)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())

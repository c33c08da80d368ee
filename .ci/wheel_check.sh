#!/usr/bin/env bash
# Builds the wheel, installs it into a fresh venv outside the checkout and runs the
# installed package from another directory: presets and eval configs must ship inside it.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d "${TMPDIR:-/tmp}/jaxmoe-wheel.XXXXXX")"
trap 'rm -rf "$work"' EXIT
python3 -m pip wheel --no-deps -q -w "$work/dist" "$repo"
python3 -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q "$work"/dist/jaxmoe-*.whl
cd "$work"
export JAX_PLATFORMS=cpu
"$work/venv/bin/python" - <<'PY'
import pathlib, sys
import jaxmoe
where = pathlib.Path(jaxmoe.__file__).resolve()
assert pathlib.Path(sys.prefix).resolve() in where.parents, f"jaxmoe imported from {where}, not the wheel"
cfg = jaxmoe.load_config("qwen3.6-35b-a3b")
assert (where.parent / "py.typed").is_file(), "py.typed missing from the wheel"
from jaxmoe.impls.cpu import cpu_kernel_status
from jaxmoe.impls.cpu.backward import backward_kernel_status
for name, (ok, msg) in (("forward", cpu_kernel_status()), ("backward", backward_kernel_status())):
    assert ok, f"the C++ {name} kernel does not build from the wheel's sources: {msg}"
print("wheel:", where.parent, "|", cfg.name, cfg.num_experts, "experts |", len(jaxmoe.list_presets()), "presets")
PY
"$work/venv/bin/jaxmoe" eval --list
"$work/venv/bin/jaxmoe" demo --preset olmoe-1b-7b --tokens 1
echo "wheel check passed"

#!/usr/bin/env bash
# One prepared GPU check for a lent H200 (Python 3.12, jax 0.11.x + CUDA plugin, flax, chex, torch, triton).
#
#   bash benchmarks/gpu_check.sh            # on the GPU machine, from the repo root; results under $OUT
#   bash benchmarks/gpu_check.sh --dry-run  # anywhere: tiny shapes, kernels in interpret mode on CPU
#
# Nothing can be downloaded there: wheels for gguf, tokamax and their pure-Python deps travel in .whl/
# (carry ".whl"), made here with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl gguf tokamax immutabledict jaxtyping wadler-lindig
# Without them the tokamax column is skipped with a note.
# Steps: 1) env + nvidia-smi, 2) lowering tests through pytest if available, 3) kernels vs references on the GPU,
# 4) timings of pallas / xla / ragged_dot / tokamax at the Qwen3.6 and Mixtral shapes, T in {1,16,128,2048,16384},
# bf16 and Q8_0, against a measured copy bandwidth and bf16 matmul rate.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_results}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site" || echo "note: installing .whl/ failed; continuing without it"
else
  echo "note: no .whl/ directory: gguf and tokamax are not installed here (tokamax column skipped)"
fi
if [[ "${1:-}" == "--dry-run" ]]; then
  shift
  JAX_PLATFORMS=cpu "$PY" benchmarks/gpu_bench.py --dry-run --out "$OUT" "$@"
  exit $?
fi
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv || true; } | tee "$OUT/nvidia_smi.txt"
"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tee "$OUT/env.txt"
rc=0
if "$PY" -c "import pytest, hypothesis" 2>/dev/null; then
  JAX_PLATFORMS= timeout 300 "$PY" -m pytest -q -p no:cacheprovider tests/test_pallas_lowering.py 2>&1 | tail -15 \
    | tee "$OUT/lowering_tests.txt" || rc=1
fi
JAXMOE_PALLAS_INTERPRET=0 timeout 420 "$PY" benchmarks/gpu_bench.py --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_bench.log"
[[ ${PIPESTATUS[0]} -eq 0 ]] || rc=1
exit $rc

#!/usr/bin/env bash
# The one prepared GPU check (benchmarks/README.md, "GPU"): fits one device call.
#
#   bash benchmarks/gpu_check.sh            # on the GPU machine, from anywhere; results under $OUT
#   bash benchmarks/gpu_check.sh --dry-run  # anywhere: the same phases on the CPU (tiny shapes,
#                                           # kernels in interpret mode)
#   bash benchmarks/gpu_check.sh --dry-run --untimed  # the same, every phase run to its end (no
#                                           # timeouts, deadlines or row cap): what tests/test_gpu_check.py
#                                           # runs, so its rows do not depend on the machine's load
#
# Phases, each its own process with its own timeout (a crash or a hung kernel in one does
# not take the next with it), each writing its rows as soon as they exist:
#   wheels   install the carried wheels (.whl/, listed in benchmarks/gpu_wheels.txt) into $SITE
#   check    benchmarks/gpu_kernels_check.py: env.json, then check.jsonl (kernels vs references)
#   bench    benchmarks/gpu_bench.py: bench.jsonl (ceilings, then one row per timing)
#   summary  benchmarks/gpu_summary.py: bench.md (tables and targets), printed last
# Files under $OUT (5): env.json check.jsonl bench.jsonl bench.md log.txt
# Exit code: the summary's (1 if a check failed, a row errored or mismatched, a phase
# failed or timed out, or a planned row is missing).
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0 UNTIMED=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    --untimed) UNTIMED=1 ;;
    *) echo "usage: bash benchmarks/gpu_check.sh [--dry-run] [--untimed]" >&2; exit 2 ;;
  esac
done

# Time limits in seconds: each phase's timeout plus KILL seconds of grace after it; their
# sum stays under 480 s (8 minutes) so one device call of at most 10 minutes holds it.
T_WHEELS=15 T_CHECK=135 T_BENCH=270 T_SUMMARY=15 KILL=5
TOTAL=$((T_WHEELS + T_CHECK + T_BENCH + T_SUMMARY + 4 * KILL))
if ((TOTAL >= 480)); then echo "error: phase timeouts sum to $TOTAL s, not under 480 s" >&2; exit 2; fi

OUT="${OUT:-${TMPDIR:-/tmp}/jaxmoe-gpu-check}"
mkdir -p "$OUT"
rm -f "$OUT"/{env.json,check.jsonl,bench.jsonl,bench.md,log.txt}
LOG="$OUT/log.txt"
PY="${PYTHON:-python3}"
SITE="${TMPDIR:-/tmp}/jaxmoe-gpu-site"
WHEELS="${WHEELS:-.whl}"  # the carried wheels (benchmarks/gpu_wheels.txt)
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ((DRY)); then
  export JAX_PLATFORMS=cpu  # the scripts take --dry-run: interpret-mode kernels
  # the dry run checks plumbing, not CPU speed: XLA:CPU compiles faster unoptimized
  export XLA_FLAGS="${XLA_FLAGS:-} --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
  FLAG=(--dry-run)
else
  FLAG=()
fi
if ((UNTIMED)); then FLAG+=(--no-deadline); fi
echo "gpu_check: out=$OUT dry_run=$DRY untimed=$UNTIMED timeouts wheels=$T_WHEELS check=$T_CHECK bench=$T_BENCH" \
  "summary=$T_SUMMARY kill=$KILL sum=$TOTAL s" | tee -a "$LOG"

PHASES=()
phase() {  # phase NAME TIMEOUT CMD...: run CMD under timeout, log it, record NAME:RC:SECONDS:TIMEOUT
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  if ((UNTIMED)); then limit=0; fi  # GNU timeout: a duration of 0 disables the timeout
  echo "== phase $name (timeout ${limit} s)" | tee -a "$LOG"
  timeout -k "$KILL" "$limit" "$@" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  echo "== phase $name: exit $rc after $((SECONDS - start)) s" | tee -a "$LOG"
  PHASES+=(--phase "$name:$rc:$((SECONDS - start)):$limit")
}

if compgen -G "$WHEELS/*.whl" >/dev/null; then
  rm -rf "$SITE"
  phase wheels "$T_WHEELS" "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl
  export PYTHONPATH="$PYTHONPATH:$SITE"
else
  echo "note: no $WHEELS/*.whl: the carried wheels (benchmarks/gpu_wheels.txt: gguf, tokamax, ...) are not installed" | tee -a "$LOG"
fi
phase check "$T_CHECK" "$PY" benchmarks/gpu_kernels_check.py --out "$OUT" --deadline $((T_CHECK - 15)) "${FLAG[@]}"
phase bench "$T_BENCH" "$PY" benchmarks/gpu_bench.py --out "$OUT" --deadline $((T_BENCH - 20)) "${FLAG[@]}"
timeout -k "$KILL" "$((UNTIMED ? 0 : T_SUMMARY))" "$PY" benchmarks/gpu_summary.py --out "$OUT" "${PHASES[@]}" 2>&1 | tee -a "$LOG"
exit "${PIPESTATUS[0]}"

#!/usr/bin/env bash
# Runs every benchmark behind BENCHMARKS.md, one after another, and tees each one's output (markdown
# tables) to benchmarks/results/<name>.md. Each script measures its own comparisons side by side in one
# process run, so the ratios hold even on a shared, noisy machine.
#
# Usage: benchmarks/run_all.sh [--quick] [--model DIR] [--threads N] [--only "engine spec ..."]
#   --quick    fewer repetitions and shorter runs (a smoke check of the scripts, not numbers to publish)
#   --model    model directory for the engine/spec/gateway benchmarks (default: models/pdserve-tiny)
#   --threads  torch threads per process (default 2, this machine's core count)
#   --only     a subset of: engine spec gateway http attention kvtransfer
# Environment: PYTHON (default .venv/bin/python), RESULTS_DIR (default benchmarks/results).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-.venv/bin/python}
OUT=${RESULTS_DIR:-benchmarks/results}
QUICK=()
MODEL=()
THREADS=2
ONLY="engine spec gateway http attention kvtransfer"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --quick) QUICK=(--quick); shift ;;
    --model) MODEL=(--model "$2"); shift 2 ;;
    --threads) THREADS="$2"; shift 2 ;;
    --only) ONLY="$2"; shift 2 ;;
    *) echo "run_all.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"

run() {  # run NAME COMMAND...: prints the command, runs it, tees stdout+stderr to $OUT/NAME.md
  local name=$1; shift
  local file="$OUT/$name.md"
  echo "==> $name: $*" >&2
  {
    echo "<!-- command: $* -->"
    echo "<!-- started: $(date -Is), load average: $(cut -d' ' -f1-3 /proc/loadavg) -->"
    echo
    local started=$SECONDS
    if "$@" 2>&1; then status=0; else status=$?; fi
    echo
    echo "<!-- finished: $(date -Is), $((SECONDS - started)) s, exit status $status -->"
  } | tee "$file"
}

for name in $ONLY; do
  case "$name" in
    engine) run engine "$PY" -m benchmarks.bench_engine "${MODEL[@]}" --threads "$THREADS" "${QUICK[@]}" ;;
    spec) run spec "$PY" -m benchmarks.bench_spec "${MODEL[@]}" --threads "$THREADS" "${QUICK[@]}" ;;
    gateway) run gateway "$PY" -m benchmarks.bench_gateway "${MODEL[@]}" --threads "$THREADS" "${QUICK[@]}" ;;
    http) run http "$PY" -m benchmarks.bench_http "${MODEL[@]}" --threads "$THREADS" "${QUICK[@]}" ;;
    attention)
      if [[ ${#QUICK[@]} -gt 0 ]]; then repeat=1; else repeat=3; fi
      run attention "$PY" benchmarks/bench_attention.py --threads "$THREADS" --repeat "$repeat"
      run attention-tiny "$PY" benchmarks/bench_attention.py --dims tiny --threads "$THREADS" --repeat "$repeat" ;;
    kvtransfer)
      if [[ ${#QUICK[@]} -gt 0 ]]; then repeat=2; else repeat=7; fi
      run kvtransfer "$PY" benchmarks/bench_kvtransfer.py --repeat "$repeat" ;;
    *) echo "run_all.sh: unknown benchmark $name" >&2; exit 2 ;;
  esac
done
echo "results in $OUT/" >&2

#!/usr/bin/env bash
# One-shot device check (issue 12) on a machine with one NVIDIA or AMD GPU, in at most 8 minutes:
#   scripts/gpu_check.sh [OUT_DIR]            (default runs/gpu_check/)
#   scripts/gpu_check.sh --dry-run OUT_DIR    (CPU, tiny sizes: checks the script's Python without a GPU)
# Runs from this source tree with the machine's own Python and GPU build of torch ($PYTHON, else python3).
# Nothing is installed from a package registry: if pytest is missing, wheels prepared beforehand in
# scripts/wheels/ (PDSERVE_WHEELS) are installed with pip --no-index into a temporary directory.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
python="${PYTHON:-python3}"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
if ! "$python" -c "import pytest" 2>/dev/null; then
    wheels="${PDSERVE_WHEELS:-$repo/scripts/wheels}"
    if compgen -G "$wheels/*.whl" > /dev/null; then
        site="$(mktemp -d)"
        "$python" -m pip install --quiet --no-index --find-links "$wheels" --target "$site" pytest
        export PYTHONPATH="$PYTHONPATH:$site"
    else
        echo "gpu_check: pytest is not installed and $wheels holds no wheels: the pytest stages will fail" >&2
    fi
fi
exec timeout --kill-after=10 "${GPU_CHECK_TIMEOUT_S:-480}" "$python" scripts/gpu_check.py "$@"

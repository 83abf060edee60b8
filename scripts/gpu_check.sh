#!/usr/bin/env bash
# One-shot device check (issues 12, 35) on a bare machine with one NVIDIA or AMD GPU, in at most 8 minutes:
#   scripts/gpu_check.sh [OUT_DIR]            (default $OUT, else runs/gpu_check/)
#   scripts/gpu_check.sh --dry-run OUT_DIR    (CPU, tiny sizes: checks the script's Python without a GPU)
#   scripts/gpu_check.sh --with-services ...  (also the one-GPU service stages: beyond the 8 minutes)
# Writes OUT/gpu_check.json, OUT/gpu_check.md and OUT/gpu_check.log (stages: scripts/gpu_check.py's docstring).
#
# What the box has and what travels. The GPU machines this project is lent reach no package registry and come
# with Python 3.12, torch 2.11 + CUDA 13, triton 3.6, transformers, grpcio, protobuf, pytest, hypothesis, psutil,
# xxhash, uvloop, safetensors, tokenizers, aiohttp, prometheus-client, numpy, jinja2 (/work/.library/device/
# KINDS.md). A CUDA torch wheel (~1 GB) is far over the 64 MiB a run may carry, so torch, triton and
# transformers are the box's own and are never carried. What is carried is small (~8 MB, fetched here by
# scripts/fetch_gpu_wheels.sh into .whl/, which the run names in `carry`): grpcio-health-checking,
# grpcio-reflection, grpcio-status, googleapis-common-protos and pytest-asyncio, which the box lacks, and
# grpcio + protobuf at the versions our committed generated code was made with (rpc/*_pb2*.py refuse an older
# runtime at import; the box's versions are not known ahead). They are installed with pip --no-index --no-deps
# into a scratch directory that comes FIRST on PYTHONPATH, so they shadow the box's own grpcio / protobuf.
# Wheels: $PDSERVE_WHEELS, else .whl/; scripts/wheels/ (pytest, pure Python) only when pytest is missing.
# On this project's lent H200 (/work/.library/device/README.md): here `bash scripts/fetch_gpu_wheels.sh`, then the
# device tool's run with command `bash scripts/gpu_check.sh "$OUT"`, carry [".whl"], timeout_s 540 (the check
# kills itself at 480 s; what it wrote under $OUT comes back even then).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
python="${PYTHON:-python3}"
site=""
install_wheels() {  # $1: a directory of wheels
    [ -n "$site" ] || site="$(mktemp -d -t pdserve-wheels-XXXXXX)"
    "$python" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$1"/*.whl
}
wheels="${PDSERVE_WHEELS:-$repo/.whl}"
dry_run=0
for arg in "$@"; do [ "$arg" = "--dry-run" ] && dry_run=1; done
# the dry run (CPU, CI) uses the environment it is given: the carried wheels are for the box's Python 3.12
if [ "$dry_run" = 0 ] && compgen -G "$wheels/*.whl" > /dev/null; then
    install_wheels "$wheels"
    echo "gpu_check: installed $(ls "$wheels"/*.whl | wc -l) carried wheels from $wheels into $site" >&2
fi
inherited="${PYTHONPATH:-}"
export PYTHONPATH="$repo${site:+:$site}${inherited:+:$inherited}"
if ! "$python" -c "import pytest" 2>/dev/null; then
    if compgen -G "$repo/scripts/wheels/*.whl" > /dev/null; then
        install_wheels "$repo/scripts/wheels"
        export PYTHONPATH="$repo:$site${inherited:+:$inherited}"
    else
        echo "gpu_check: pytest is not installed and no wheels hold it: the pytest stages will fail" >&2
    fi
fi
out="" options=()
while [ $# -gt 0 ]; do
    case "$1" in
        --budget-s) options+=("$1" "$2"); shift 2 ;;
        --*) options+=("$1"); shift ;;
        *) out="$1"; shift ;;
    esac
done
out="${out:-${OUT:-$repo/runs/gpu_check}}"
mkdir -p "$out"
set +e
timeout --kill-after=10 "${GPU_CHECK_TIMEOUT_S:-480}" "$python" -u scripts/gpu_check.py ${options[@]+"${options[@]}"} "$out" 2>&1 \
    | tee "$out/gpu_check.log"
status=${PIPESTATUS[0]}
[ -n "$site" ] && rm -rf "$site"
exit "$status"

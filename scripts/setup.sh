#!/usr/bin/env bash
# Idempotent setup: a virtual environment in .venv with the CPU build of torch 2.13.0
# (installed first, so nothing pulls a multi-GB CUDA build) and pdserve in editable mode.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
if ! .venv/bin/python -c "import engine, torch, grpc, transformers, pytest_timeout" >/dev/null 2>&1; then
    .venv/bin/pip install --quiet torch==2.13.0
    .venv/bin/pip install --quiet -e ".[dev]"
fi

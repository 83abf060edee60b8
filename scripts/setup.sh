#!/usr/bin/env bash
# Idempotent setup: a virtual environment in .venv with the CPU build of torch 2.13.0
# (installed first, so nothing pulls a multi-GB CUDA build) and pdserve in editable mode with its dev extra.
# Re-installs whenever pyproject.toml changed since the last successful install (a stamp in .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
stamp=".venv/.pdserve-installed"
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! .venv/bin/python -c "import engine, torch, grpc, transformers" >/dev/null 2>&1; then
    .venv/bin/pip install --quiet torch==2.13.0
    .venv/bin/pip install --quiet -e ".[dev]"
    echo "$want" > "$stamp"
fi

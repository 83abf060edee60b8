#!/usr/bin/env bash
# Fetches, on a machine with a package registry, the wheels scripts/gpu_check.sh installs on a bare GPU box
# (Python 3.12, manylinux x86_64) into .whl/ (ignored by git; a device run names it in `carry`, ~8 MB of the
# 64 MiB it may carry). Versions: this checkout's .venv, whose grpcio-tools generated rpc/*_pb2*.py, so the
# carried runtime is never older than the generated code. Usage: scripts/fetch_gpu_wheels.sh [DIR]
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="${1:-$repo/.whl}"
venv_python="$repo/.venv/bin/python"
names=(grpcio protobuf grpcio-health-checking grpcio-reflection grpcio-status googleapis-common-protos pytest-asyncio)
pins=()
for name in "${names[@]}"; do
    version="$("$venv_python" -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')"
    [ -n "$version" ] || { echo "fetch_gpu_wheels: $name is not installed in .venv (run scripts/setup.sh)" >&2; exit 1; }
    pins+=("$name==$version")
done
mkdir -p "$dest"
rm -f "$dest"/*.whl
"$venv_python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dest" "${pins[@]}"
du -sh "$dest"
ls "$dest"

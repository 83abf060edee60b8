#!/usr/bin/env bash
# Regenerates the committed Python code for every .proto under protos/ - the one way stubs are made.
# protos/pdserve/<pkg>/x.proto becomes the importable module rpc.<pkg>.x_pb2 (pdserve.v1 -> rpc.v1,
# pdserve.internal.v1 -> rpc.internal.v1): protoc writes into a temporary directory, then the generated
# absolute imports `from pdserve.<pkg> import` are rewritten to `from rpc.<pkg> import`, so the stubs import
# as a package without any sys.path change. Usage: scripts/gen_protos.sh [OUTPUT_ROOT] (default: the repo).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON; elif [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
OUT=${1:-.}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mapfile -t protos < <(find protos -name '*.proto' | LC_ALL=C sort)
"$PY" -m grpc_tools.protoc -Iprotos --python_out="$work" --pyi_out="$work" --grpc_python_out="$work" "${protos[@]}"
find "$OUT/rpc" \( -name '*_pb2.py' -o -name '*_pb2.pyi' -o -name '*_pb2_grpc.py' \) -delete 2>/dev/null || true
(cd "$work/pdserve" && find . -type f \( -name '*_pb2.py' -o -name '*_pb2.pyi' -o -name '*_pb2_grpc.py' \)) |
while read -r file; do
  mkdir -p "$OUT/rpc/$(dirname "$file")"
  sed -E 's/^from pdserve\.([a-z0-9_.]+) import /from rpc.\1 import /' "$work/pdserve/$file" > "$OUT/rpc/$file"
done

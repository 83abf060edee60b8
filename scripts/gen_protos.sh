#!/usr/bin/env bash
# Regenerates the committed Python code for every .proto under protos/ (one command, no sys.path tricks:
# protos/pdserve/v1/x.proto becomes the importable module pdserve.v1.x_pb2).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
rm -f pdserve/v1/*_pb2.py pdserve/v1/*_pb2.pyi pdserve/v1/*_pb2_grpc.py
"$PY" -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. protos/pdserve/v1/*.proto

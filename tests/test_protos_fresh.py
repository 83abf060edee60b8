"""The committed generated code in pdserve/v1 is exactly what scripts/gen_protos.sh produces from protos/."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def test_generated_code_is_fresh(tmp_path):
    """Regenerating every .proto into a temporary directory reproduces the committed files byte for byte,
    and no generated file exists without its .proto."""
    protos = sorted((ROOT / "protos").rglob("*.proto"))
    assert protos, "no .proto sources found"
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'protos'}", f"--python_out={tmp_path}",
         f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", *map(str, protos)],
        check=True, capture_output=True, text=True,
    )
    fresh = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.name.endswith(GENERATED_SUFFIXES)}
    committed = {p.relative_to(ROOT): p.read_bytes() for p in (ROOT / "pdserve").rglob("*")
                 if p.name.endswith(GENERATED_SUFFIXES)}
    assert sorted(map(str, fresh)) == sorted(map(str, committed)), "generated files differ from the .proto set"
    stale = [str(path) for path, content in fresh.items() if committed[path] != content]
    assert not stale, f"stale generated code (run scripts/gen_protos.sh): {stale}"


def test_generated_modules_import_as_a_package():
    """pdserve.v1 stubs import without sys.path changes and expose the services."""
    from pdserve.v1 import gateway_pb2, gateway_pb2_grpc, worker_pb2_grpc

    assert gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].methods_by_name["Generate"].server_streaming
    assert hasattr(gateway_pb2_grpc, "GatewayStub")
    assert hasattr(worker_pb2_grpc, "DecodeStub") and hasattr(worker_pb2_grpc, "PrefillStub")

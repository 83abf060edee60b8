"""The committed generated code under rpc/ is exactly what scripts/gen_protos.sh produces from protos/."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def _generated(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in (root / "rpc").rglob("*") if p.name.endswith(GENERATED_SUFFIXES)}


def test_generated_code_is_fresh(tmp_path):
    """Running scripts/gen_protos.sh into a temporary directory reproduces the committed files byte for byte,
    and no generated file exists without its .proto."""
    assert sorted((ROOT / "protos").rglob("*.proto")), "no .proto sources found"
    subprocess.run(["bash", str(ROOT / "scripts" / "gen_protos.sh"), str(tmp_path)], check=True,
                   capture_output=True, text=True, env={**os.environ, "PYTHON": sys.executable})
    fresh, committed = _generated(tmp_path), _generated(ROOT)
    assert fresh, "the script generated nothing"
    assert sorted(fresh) == sorted(committed), "generated files differ from the .proto set"
    stale = [path for path, content in fresh.items() if committed[path] != content]
    assert not stale, f"stale generated code (run scripts/gen_protos.sh): {stale}"
    assert not [path for path, content in committed.items() if b"from pdserve." in content], "unrewritten imports"


def test_generated_modules_import_as_a_package():
    """rpc.v1 stubs import without sys.path changes and expose the services."""
    from rpc.v1 import gateway_pb2, gateway_pb2_grpc
    from rpc.internal.v1 import worker_pb2_grpc

    assert gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].methods_by_name["Generate"].server_streaming
    assert hasattr(gateway_pb2_grpc, "GatewayServiceStub")
    assert hasattr(worker_pb2_grpc, "DecodeServiceStub") and hasattr(worker_pb2_grpc, "PrefillServiceStub")

"""The client examples of docs/client.md run against a real gateway: the Python client, the grpcurl-style
reflection client and (when node and npm are installed) the Node client with @grpc/grpc-js."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "client"
pytestmark = pytest.mark.slow


def _run(command: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def test_python_example(cluster):
    """python_client.py streams a generation to FINISH_REASON_LENGTH and prints the BadRequest field."""
    result = _run([sys.executable, str(EXAMPLES / "python_client.py"), cluster.gateway_address])
    assert result.returncode == 0, result.stderr
    assert "finished: FINISH_REASON_LENGTH, 8 tokens" in result.stdout, result.stdout
    assert "INVALID_ARGUMENT: max_tokens:" in result.stdout and "bad field max_tokens:" in result.stdout, result.stdout


def test_reflection_session(cluster):
    """grpc_reflect.py lists the public service, describes a message and calls Generate from JSON alone."""
    script = [sys.executable, str(EXAMPLES / "grpc_reflect.py"), cluster.gateway_address]
    listed = _run([*script, "list"])
    assert "pdserve.v1.GatewayService" in listed.stdout.split(), listed.stdout + listed.stderr
    described = _run([*script, "describe", "pdserve.v1.GenerateRequest"])
    assert "optional int32 max_tokens = 5;" in described.stdout, described.stdout + described.stderr
    called = _run([*script, "call", "pdserve.v1.GatewayService/Generate",
                   '{"tokenIds": {"ids": [5, 6, 7]}, "maxTokens": 3, "ignoreEos": true}'])
    lines = [json.loads(line) for line in called.stdout.splitlines()]
    assert called.returncode == 0 and lines[-1]["complete"]["finishReason"] == "FINISH_REASON_LENGTH", called.stdout
    refused = _run([*script, "call", "pdserve.v1.GatewayService/Generate", '{"tokenIds": {"ids": [5]}, "maxTokens": -1}'])
    report = json.loads(refused.stdout)
    assert refused.returncode == 1 and report["code"] == "INVALID_ARGUMENT", refused.stdout
    assert report["details"][0]["fieldViolations"][0]["field"] == "max_tokens", report


@pytest.fixture(scope="module")
def node_modules(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are not both on PATH: the Node client example cannot run here")
    prefix = tmp_path_factory.mktemp("node-example")
    shutil.copy(EXAMPLES / "package.json", prefix / "package.json")
    try:
        install = subprocess.run(["npm", "install", "--prefix", str(prefix), "--cache", str(prefix / ".npm"),
                                  "--no-audit", "--no-fund", "--silent"], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.skip("npm install of @grpc/grpc-js and @grpc/proto-loader timed out (registry unreachable?)")
    if install.returncode != 0:
        pytest.skip(f"npm could not install @grpc/grpc-js / @grpc/proto-loader: {install.stderr.strip()[-300:]}")
    return prefix / "node_modules"


def test_node_example(cluster, node_modules):
    """generate.js (grpc-js + proto-loader on protos/) gets model info, a LENGTH-finished generation and a
    google.rpc.BadRequest naming max_tokens."""
    result = _run(["node", str(EXAMPLES / "generate.js"), cluster.gateway_address, str(ROOT / "protos")],
                  env={"NODE_PATH": str(node_modules)})
    assert result.returncode == 0, result.stdout + result.stderr
    info, done, error = (json.loads(line) for line in result.stdout.splitlines())
    assert info["vocab_size"] > 0
    assert done["finish_reason"] == "FINISH_REASON_LENGTH" and done["completion_tokens"] == 8 and len(done["tokens"]) == 8
    assert error["code"] == "INVALID_ARGUMENT" and error["message"].startswith("max_tokens:")
    assert error["details"] == [{"type": "google.rpc.BadRequest", "field_violations": [
        {"field": "max_tokens", "description": error["message"].removeprefix("max_tokens: ")}]}]

"""pdserve.healthcheck (the containers' health probe) against a real grpc.health.v1 server on loopback."""
from __future__ import annotations

from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.healthcheck import check, main


@pytest.fixture()
def health_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        server.stop(grace=None).wait()


def test_serving_server_passes(health_server, capsys):
    """Exit 0 only when the server answers SERVING."""
    address, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert main([address, "--timeout", "30"]) == 0
    assert "SERVING" in capsys.readouterr().out


def test_not_serving_and_unknown_service_fail(health_server, capsys):
    """NOT_SERVING, or a service the server does not know, exits 1 with one line on stderr."""
    address, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert main([address, "--timeout", "30"]) == 1
    assert "NOT_SERVING" in capsys.readouterr().err
    assert main([address, "--service", "pdserve.v1.Nothing", "--timeout", "30"]) == 1
    err = capsys.readouterr().err
    assert "NOT_FOUND" in err and len(err.strip().splitlines()) == 1


def test_unreachable_server_fails_fast():
    """Nothing listening: not serving, with the gRPC status in the reason."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("127.0.0.1:0")  # reserve a free port, then close it
    server.stop(None).wait()
    serving, reason = check(f"127.0.0.1:{port}", timeout=1.0)
    assert not serving
    assert "UNAVAILABLE" in reason or "DEADLINE_EXCEEDED" in reason

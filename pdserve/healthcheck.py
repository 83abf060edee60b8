"""Container health probe: `python -m pdserve.healthcheck HOST:PORT` asks grpc.health.v1 and exits 0
only when the server answers SERVING (1 otherwise, with one line on stderr saying why)."""
from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, service: str = "", timeout: float = 3.0, tls_root: bytes | None = None) -> tuple[bool, str]:
    """(serving?, status or error text) of `service` ("" = the whole server) at `address`; tls_root:
    speak TLS, trusting this PEM certificate (e.g. a server's self-signed one)."""
    if tls_root is not None:
        channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=tls_root))
    else:
        channel = grpc.insecure_channel(address)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as error:
            return False, f"{error.code().name}: {error.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.healthcheck", description=__doc__)
    parser.add_argument("address", help="HOST:PORT of a gRPC server")
    parser.add_argument("--service", default="", help="service name to check (default: the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    args = parser.parse_args(argv)
    serving, status = check(args.address, args.service, args.timeout)
    target = f"{args.address}" + (f" ({args.service})" if args.service else "")
    if serving:
        sys.stdout.write(f"{target}: {status}\n")
        return 0
    sys.stderr.write(f"{target}: not serving: {' '.join(status.split())}\n")
    return 1


if __name__ == "__main__":
    sys.exit(main())

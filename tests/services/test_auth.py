"""Authentication (issue 15, item 3) on real processes: by default `pdserve up`'s workers listen on Unix
sockets in a private 0700 directory; with TCP they require the generated token on every call; the
gateway can serve TLS and require API keys (health probes excepted)."""
from __future__ import annotations

import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.client import build_request, generate
from pdserve.launcher import Cluster
from rpc.internal.v1 import kv_pb2, worker_pb2, worker_pb2_grpc
from rpc.v1 import gateway_pb2_grpc
from tests.services.conftest import launch, worker_address
from tests.services.helpers import decode_once, prefill_once

pytestmark = pytest.mark.slow
API_KEY = "client-key-1"
GOOD = build_request([5, 6, 7, 8], max_tokens=3, temperature=0.0, ignore_eos=True)


def _self_signed(directory: Path) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make the test certificate")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"], check=True, capture_output=True)
    return cert, key


@pytest.fixture(scope="module")
def secured(service_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, bytes]]:
    """Workers on TCP with a token; the gateway on TLS with an API key."""
    secrets_dir = tmp_path_factory.mktemp("tls")
    cert, key = _self_signed(secrets_dir)
    keys = secrets_dir / "api-keys"
    keys.write_text(f"# clients\n{API_KEY}\n")
    cluster = launch(service_model, tmp_path_factory.mktemp("auth_logs"), internal="tcp", tls_cert=str(cert),
                     tls_key=str(key), api_key_file=str(keys))
    yield cluster, cert.read_bytes()
    cluster.stop()


async def test_workers_refuse_calls_without_the_token(secured):
    """Reserve, Release, a PrefillStream and a DecodeStream (and GetDecodeLoad) sent to the TCP workers without
    the token, or with a wrong one, end UNAUTHENTICATED; with the generated token they are served."""
    cluster, _ = secured
    assert cluster.internal_token
    decode, prefill = worker_address(cluster, "decode-0"), worker_address(cluster, "prefill-0")
    assert not decode.startswith("unix:")
    async with grpc.aio.insecure_channel(decode) as decode_channel, grpc.aio.insecure_channel(prefill) as prefill_channel:
        decode_stub, prefill_stub = worker_pb2_grpc.DecodeServiceStub(decode_channel), worker_pb2_grpc.PrefillServiceStub(prefill_channel)
        calls = {
            "Reserve": lambda md: decode_stub.Reserve(worker_pb2.ReserveRequest(
                request_id="intruder", num_prompt_tokens=4, max_new_tokens=4, transport=kv_pb2.TRANSPORT_SHM),
                metadata=md, timeout=30),
            "Release": lambda md: decode_stub.Release(worker_pb2.ReleaseRequest(request_id="someone"), metadata=md,
                                                      timeout=30),
            "PrefillStream": lambda md: prefill_once(prefill_stub, worker_pb2.PrefillRequest(
                request_id="intruder", token_ids=[5]), 30, md),
            "DecodeStream": lambda md: decode_once(decode_stub, worker_pb2.DecodeRequest(request_id="intruder"), 30, md),
            "GetLoad": lambda md: decode_stub.GetDecodeLoad(worker_pb2.GetDecodeLoadRequest(), metadata=md, timeout=30),
        }
        for name, call in calls.items():
            for metadata in ((), (("authorization", "Bearer not-the-token"),)):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await call(metadata)
                assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED, (name, metadata, caught.value)
        token = (("authorization", f"Bearer {cluster.internal_token}"),)
        assert (await calls["Release"](token)).found is False
        load = await calls["GetLoad"](token)
        assert load.leases == load.standing_leases and load.total_pages > 0  # the gateway's spare at most


async def test_gateway_needs_tls_and_an_api_key(secured):
    """Over TLS: Generate without a key, or with a wrong one, is UNAUTHENTICATED; with the key it is
    served (so the gateway passes the internal token on); health answers without a key. A plaintext
    client cannot talk to the TLS port."""
    cluster, cert = secured
    credentials = grpc.ssl_channel_credentials(root_certificates=cert)
    async with grpc.aio.secure_channel(cluster.gateway_address, credentials) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        for metadata in (None, (("authorization", "Bearer wrong"),)):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await generate(stub, GOOD, timeout=30, metadata=metadata)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        result = await generate(stub, GOOD, timeout=60, metadata=(("authorization", f"Bearer {API_KEY}"),))
        assert result.complete is not None and len(result.token_ids) == 3, result.error
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    async with grpc.aio.insecure_channel(cluster.gateway_address) as plain:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await generate(gateway_pb2_grpc.GatewayServiceStub(plain), GOOD, timeout=10,
                           metadata=(("authorization", f"Bearer {API_KEY}"),))
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_http_front_needs_the_api_key_over_https(secured):
    """The OpenAI HTTP front of the same gateway serves HTTPS with the gateway's certificate and answers
    401 without the API key (or with a wrong one), 200 with it; /health needs no key."""
    import ssl

    import aiohttp

    cluster, cert = secured
    context = ssl.create_default_context(cadata=cert.decode())
    base = f"https://{cluster.http_address}"
    async with aiohttp.ClientSession() as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            async with http.get(f"{base}/v1/models", headers=headers, ssl=context) as response:
                assert response.status == 401, headers
        async with http.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}, ssl=context) as response:
            assert response.status == 200 and (await response.json())["data"]
        async with http.get(f"{base}/health", ssl=context) as response:
            assert response.status == 200


def test_default_workers_listen_on_private_unix_sockets(cluster):
    """`pdserve up`'s default: every worker is a Unix socket in a directory only its user can enter."""
    for role in ("decode-0", "prefill-0"):
        address = worker_address(cluster, role)
        assert address.startswith("unix:"), address
        path = Path(address[len("unix:"):])
        assert stat.S_ISSOCK(path.stat().st_mode)
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700

"""Health (with List) and server reflection v1 beside v1alpha, over a real in-process grpc.aio server."""
from __future__ import annotations

import logging

import grpc
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2

from rpc import server as serving

SERVICE = "test.Service"


async def _reflect(channel: grpc.aio.Channel, version: str, request: reflection_pb2.ServerReflectionRequest,
                   ) -> reflection_pb2.ServerReflectionResponse:
    call = channel.stream_stream(f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
                                 request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                 response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
    responses = [response async for response in call(iter([request]), timeout=10)]
    assert len(responses) == 1
    return responses[0]


async def test_reflection_v1_and_v1alpha_list_and_describe(caplog):
    """Both reflection versions list the same services (v1 and v1alpha among them), and v1 describes
    its own service from a file of package grpc.reflection.v1; Health.List returns every status set,
    and nothing is logged at ERROR."""
    caplog.set_level(logging.INFO)
    server = grpc.aio.server()
    health = serving.add_health_and_reflection(server, [SERVICE])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await serving.set_serving(health, [SERVICE], True)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            listed = {}
            for version in ("v1", "v1alpha"):
                reply = await _reflect(channel, version, reflection_pb2.ServerReflectionRequest(list_services=""))
                listed[version] = {service.name for service in reply.list_services_response.service}
            described = await _reflect(channel, "v1", reflection_pb2.ServerReflectionRequest(
                file_containing_symbol="grpc.reflection.v1.ServerReflection"))
            statuses = await health_pb2_grpc.HealthStub(channel).List(health_pb2.HealthListRequest(), timeout=10)
    finally:
        await server.stop(None)
    assert listed["v1"] == listed["v1alpha"]
    assert {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection"} <= listed["v1"]
    files = [descriptor_pb2.FileDescriptorProto.FromString(raw)
             for raw in described.file_descriptor_response.file_descriptor_proto]
    assert any(f.package == "grpc.reflection.v1" and f.service[0].name == "ServerReflection" for f in files), files
    serving_status = health_pb2.HealthCheckResponse.SERVING
    assert {name: status.status for name, status in statuses.statuses.items()} == {"": serving_status, SERVICE: serving_status}
    assert not [record for record in caplog.records if record.levelno >= logging.ERROR]

"""grpc.health.v1 with List, and server reflection under both grpc.reflection.v1 and v1alpha.

grpcio-reflection ships only the v1alpha service, while current tools (grpcurl, Postman, grpc-js'
reflection clients) ask grpc.reflection.v1 first. The two protocols have the same messages, field for
field, under another package name, so v1 is served by the v1alpha servicer through handlers that use
the v1alpha message classes for the bytes, and a v1 copy of the descriptor (package renamed) is added
to the default pool so that v1 itself can be listed and described.

grpcio-health-checking's asyncio servicer leaves Health.List unimplemented (a NotImplementedError and
a traceback per call); `Health` answers it from the statuses it holds."""
from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection, reflection_pb2
from grpc_reflection.v1alpha._async import ReflectionServicer

V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"
_V1_FILE = "grpc/reflection/v1/reflection.proto"


class Health(HealthServicer):
    """grpc.health.v1.Health, List included."""

    async def List(self, request: health_pb2.HealthListRequest, context: grpc.aio.ServicerContext,  # noqa: N802
                   ) -> health_pb2.HealthListResponse:
        statuses = dict(self._server_status)  # service name -> ServingStatus, as set()
        return health_pb2.HealthListResponse(
            statuses={name: health_pb2.HealthCheckResponse(status=status) for name, status in statuses.items()})


def _register_v1_descriptor() -> None:
    """Adds grpc/reflection/v1/reflection.proto to the default pool (once): v1alpha's, renamed."""
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(_V1_FILE)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name, proto.package = _V1_FILE, "grpc.reflection.v1"
    proto.options.Clear()
    old, new = ".grpc.reflection.v1alpha.", ".grpc.reflection.v1."
    for message in proto.message_type:
        for field in message.field:
            if field.type_name:
                field.type_name = field.type_name.replace(old, new)
    for method in proto.service[0].method:
        method.input_type, method.output_type = method.input_type.replace(old, new), method.output_type.replace(old, new)
    pool.Add(proto)


def add_health_and_reflection(server: grpc.aio.Server, service_names: Iterable[str]) -> Health:
    """Registers grpc.health.v1 (with List) and reflection v1 + v1alpha listing service_names, health and
    both reflection services."""
    health = Health()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    _register_v1_descriptor()
    names = [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME, V1_SERVICE_NAME]
    servicer = ReflectionServicer(names)
    for service in (reflection.SERVICE_NAME, V1_SERVICE_NAME):
        handler = grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo, request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, {"ServerReflectionInfo": handler}),))
    return health

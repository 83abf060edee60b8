"""A grpcurl-style client that needs no .proto file: everything comes from the server's reflection service.

    python examples/client/grpc_reflect.py HOST:PORT list
    python examples/client/grpc_reflect.py HOST:PORT describe pdserve.v1.GenerateRequest
    python examples/client/grpc_reflect.py HOST:PORT call pdserve.v1.GatewayService/Generate '{"text": "hi"}'

`call` prints each response as one JSON line (server streams too); a failed call prints the status and its
google.rpc details and exits 1."""
from __future__ import annotations

import argparse
import json
import sys

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, json_format, message_factory
from google.rpc import error_details_pb2  # noqa: F401 - registers BadRequest / RetryInfo for json_format
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from grpc_status import rpc_status


def describe(pool: descriptor_pool.DescriptorPool, symbol: str) -> str:
    """The symbol (a service or a message) as .proto-like text. Comments are not included: Python servers
    publish descriptors without source info; read them in protos/ (every field is documented there)."""
    try:
        service = pool.FindServiceByName(symbol)
    except KeyError:
        service = None
    if service is not None:
        lines = [f"service {service.name} {{"]
        for method in service.methods:
            stream_in = "stream " if method.client_streaming else ""
            stream_out = "stream " if method.server_streaming else ""
            lines.append(f"  rpc {method.name}({stream_in}.{method.input_type.full_name}) "
                         f"returns ({stream_out}.{method.output_type.full_name});")
        return "\n".join([*lines, "}"])
    message = pool.FindMessageTypeByName(symbol)
    lines = [f"message {message.name} {{"]
    for field in message.fields:
        kind = field.message_type.full_name if field.message_type else (
            field.enum_type.full_name if field.enum_type else
            descriptor_pb2.FieldDescriptorProto.Type.Name(field.type).removeprefix("TYPE_").lower())
        synthetic = field.containing_oneof is None or field.containing_oneof.name == f"_{field.name}"  # proto3 optional
        label = "repeated " if field.is_repeated else (
            "optional " if field.has_presence and synthetic and not field.message_type else "")
        lines.append(f"  {label}{kind} {field.name} = {field.number};")
    return "\n".join([*lines, "}"])


def call(channel: grpc.Channel, pool: descriptor_pool.DescriptorPool, target: str, body: str) -> int:
    service_name, method_name = target.replace("/", ".").rsplit(".", 1)
    method = pool.FindServiceByName(service_name).methods_by_name[method_name]
    request_type = message_factory.GetMessageClass(method.input_type)
    response_type = message_factory.GetMessageClass(method.output_type)
    request = json_format.Parse(body or "{}", request_type())
    path = f"/{service_name}/{method_name}"
    make = channel.unary_stream if method.server_streaming else channel.unary_unary
    stub = make(path, request_serializer=request_type.SerializeToString, response_deserializer=response_type.FromString)
    try:
        responses = stub(request, timeout=120)
        for response in responses if method.server_streaming else [responses]:
            print(json.dumps(json_format.MessageToDict(response)))
    except grpc.RpcError as error:
        status = rpc_status.from_call(error)
        report = {"code": error.code().name, "message": error.details()}
        if status is not None:
            report["details"] = [json_format.MessageToDict(detail) for detail in status.details]
        print(json.dumps(report))
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("address")
    parser.add_argument("command", choices=("list", "describe", "call"))
    parser.add_argument("symbol", nargs="?", default="")
    parser.add_argument("body", nargs="?", default="{}")
    args = parser.parse_args(argv)
    with grpc.insecure_channel(args.address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        pool = descriptor_pool.DescriptorPool(database)
        if args.command == "list":
            print("\n".join(sorted(database.get_services())))
            return 0
        if args.command == "describe":
            print(describe(pool, args.symbol))
            return 0
        return call(channel, pool, args.symbol, args.body)


if __name__ == "__main__":
    sys.exit(main())

"""Python client for pdserve.v1.GatewayService (docs/client.md): model info, a streamed generation, and the
structured error of a bad request. Usage: python examples/client/python_client.py HOST:PORT

Uses the stubs committed in this repository (rpc.v1); elsewhere generate your own from
protos/pdserve/v1/*.proto with grpcio-tools."""
from __future__ import annotations

import sys

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from rpc.v1 import gateway_pb2, gateway_pb2_grpc


def error_details(error: grpc.RpcError) -> list[str]:
    """The google.rpc details of a failed call, as readable lines."""
    status = rpc_status.from_call(error)
    lines = []
    for detail in status.details if status is not None else []:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            lines += [f"bad field {v.field}: {v.description}" for v in bad.field_violations]
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            detail.Unpack(info)
            lines.append(f"retry after {info.retry_delay.ToTimedelta().total_seconds():.3f} s")
    return lines


def main(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        info = stub.GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=10)
        print(f"model {info.model}: vocab {info.vocab_size}, context {info.max_context}")
        request = gateway_pb2.GenerateRequest(max_tokens=8, ignore_eos=True,
                                              sampling=gateway_pb2.SamplingParams(temperature=0.0))
        if info.has_tokenizer:
            request.text = "The capital of France is"
        else:
            request.token_ids.ids.extend([1, 2, 3])
        for response in stub.Generate(request, timeout=120):
            if response.HasField("chunk"):
                print(f"tokens {list(response.chunk.token_ids)} text {response.chunk.text!r}")
            elif response.HasField("complete"):
                reason = gateway_pb2.Complete.FinishReason.Name(response.complete.finish_reason)
                print(f"finished: {reason}, {response.complete.usage.completion_tokens} tokens")
        try:
            for _ in stub.Generate(gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=[1]), max_tokens=0)):
                pass
        except grpc.RpcError as error:
            print(f"{error.code().name}: {error.details()}")
            for line in error_details(error):
                print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:50051"))

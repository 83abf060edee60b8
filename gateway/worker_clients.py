"""The gateway's handle on one worker: its load as the gateway counts it (router.py), its channel and stub,
and the one long-lived multiplexed stream every request to it goes over (prefill_stream.py: submit() gives a
future of the prompt's PrefillResponse; decode_stream.py: submit() gives a DecodeCall of the request's updates)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

import grpc

from gateway.decode_stream import DecodeStream
from gateway.prefill_stream import PrefillStream
from gateway.router import DecodeLoad, PrefillLoad
from gateway.worker_stream import Metadata
from rpc.internal.v1 import worker_pb2_grpc
from rpc.server import CHANNEL_OPTIONS

Load = TypeVar("Load", PrefillLoad, DecodeLoad)
Stub = TypeVar("Stub", worker_pb2_grpc.PrefillServiceStub, worker_pb2_grpc.DecodeServiceStub)
Stream = TypeVar("Stream", PrefillStream, DecodeStream)


@dataclass
class WorkerClient(Generic[Load, Stub, Stream]):
    load: Load
    channel: grpc.aio.Channel
    stub: Stub
    stream: Stream


PrefillWorker = WorkerClient[PrefillLoad, worker_pb2_grpc.PrefillServiceStub, PrefillStream]
DecodeWorker = WorkerClient[DecodeLoad, worker_pb2_grpc.DecodeServiceStub, DecodeStream]


def connect_prefill(address: str, metadata: Metadata) -> PrefillWorker:
    """metadata: sent when the stream opens (the internal token, if any)."""
    channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    stub = worker_pb2_grpc.PrefillServiceStub(channel)
    return WorkerClient(PrefillLoad(address, healthy=False), channel, stub, PrefillStream(stub, metadata, address))


def connect_decode(address: str, metadata: Metadata) -> DecodeWorker:
    channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    stub = worker_pb2_grpc.DecodeServiceStub(channel)
    return WorkerClient(DecodeLoad(address, healthy=False), channel, stub, DecodeStream(stub, metadata, address))

"""The asyncio servicer, as the decode worker runs it, registered through the generated helper (plain
PushRequest messages) or through add_to_server (the zero-copy chunk codec): a push lands exact either way."""
from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from kvtransfer.grpc_receiver import PushReceiver
from kvtransfer.grpc_servicer import KVTransferAioServicer, add_to_server
from kvtransfer.grpc_transport import GrpcWriter
from kvtransfer.layout import KVLayout
from kvtransfer.leases import LeaseTable
from kvtransfer.shm_pool import SharedPagePool
from rpc.internal.v1 import kv_pb2_grpc

from .conftest import random_cache


@pytest.mark.parametrize("registration", ["generated", "add_to_server"])
async def test_aio_server(registration):
    """The asyncio servicer (as the decode worker runs it) receives a push, registered either way."""
    layout = KVLayout(2, 16, 4, 8, "float32", 1, 8)
    with SharedPagePool.create(layout, 6) as pool:
        receiver = PushReceiver([pool.cache])
        server = grpc.aio.server()
        if registration == "generated":
            kv_pb2_grpc.add_KVTransferServiceServicer_to_server(KVTransferAioServicer(receiver), server)
        else:
            add_to_server(receiver, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            receiver.advertise([f"127.0.0.1:{port}"])
            source = random_cache(layout, 2, seed=11)
            destination = receiver.expect(LeaseTable().grant("r", [4, 1], 60), 16)
            writer = GrpcWriter(layout)
            await asyncio.to_thread(writer.push, source, [1, 0], destination)
            writer.close()
            assert receiver.admit("r").bytes == 2 * layout.bytes_per_page
            assert torch.equal(pool.cache.kv[:, [4, 1]].view(torch.uint8), source.kv[:, [1, 0]].view(torch.uint8))
            assert torch.equal(pool.cache.draft[:, [4, 1]].view(torch.uint8), source.draft[:, [1, 0]].view(torch.uint8))
        finally:
            await server.stop(0)

"""Following every worker's KV events into the gateway's index (gateway/kv_index.py): one task per worker
holding a WatchKVEvents stream.

A batch the index cannot apply (a gap in sequence numbers, another instance without a snapshot) ends the call and
subscribes again from nothing: the worker answers with a snapshot. A stream that ends or fails (the worker stopped,
died or is unreachable) empties the worker's entry at once, and the task subscribes again with backoff (0.05 s
doubling to 5 s, back to the start after a batch arrives), so a restarted worker is followed from its new
instance's snapshot and never keeps entries of the old one."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import grpc

from gateway.kv_index import KVIndex
from gateway.worker_stream import Metadata
from rpc.internal.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)
BACKOFF_S = (0.05, 5.0)  # first and longest wait before subscribing again


class KVWatch:
    """channels: (address, channel) of every worker (prefill and decode alike)."""

    def __init__(self, index: KVIndex, channels: Sequence[tuple[str, grpc.aio.Channel]], metadata: Metadata) -> None:
        self.index = index
        self._stubs = {address: worker_pb2_grpc.KVEventServiceStub(channel) for address, channel in channels}
        self._metadata = metadata
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._calls: dict[str, grpc.aio.UnaryStreamCall] = {}
        self.resyncs = 0  # subscriptions started again because a batch did not follow (a gap, a new instance)
        self.losses = 0   # streams that ended or failed (the worker's entries were dropped)

    def start(self) -> None:
        for address, stub in self._stubs.items():
            self._tasks[address] = asyncio.create_task(self._follow(address, stub), name=f"kv-watch {address}")

    async def close(self) -> None:
        for call in self._calls.values():
            call.cancel()
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self._tasks.clear()

    def streaming(self, address: str) -> bool:
        """A WatchKVEvents call to the worker is open now."""
        return address in self._calls

    def drop(self, address: str) -> None:
        """Ends the worker's current stream as a network failure would (tests: the index must converge again)."""
        call = self._calls.get(address)
        if call is not None:
            call.cancel()

    async def _follow(self, address: str, stub: worker_pb2_grpc.KVEventServiceStub) -> None:
        wait = BACKOFF_S[0]
        while True:
            instance_id, after = self.index.position(address)
            call = stub.WatchKVEvents(worker_pb2.WatchKVEventsRequest(instance_id=instance_id, after_sequence=after),
                                      metadata=self._metadata)
            self._calls[address] = call
            resync = False
            try:
                async for batch in call:
                    wait = BACKOFF_S[0]
                    if not self.index.apply(address, batch):
                        logger.warning("KV events of %s do not follow what the index holds (instance %s): "
                                       "subscribing again for a snapshot", address, batch.instance_id)
                        self.resyncs += 1
                        resync = True
                        call.cancel()
                        break
            except asyncio.CancelledError:  # drop() cancelled the call, or close() this task
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise
            except grpc.aio.AioRpcError as error:
                if error.code() != grpc.StatusCode.CANCELLED:
                    logger.info("KV events of %s lost: %s", address, error.code().name)
            finally:
                self._calls.pop(address, None)
            if resync:
                continue
            self.losses += 1
            self.index.forget(address)
            await asyncio.sleep(wait)
            wait = min(wait * 2, BACKOFF_S[1])

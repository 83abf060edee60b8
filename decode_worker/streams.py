"""The decode worker's streaming side: one queue per running request between the engine thread's step
outputs and the Decode stream that reads them. Every method runs on the event loop (the engine thread
hands its outputs over with loop.call_soon_threadsafe)."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterable
from typing import Any

from decode_worker.admission import DecodeUpdate, merge_outputs
from rpc.status import ServiceError

logger = logging.getLogger(__name__)


class EngineStepFailed(ServiceError):
    """Ends a Decode stream whose request the failed engine step aborted (INTERNAL, naming the error)."""


class TokenStreams:
    """request id -> the queue of its StepOutputs (or the ServiceError that ends its stream)."""

    def __init__(self) -> None:
        self._queues: dict[str, asyncio.Queue[Any]] = {}

    def open(self, request_id: str) -> None:
        self._queues[request_id] = asyncio.Queue()

    def close(self, request_id: str) -> None:
        """Forgets the request's queue (its outputs from now on are dropped)."""
        self._queues.pop(request_id, None)

    def dispatch(self, outputs: Iterable[Any]) -> None:
        """StepOutputs of one engine step, to the streams that are open."""
        for output in outputs:
            queue = self._queues.get(output.request_id)
            if queue is not None:
                queue.put_nowait(output)

    def fail(self, request_ids: Iterable[str], error: ServiceError) -> None:
        """Ends the named streams with `error` (raised to their readers after what they already hold)."""
        for request_id in request_ids:
            queue = self._queues.get(request_id)
            if queue is not None:
                queue.put_nowait(error)

    def fail_all(self, error: ServiceError) -> None:
        self.fail(list(self._queues), error)

    async def read(self, request_id: str) -> AsyncIterator[DecodeUpdate]:
        """The request's updates until one is finished; merges outputs that piled up while the reader was
        behind and drops the first token (prefill already returned it). Raises the error that ended it."""
        queue = self._queues[request_id]
        skip_first = True
        try:
            while True:
                items = [await queue.get()]
                while not queue.empty():  # the reader fell behind: merge what piled up
                    items.append(queue.get_nowait())
                for item in items:
                    if isinstance(item, ServiceError):
                        raise item
                update = merge_outputs(items, skip_first)
                skip_first = skip_first and not any(output.new_token_ids for output in items)
                if update.finished:  # logged before the last chunk leaves, so the line precedes the reply
                    logger.info("decode finished (%s)", update.finish_reason)
                yield update
                if update.finished:
                    return
        finally:
            self.close(request_id)

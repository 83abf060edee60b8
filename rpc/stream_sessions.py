"""What the workers' long-lived, multiplexed streams share on the server side (prefill_worker/prefill_stream.py,
decode_worker/decode_stream.py): a session per open stream, whose reader task starts one task per request
message; the registry of a servicer's open sessions, so that shutdown can drain them (each stops reading, lets
the requests it read finish and be answered, then ends); and when a stream ends or breaks, every request still
running on it is cancelled."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine
from typing import Generic, TypeVar

import grpc

from rpc.status import ServiceError

Message = TypeVar("Message")  # a request message of the stream
T = TypeVar("T")


class Cancelled(ServiceError):
    """A request cancelled inside the worker (e.g. Cancel RPC) while its stream lives on."""

    code = grpc.StatusCode.CANCELLED


class StreamSession(Generic[Message]):
    """One open stream. Subclasses start a request per message (receive, with start_task) and may add what
    follows the draining of the requests (drained: e.g. sending what is left)."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[object]] = set()
        self._reader: asyncio.Task[None] | None = None
        self._draining = False

    def receive(self, message: Message) -> None:
        raise NotImplementedError

    async def drained(self) -> None:
        """Runs once the requests read before a drain have finished."""

    def ended(self) -> None:
        """Runs when the stream is over (ended, broken or drained)."""

    def start_task(self, work: Coroutine[object, None, T]) -> asyncio.Task[T]:
        """A request's task, cancelled if the stream ends or breaks before it finishes."""
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def run(self, requests: AsyncIterator[Message]) -> None:
        self._reader = asyncio.ensure_future(self._read(requests))
        try:
            await self._reader
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if not self._draining or (current is not None and current.cancelling()):
                raise  # the stream broke (or the server's grace ran out)
            if self._tasks:  # draining: the requests already read finish
                await asyncio.wait(set(self._tasks))
            await self.drained()
        finally:
            for task in list(self._tasks):  # the stream ended or broke: cancel what still runs
                task.cancel()
            self.ended()

    def drain(self) -> None:
        self._draining = True
        if self._reader is not None:
            self._reader.cancel()

    async def _read(self, requests: AsyncIterator[Message]) -> None:
        async for message in requests:
            self.receive(message)


class StreamSessions:
    """The open streams of one servicer, so that shutdown can drain them."""

    def __init__(self) -> None:
        self._sessions: set[StreamSession[object]] = set()

    async def serve(self, session: StreamSession[Message], requests: AsyncIterator[Message],
                    context: grpc.aio.ServicerContext) -> None:
        """The body of a stream RPC: returns when the stream ends (cancelled when it breaks). Initial metadata
        goes out first: it tells the client the stream was accepted (gateway/worker_stream.py writes nothing
        before it, so a refused stream's status is never raced by a write)."""
        await context.send_initial_metadata(())
        self._sessions.add(session)
        try:
            await session.run(requests)
        finally:
            self._sessions.discard(session)

    def drain(self) -> None:
        """Every open stream stops reading; each ends once the requests it read have finished and been answered."""
        for session in list(self._sessions):
            session.drain()

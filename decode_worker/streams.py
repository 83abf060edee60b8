"""The engine's step outputs, turned into each request's updates as they are delivered.

Whoever runs the engine (the engine process, decode_worker/process_port.py; a test's engine thread) hands each
batch of step outputs to `deliver` on the event loop, which gives each claimed request's outputs to its
RequestStream: it merges them into an update (at once, or once stream_interval tokens are ready) and hands the
update to the request's sink there and then - no task is woken per request per step (a DecodeStream's sink
puts it in the stream's outbox). A failed step ends the running requests with EngineFailed; a request whose
caller leaves early is aborted in the engine."""
from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import AsyncIterator, Callable, Iterable

from decode_worker.admission import DecodeUpdate, EngineOutput, merge_outputs, merge_updates, new_tokens

logger = logging.getLogger(__name__)


class EngineFailed(Exception):
    """Ends a stream: the engine step failed, the engine process died or the worker is shutting down."""


# Where a request's updates go, on the event loop, as they are made.
Sink = Callable[[DecodeUpdate], None]


class RequestStream:
    """One claimed request: its outputs merged into updates for `sink` (the first step's first token, which
    prefill produced, dropped); `ended` resolves once the request finished, or fails with EngineFailed."""

    def __init__(self, interval: int, sink: Sink, skip_first: bool = True) -> None:
        self._interval = interval
        self._sink = sink
        self._context = contextvars.copy_context()  # the opener's: its log lines name the request
        self._items: list[EngineOutput] = []
        self._skip_first = skip_first  # False: the engine prefilled the prompt itself, its first token is news
        self.ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def put(self, output: EngineOutput) -> None:
        if self.ended.done():
            return
        items = self._items
        items.append(output)
        if not output.finished and new_tokens(items, self._skip_first) < self._interval:
            return
        update = merge_outputs(items, self._skip_first)
        self._skip_first = self._skip_first and not any(item.new_token_ids for item in items)
        self._items = []
        if update.finished:  # logged before the last update leaves, so the line precedes the reply
            self._context.run(logger.info, "decode finished (%s)", update.finish_reason)
        self._sink(update)
        if update.finished:
            self.ended.set_result(None)

    def fail(self, reason: str) -> None:
        if not self.ended.done():
            self.ended.set_exception(EngineFailed(reason))


class Streams:
    """Event loop only. abort_soon(request_id): asks the engine to abort a request whose caller left early."""

    def __init__(self, abort_soon: Callable[[str], None]) -> None:
        self._abort_soon = abort_soon
        self._streams: dict[str, RequestStream] = {}  # claimed requests

    def open(self, request_id: str, interval: int, sink: Sink, skip_first: bool = True) -> None:
        """A claimed request: its outputs go to sink from now on (and a failed step ends it). skip_first: its first
        token came from a prefill worker (False: a local prefill's first token is sent too)."""
        self._streams[request_id] = RequestStream(interval, sink, skip_first)

    def close(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def open_ids(self) -> list[str]:
        return list(self._streams)

    def deliver(self, outputs: Iterable[EngineOutput]) -> None:
        """Step outputs, in order."""
        streams = self._streams
        for output in outputs:
            stream = streams.get(output.request_id)
            if stream is not None:
                stream.put(output)

    def fail(self, request_ids: Iterable[str], reason: str) -> None:
        for request_id in request_ids:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.fail(reason)

    def fail_all(self, reason: str) -> None:
        self.fail(list(self._streams), reason)

    async def run(self, request_id: str) -> None:
        """Until the request finishes (raises EngineFailed if its engine failed). Leaving early (cancelled: the
        caller went away, was released or timed out) aborts it in the engine."""
        stream, done = self._streams[request_id], False
        try:
            await asyncio.shield(stream.ended)
            done = True
        except EngineFailed:
            done = True
            raise
        finally:
            self.close(request_id)
            if not done:  # stop generating, free the pages
                logger.info("decode stream of %s ended early; aborting it", request_id)
                self._abort_soon(request_id)


async def updates_of(run: Callable[[Sink], asyncio.Future[None] | asyncio.Task[None]]) -> AsyncIterator[DecodeUpdate]:
    """A request's updates as an async iterator (tests, benchmarks): run(sink) starts the request (a task that
    ends with it); updates that pile up while the caller is busy are merged. Leaving early cancels the task."""
    pending: list[DecodeUpdate] = []
    wake: asyncio.Event = asyncio.Event()

    def sink(update: DecodeUpdate) -> None:
        pending.append(update)
        wake.set()

    task = run(sink)
    task.add_done_callback(lambda _: wake.set())
    try:
        while True:
            if pending:
                taken, pending[:] = list(pending), []
                update = merge_updates(taken)
                yield update
                if update.finished:
                    break
                continue
            if task.done():
                task.result()  # raises what the request failed with
                return
            wake.clear()
            await wake.wait()
        await task
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

"""The engine thread's step loop and the per-request mailboxes it feeds.

The engine thread steps while there is work and queues each step's outputs in an outbox; the event loop
is woken once per batch of steps (not per output) and sorts the outputs into the mailboxes of the
requests being streamed. A stream merges whatever piled up in its mailbox into one update (or waits for
stream_interval tokens). A failed step ends the running streams with an error; a stream whose reader
leaves early aborts its request in the engine."""
from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from decode_worker.admission import DecodeUpdate, merge_outputs, new_tokens
from rpc.engine_thread import EngineThread

logger = logging.getLogger(__name__)


class EngineFailed(Exception):
    """Ends a stream: the engine step failed or the worker is shutting down."""


class _Mailbox:
    """What the engine produced for one stream and its reader has not taken yet: a list and at most one
    waiting reader (lighter than an asyncio.Queue: one wake-up per engine step, whatever piled up)."""

    def __init__(self) -> None:
        self._items: list[Any] = []
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: Any) -> None:
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def take(self) -> list[Any]:
        """Everything queued so far (waits for at least one item)."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        return items


class Streams:
    """engine_thread: the thread stepping the engine (its work function is `work`); publish(engine) runs
    on that thread after every work call (load figures)."""

    def __init__(self, engine_thread: EngineThread[Any], publish: Callable[[Any], None]) -> None:
        self._engine_thread = engine_thread
        self._publish = publish
        self._mailboxes: dict[str, _Mailbox] = {}  # claimed requests (event loop; the engine thread copies keys)
        self._outbox: list[Any] = []  # step outputs the event loop has not dispatched yet
        self._outbox_lock = threading.Lock()
        self._dispatch_scheduled = False  # under _outbox_lock: a _dispatch is queued on the loop
        self._loop: asyncio.AbstractEventLoop | None = None
        self.force_step = False  # engine thread only: step once even without work (emits finished requests)
        self.engine_steps = 0  # engine steps that produced output, and the tokens they produced (batch occupancy)
        self.engine_step_tokens = 0

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def open(self, request_id: str) -> None:
        """A claimed request: its outputs are kept from now on (and a failed step ends its stream)."""
        self._mailboxes[request_id] = _Mailbox()

    def close(self, request_id: str) -> None:
        self._mailboxes.pop(request_id, None)

    def fail_all(self, reason: str) -> None:
        for mailbox in list(self._mailboxes.values()):
            mailbox.put(EngineFailed(reason))

    # --- engine thread ------------------------------------------------------------------------------
    def work(self, engine: Any) -> bool:
        if self.force_step or engine.has_work():
            self.force_step = False
            try:
                outputs = engine.step()
            except Exception as error:  # noqa: BLE001 - fail the streams, keep serving
                logger.exception("engine step failed; aborting running requests")
                self._abort_all(engine, error)
                outputs = []
            if outputs:
                self.engine_steps += 1
                self.engine_step_tokens += sum(len(output.new_token_ids) for output in outputs)
                self._hand_over(outputs)
        self._publish(engine)
        return engine.has_work()

    def abort(self, engine: Any, request_id: str) -> None:
        if engine.abort(request_id):
            self.force_step = True

    def _hand_over(self, outputs: list[Any]) -> None:
        """Queues a step's outputs for the event loop, waking it only when no dispatch is pending yet
        (a loop that fell behind takes several steps' outputs in one wake-up)."""
        with self._outbox_lock:
            self._outbox += outputs
            wake, self._dispatch_scheduled = not self._dispatch_scheduled, True
        if wake:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._dispatch)

    def _abort_all(self, engine: Any, error: Exception) -> None:
        failed = list(self._mailboxes)
        for request_id in failed:
            try:
                engine.abort(request_id)
            except Exception:  # noqa: BLE001
                logger.exception("abort of %s failed", request_id)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._fail_streams, failed, error)

    # --- event loop ---------------------------------------------------------------------------------
    def _dispatch(self) -> None:
        with self._outbox_lock:
            outputs, self._outbox, self._dispatch_scheduled = self._outbox, [], False
        mailboxes = self._mailboxes
        for output in outputs:
            mailbox = mailboxes.get(output.request_id)
            if mailbox is not None:
                mailbox.put(output)

    def _fail_streams(self, request_ids: list[str], error: Exception) -> None:
        self._dispatch()  # outputs of earlier steps go first
        for request_id in request_ids:
            mailbox = self._mailboxes.get(request_id)
            if mailbox is not None:
                mailbox.put(EngineFailed(f"engine step failed: {error}"))

    async def stream(self, request_id: str, interval: int) -> AsyncIterator[DecodeUpdate]:
        """The request's updates until it finishes. Leaving early (cancel, release) aborts it in the engine."""
        mailbox = self._mailboxes[request_id]
        skip_first, done = True, False
        items: list[Any] = []
        try:
            while True:
                taken = await mailbox.take()  # the reader may have fallen behind: merge what piled up
                for item in taken:
                    if isinstance(item, EngineFailed):
                        done = True
                        raise item
                items += taken
                if not items[-1].finished and new_tokens(items, skip_first) < interval:
                    continue
                update = merge_outputs(items, skip_first)
                skip_first = skip_first and not any(output.new_token_ids for output in items)
                items = []
                done = update.finished
                if update.finished:  # logged before the last chunk leaves, so the line precedes the reply
                    logger.info("decode finished (%s)", update.finish_reason)
                yield update
                if update.finished:
                    return
        finally:
            self.close(request_id)
            if not done:  # the caller went away (cancel / release): stop generating, free the pages
                logger.info("decode stream of %s ended early; aborting it", request_id)
                self._engine_thread.post(lambda engine: self.abort(engine, request_id))

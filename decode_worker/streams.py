"""The per-request mailboxes the engine's step outputs are sorted into, and the streams that read them.

Whoever runs the engine (an engine thread in this process, decode_worker/engine_port.py, or an engine
process, decode_worker/process_port.py) hands each batch of step outputs to `deliver` on the event loop,
which sorts them into the mailboxes of the requests being streamed. A stream merges whatever piled up in
its mailbox into one update (or waits for stream_interval tokens). A failed step ends the running streams
with an error; a stream whose reader leaves early asks for its request to be aborted in the engine."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from decode_worker.admission import DecodeUpdate, EngineOutput, merge_outputs, new_tokens

logger = logging.getLogger(__name__)


class EngineFailed(Exception):
    """Ends a stream: the engine step failed, the engine process died or the worker is shutting down."""


class _Mailbox:
    """What the engine produced for one stream and its reader has not taken yet: a list and at most one
    waiting reader (lighter than an asyncio.Queue: one wake-up per engine step, whatever piled up)."""

    def __init__(self) -> None:
        self._items: list[EngineOutput | EngineFailed] = []
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: EngineOutput | EngineFailed) -> None:
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def take(self) -> list[EngineOutput | EngineFailed]:
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
    """Event loop only. abort_soon(request_id): asks the engine to abort a request whose reader left early."""

    def __init__(self, abort_soon: Callable[[str], None]) -> None:
        self._abort_soon = abort_soon
        self._mailboxes: dict[str, _Mailbox] = {}  # claimed requests

    def open(self, request_id: str) -> None:
        """A claimed request: its outputs are kept from now on (and a failed step ends its stream)."""
        self._mailboxes[request_id] = _Mailbox()

    def close(self, request_id: str) -> None:
        self._mailboxes.pop(request_id, None)

    def open_ids(self) -> list[str]:
        return list(self._mailboxes)

    def deliver(self, outputs: Iterable[EngineOutput]) -> None:
        """Step outputs, in order."""
        mailboxes = self._mailboxes
        for output in outputs:
            mailbox = mailboxes.get(output.request_id)
            if mailbox is not None:
                mailbox.put(output)

    def fail(self, request_ids: Iterable[str], reason: str) -> None:
        for request_id in request_ids:
            mailbox = self._mailboxes.get(request_id)
            if mailbox is not None:
                mailbox.put(EngineFailed(reason))

    def fail_all(self, reason: str) -> None:
        self.fail(list(self._mailboxes), reason)

    async def stream(self, request_id: str, interval: int) -> AsyncIterator[DecodeUpdate]:
        """The request's updates until it finishes. Leaving early (cancel, release) aborts it in the engine."""
        mailbox = self._mailboxes[request_id]
        skip_first, done = True, False
        items: list[EngineOutput] = []
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
                self._abort_soon(request_id)

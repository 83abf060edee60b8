"""The multi-turn chat workload's driver: every conversation runs its turns in order (each turn's prompt is the
history plus a new message, the history grown by the model's actual answer; think time between turns), all
conversations at once, at most max_concurrency requests in flight (a conversation thinking holds no place)."""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from bench.load import LoadResult, SendFn
from bench.prefix_workloads import ConversationScript
from bench.record import RequestRecord


async def run_conversations(script: ConversationScript, send: SendFn, max_concurrency: int | None,
                            ignore_eos: bool, on_done: Callable[[RequestRecord], None] | None = None) -> LoadResult:
    """Records in (conversation, turn) order, start_s relative to the run's start. A failed turn ends its
    conversation (its later turns are not sent: there is no answer to build them on)."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    shape = script.shape
    start = time.perf_counter()

    async def conversation(index: int) -> list[RequestRecord]:
        history: tuple[int, ...] = ()
        records = []
        for turn in range(1, shape.turns + 1):
            if turn > 1 and shape.think_time_s > 0:
                await asyncio.sleep(shape.think_time_s)  # the user reading the answer and typing (workload, not sync)
            request = script.turn(index, turn, history, ignore_eos)
            async with limit:
                sent = time.perf_counter() - start
                record = await send(request)
            record.start_s = sent
            records.append(record)
            if on_done is not None:
                on_done(record)
            if not record.success:
                break
            history = request.token_ids + tuple(record.output_token_ids)
        return records

    results = await asyncio.gather(*(conversation(index) for index in range(shape.conversations)))
    return LoadResult([record for records in results for record in records], time.perf_counter() - start)

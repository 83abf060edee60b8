"""gateway.servicer.coalesce: tokens that piled up behind a slow stream leave as one message, in order."""
from __future__ import annotations

import asyncio

import grpc

from gateway.orchestrator import ErrorEvent, FinishEvent, TokensEvent
from gateway.servicer import coalesce
from rpc.status import Unavailable, status_of


def queue_of(*events) -> asyncio.Queue:
    queue: asyncio.Queue = asyncio.Queue()
    for event in events:
        queue.put_nowait(event)
    return queue


def test_queued_tokens_merge_in_order_and_the_final_event_is_handed_back():
    """Three queued TokensEvents become one (ids, text and logprobs concatenated in order); the FinishEvent
    queued after them is returned, not lost, and the queue is left empty."""
    finish = FinishEvent("length", prompt_tokens=3, completion_tokens=5, ttft_ms=1.0, decode_steps=4, decode_tokens=4)
    queue = queue_of(TokensEvent([2, 3], "b", ["lp2", "lp3"]), TokensEvent([4], "c", ["lp4"]), finish)
    merged, held = coalesce(TokensEvent([1], "a", ["lp1"]), queue)
    assert (merged.token_ids, merged.text, merged.logprobs) == ([1, 2, 3, 4], "abc", ["lp1", "lp2", "lp3", "lp4"])
    assert held is finish and queue.empty()


def test_nothing_queued_returns_the_event_itself():
    """A stream that keeps up sends every event as it comes: the same object back, nothing held."""
    event = TokensEvent([7], "x")
    assert coalesce(event, queue_of()) == (event, None)


def test_an_error_after_tokens_is_handed_back_after_them():
    """Tokens queued before an ErrorEvent still go out (merged), then the error."""
    error = ErrorEvent(status_of(Unavailable("decode worker lost")))
    merged, held = coalesce(TokensEvent([1], "a"), queue_of(TokensEvent([2], "b"), error))
    assert merged.token_ids == [1, 2] and held is error
    assert held.status.code == grpc.StatusCode.UNAVAILABLE

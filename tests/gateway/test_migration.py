"""Request migration in the gateway's run (gateway/orchestrator.py + gateway/migration.py) over fake workers: a
decode stream that fails UNAVAILABLE after some tokens is re-admitted (Reserve, Prefill of prompt + every token
streamed, Decode of the rest) and the client sees each token once, in order; the limit and a pool with no decode
worker left end the request UNAVAILABLE; another failure code is not migrated."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from engine.sampling_params import SamplingParams
from gateway.migration import MigrationConfig, Migrations
from gateway.orchestrator import ErrorEvent, FinishEvent, RequestRun, TokensEvent
from gateway.requests import GenerateJob
from gateway.router import DecodeLoad, PrefillLoad
from gateway.worker_clients import PrefillWorker, WorkerClient
from gateway.worker_stream import rpc_error
from gateway.kv_index import Overlap
from rpc.internal.v1 import kv_pb2, worker_pb2
from rpc.status import Unavailable

PROMPT = (5, 6, 7)


class _Call:
    """A request's DecodeCall on a DecodeStream: its chunks, then (optionally) an error."""

    def __init__(self, tokens: list[int], error: BaseException | None) -> None:
        self._tokens, self._error = tokens, error

    async def _iterate(self) -> AsyncIterator[worker_pb2.DecodeStreamUpdate]:
        if self._tokens:
            yield worker_pb2.DecodeStreamUpdate(token_ids=self._tokens, decode_steps=len(self._tokens),
                                                finished=self._error is None, finish_reason="length")
        if self._error is not None:
            raise self._error

    def __aiter__(self) -> AsyncIterator[worker_pb2.DecodeStreamUpdate]:
        return self._iterate()

    def cancel(self) -> None:
        pass


class _Pool:
    """Decode legs scripted as (tokens, error); prefill answers 42 for the prompt, 100 + len(tokens) after."""

    def __init__(self, legs: list[tuple[list[int], BaseException | None]], limit: int = 3,
                 decode_workers: int = 2) -> None:
        self.legs = legs
        self.metadata: tuple[tuple[str, str], ...] = ()
        self.polled = asyncio.Event()
        self.polled.set()
        self.migrations = Migrations(MigrationConfig(limit))
        self.prefilled: list[list[int]] = []
        self.reserved: list[tuple[str, int, int]] = []
        self.unreachable: list[str] = []
        self.decode_workers = decode_workers
        self.decoded: list[worker_pb2.DecodeRequest] = []
        self.prefill_worker = WorkerClient(PrefillLoad("prefill"), channel=None, stub=self,  # type: ignore[arg-type]
                                           stream=SimpleNamespace(submit=self._prefill))

    def take_standing(self, num_prompt_tokens: int, prompt: Any = None) -> None:
        return None

    def refill_standing(self) -> None:
        pass

    async def reserve(self, request_id: str, num_tokens: int, max_new_tokens: int, deadline: Any,
                      trace_id: str | None = None, prompt: Any = None) -> tuple[Any, kv_pb2.KVDestination]:
        if len(self.reserved) >= self.decode_workers:
            raise Unavailable("no reachable decode worker")
        self.reserved.append((request_id, num_tokens, max_new_tokens))
        worker = SimpleNamespace(load=DecodeLoad(f"decode-{len(self.reserved)}"), stub=self,
                                 stream=SimpleNamespace(submit=self._decode))
        return worker, kv_pb2.KVDestination(request_id=request_id, lease_id="lease",
                                            lease_deadline_unix_ms=int(time.time() * 1000) + 60_000)

    def overlap(self, address: str, prompt: Any) -> Overlap:
        return Overlap()  # (no KV index here)

    def pick_prefill(self, prompt: Any = None) -> PrefillWorker:
        return self.prefill_worker

    def mark_unreachable(self, state: Any, error: Any) -> None:
        self.unreachable.append(state.address)

    async def release_quietly(self, worker: Any, request_id: str, trace_id: str) -> None:
        pass

    def _prefill(self, request: worker_pb2.PrefillRequest, timeout: Any, trace_id: str = "") -> asyncio.Future[Any]:
        self.prefilled.append(list(request.token_ids))
        first = 42 if len(request.token_ids) == len(PROMPT) else 100 + len(request.token_ids)
        answer = asyncio.get_running_loop().create_future()
        answer.set_result(worker_pb2.PrefillResponse(first_token=first))
        return answer

    async def Release(self, request: worker_pb2.ReleaseRequest, **_: Any) -> worker_pb2.ReleaseResponse:  # noqa: N802
        return worker_pb2.ReleaseResponse(found=True)

    def _decode(self, request: worker_pb2.DecodeRequest, timeout: Any, trace_id: str = "") -> _Call:
        self.decoded.append(request)
        return _Call(*self.legs.pop(0))


async def _run(pool: _Pool, max_new: int = 8, threshold: int = 0) -> tuple[list[int], FinishEvent | ErrorEvent]:
    job = GenerateJob(request_id="r", prompt_ids=PROMPT,
                      params=SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True))
    run = RequestRun(job, pool, None, time.perf_counter(), None, cleanup_timeout_s=5.0,  # type: ignore[arg-type]
                     disagg_threshold_tokens=threshold)
    run.start()
    tokens: list[int] = []
    while True:
        event = await asyncio.wait_for(run.events.get(), 30)
        if isinstance(event, TokensEvent):
            tokens.extend(event.token_ids)
        else:
            await run.task
            return tokens, event


LOST = rpc_error(grpc.StatusCode.UNAVAILABLE, "decode stream to decode-1 broke")


async def test_a_lost_stream_continues_elsewhere_with_every_token_once():
    """Leg 1 streams 7, 8 after the first token 42, then fails; the run reserves again for prompt + 3 streamed
    tokens with 5 left, prefills [5, 6, 7, 42, 7, 8] (its token 106 is the stream's next), decodes the rest."""
    pool = _Pool([([7, 8], LOST), ([1, 2, 3, 4], None)])
    tokens, end = await _run(pool)
    assert tokens == [42, 7, 8, 106, 1, 2, 3, 4] and isinstance(end, FinishEvent) and end.reason == "length"
    assert pool.prefilled == [list(PROMPT), [*PROMPT, 42, 7, 8]]
    assert [(n, left) for _, n, left in pool.reserved] == [(3, 8), (6, 5)]
    assert pool.migrations.count == 1 and pool.unreachable == ["decode-1"]


@pytest.mark.parametrize("limit, workers", [(0, 2), (3, 1)])
async def test_no_migration_left_or_no_worker_left_ends_unavailable(limit, workers):
    pool = _Pool([([7], LOST), ([1], None)], limit=limit, decode_workers=workers)
    tokens, end = await _run(pool)
    assert tokens == [42, 7] and isinstance(end, ErrorEvent) and end.status.code == grpc.StatusCode.UNAVAILABLE


async def test_other_failures_are_not_migrated():
    pool = _Pool([([7], rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "bad")), ([1], None)])
    tokens, end = await _run(pool)
    assert isinstance(end, ErrorEvent) and end.status.code == grpc.StatusCode.INVALID_ARGUMENT
    assert pool.migrations.count == 0 and len(pool.reserved) == 1


@pytest.mark.parametrize("streamed", [[42, 7], []])
async def test_a_local_prefill_whose_worker_dies_migrates_like_a_decode(streamed):
    """Under the disagg threshold the first leg is a local prefill (no Prefill call, prefill_locally set, its first
    token from the stream); when its stream breaks, after some tokens or before any, the run migrates as any decode
    does: Reserve elsewhere, Prefill of prompt + streamed tokens through a prefill worker, Decode of the rest."""
    pool = _Pool([(streamed, LOST), ([1, 2, 3, 4, 5, 6, 7][: 8 - len(streamed) - 1], None)])
    tokens, end = await _run(pool, threshold=10)
    first = 42 if not streamed else 100 + len(PROMPT) + len(streamed)
    assert tokens == [*streamed, first, *[1, 2, 3, 4, 5, 6, 7][: 8 - len(streamed) - 1]]
    assert isinstance(end, FinishEvent) and end.completion_tokens == 8
    assert pool.prefilled == [[*PROMPT, *streamed]]  # the first leg never reached a prefill worker
    assert [request.prefill_locally for request in pool.decoded] == [True, False]
    assert pool.migrations.count == 1 and pool.unreachable == ["decode-1"]

"""The gateway's time-to-first-token path over fake workers: the first token reaches the client-facing
consumer before the Decode call is even set up, and Decode carries the request's stream_interval."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from engine.sampling_params import SamplingParams
from gateway.orchestrator import FinishEvent, RequestRun, TokensEvent
from gateway.requests import GenerateJob
from gateway.router import DecodeLoad, PrefillLoad
from gateway.worker_clients import PrefillWorker, WorkerClient
from gateway.kv_index import Overlap
from rpc.internal.v1 import kv_pb2, worker_pb2

FIRST = 42


class _DecodeStream:
    def __init__(self, responses: list[worker_pb2.DecodeStreamUpdate]) -> None:
        self._responses = responses

    async def _iterate(self) -> AsyncIterator[worker_pb2.DecodeStreamUpdate]:
        for response in self._responses:
            yield response

    def __aiter__(self) -> AsyncIterator[worker_pb2.DecodeStreamUpdate]:
        return self._iterate()

    def cancel(self) -> None:
        pass


class _Workers:
    """A WorkerPool stand-in: one decode and one prefill worker whose calls append to `order`."""

    def __init__(self, order: list[Any]) -> None:
        self.order = order
        self.load = DecodeLoad("decode")  # (this pool is its own decode worker)
        self.metadata: tuple[tuple[str, str], ...] = ()
        self.polled = asyncio.Event()
        self.polled.set()
        self.prefill_worker = WorkerClient(PrefillLoad("prefill"), channel=None, stub=self, stream=self)  # type: ignore[arg-type]
        self.decode_requests: list[worker_pb2.DecodeRequest] = []
        self.prefill_requests: list[worker_pb2.PrefillRequest] = []
        self.reserved: list[str] = []
        self.spare: kv_pb2.KVDestination | None = None  # a standing lease take_standing hands out once

    def take_standing(self, num_prompt_tokens: int, prompt: Any = None) -> tuple[Any, kv_pb2.KVDestination] | None:
        spare, self.spare = self.spare, None
        return None if spare is None else (self, spare)

    def refill_standing(self) -> None:
        self.order.append("refill")

    async def reserve(self, request_id: str, num_tokens: int, max_new_tokens: int, deadline: Any,
                      trace_id: str | None = None, prompt: Any = None) -> tuple[Any, kv_pb2.KVDestination]:
        self.reserved.append(request_id)
        destination = kv_pb2.KVDestination(request_id=request_id, lease_id="lease",
                                           lease_deadline_unix_ms=int(time.time() * 1000) + 60_000)
        return self, destination

    def overlap(self, address: str, prompt: Any) -> Overlap:
        return Overlap()  # (no KV index here)

    def pick_prefill(self, prompt: Any = None) -> PrefillWorker:
        return self.prefill_worker

    @property
    def stub(self) -> _Workers:
        return self

    @property
    def stream(self) -> _Workers:  # (both workers' streams)
        return self

    def submit(self, request: worker_pb2.PrefillRequest | worker_pb2.DecodeRequest, timeout: float | None,
               trace_id: str = "") -> asyncio.Future[worker_pb2.PrefillResponse] | _DecodeStream:
        if isinstance(request, worker_pb2.DecodeRequest):
            return self.decode(request)
        self.order.append("prefill")
        self.prefill_requests.append(request)
        answer: asyncio.Future[worker_pb2.PrefillResponse] = asyncio.get_running_loop().create_future()
        answer.set_result(worker_pb2.PrefillResponse(first_token=FIRST))
        return answer

    async def Release(self, request: worker_pb2.ReleaseRequest, **_: Any) -> worker_pb2.ReleaseResponse:  # noqa: N802
        self.order.append("release")
        return worker_pb2.ReleaseResponse(found=True)

    def decode(self, request: worker_pb2.DecodeRequest) -> _DecodeStream:
        self.order.append("decode call")
        self.decode_requests.append(request)
        return _DecodeStream([worker_pb2.DecodeStreamUpdate(token_ids=[7, 8, 9], finished=True, finish_reason="length",
                                                            decode_steps=3)])


async def test_first_token_is_forwarded_before_decode_is_called():
    """The client-facing consumer takes the first token (from Prefill) before the Decode RPC is made,
    so setting up Decode never delays TTFT; the stream then finishes with every token in order."""
    order: list[Any] = []
    workers = _Workers(order)
    job = GenerateJob(request_id="r1", prompt_ids=(5, 6, 7),
                      params=SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True), stream_interval=3)
    run = RequestRun(job, workers, None, time.perf_counter(), None, cleanup_timeout_s=5.0)  # type: ignore[arg-type]
    tokens: list[int] = []

    waiting = asyncio.Event()

    async def consume() -> FinishEvent:  # as the servicer does: await the queue directly
        while True:
            waiting.set()
            event = await run.events.get()
            if isinstance(event, FinishEvent):
                return event
            assert isinstance(event, TokensEvent), event
            order.append(("tokens", list(event.token_ids)))
            tokens.extend(event.token_ids)

    consumer = asyncio.create_task(consume())
    await waiting.wait()  # the consumer waits on the queue before the run starts, as a servicer does
    run.start()
    event = await asyncio.wait_for(consumer, 30)
    assert order[:3] == ["prefill", ("tokens", [FIRST]), "decode call"], order
    assert tokens == [FIRST, 7, 8, 9] and event.reason == "length"
    assert workers.decode_requests[0].stream_interval == 3
    assert run.task is not None
    await asyncio.wait_for(run.task, 30)


class _Phases:
    """A RunObserver that records which phase it heard of, in order, with its duration."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, float]] = []

    def admitted(self, queue_s: float, prompt_tokens: int, spare: bool = False) -> None:
        self.seen.append(("admitted", queue_s))

    def prefilled(self, prefill_s: float) -> None:
        self.seen.append(("prefilled", prefill_s))

    def decode_started(self, setup_s: float) -> None:
        self.seen.append(("decode_started", setup_s))

    def first_token(self, ttft_s: float) -> None:
        self.seen.append(("first_token", ttft_s))

    def tokens(self, count: int, gap_s: float | None) -> None:
        pass

    def finished(self, e2e_s: float, decode_steps: int, decode_tokens: int) -> None:
        self.seen.append(("finished", e2e_s))

    def cache_routed(self, role: str, expected: int, actual: int | None) -> None:
        pass  # (not a phase)


def _observed_run(request_id: str, max_tokens: int = 4) -> tuple[RequestRun, _Phases]:
    """A run over fake workers (greedy, ignore_eos) whose observer records its phases."""
    phases = _Phases()
    job = GenerateJob(request_id=request_id, prompt_ids=(5, 6, 7),
                      params=SamplingParams(max_new_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    run = RequestRun(job, _Workers([]), None, time.perf_counter(), None, cleanup_timeout_s=5.0,  # type: ignore[arg-type]
                     observer=phases)
    return run, phases


async def test_observer_hears_each_phase_once_in_path_order():
    """A run reports admission, prefill, first token, decode set-up and finish once each, in that order, with
    durations that are non-negative and add up: queue + prefill <= TTFT <= end to end."""
    run, phases = _observed_run("r2")
    run.start()
    assert run.task is not None
    await asyncio.wait_for(run.task, 30)
    assert [name for name, _ in phases.seen] == ["admitted", "prefilled", "first_token", "decode_started", "finished"]
    took = dict(phases.seen)
    assert all(value >= 0 for value in took.values())
    assert took["admitted"] + took["prefilled"] <= took["first_token"] <= took["finished"]


async def test_a_run_on_a_standing_lease_skips_reserve_and_runs_under_its_id():
    """A run that takes a standing lease sends no Reserve; Prefill (with the spare's destination) and Decode
    (with its lease) name the spare's request id, which the workers know the lease by; the refill is asked
    for once the first token is out, before Decode; tokens are unchanged."""
    order: list[Any] = []
    workers = _Workers(order)
    workers.spare = kv_pb2.KVDestination(request_id="standing.abc", lease_id="spare-lease", page_ids=[3],
                                         lease_deadline_unix_ms=int(time.time() * 1000) + 60_000)
    job = GenerateJob(request_id="r3", prompt_ids=(5, 6, 7),
                      params=SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
    run = RequestRun(job, workers, None, time.perf_counter(), None, cleanup_timeout_s=5.0)  # type: ignore[arg-type]
    run.start()
    assert run.task is not None
    await asyncio.wait_for(run.task, 30)
    assert workers.reserved == [] and run.request_id == "standing.abc"
    prefill, decode = workers.prefill_requests[0], workers.decode_requests[0]
    assert prefill.request_id == prefill.destination.request_id == decode.request_id == "standing.abc"
    assert decode.lease_id == "spare-lease"
    assert order[:3] == ["prefill", "refill", "decode call"]  # refilled after the first token, not during prefill
    events = [run.events.get_nowait() for _ in range(run.events.qsize())]
    assert [t for event in events if isinstance(event, TokensEvent) for t in event.token_ids] == [FIRST, 7, 8, 9]


async def test_metrics_wait_until_the_first_token_is_handed_on():
    """Nothing is recorded before the servicer has the first token (the metrics' work is off its path):
    when the consumer takes it the observer has heard nothing; afterwards every phase is there, once, in
    path order, with the durations measured when they happened (queue + prefill <= TTFT)."""
    run, phases = _observed_run("r4")

    waiting = asyncio.Event()

    async def first_event() -> tuple[Any, list[tuple[str, float]]]:  # as the servicer: awaits the queue itself
        waiting.set()
        return await run.events.get(), list(phases.seen)

    consumer = asyncio.create_task(first_event())
    await waiting.wait()  # (set just before it awaits the queue: it waits there now)
    run.start()
    first, seen_then = await asyncio.wait_for(consumer, 30)
    assert isinstance(first, TokensEvent) and first.token_ids == [FIRST]
    assert seen_then == []
    assert run.task is not None
    await asyncio.wait_for(run.task, 30)
    assert [name for name, _ in phases.seen] == ["admitted", "prefilled", "first_token", "decode_started", "finished"]
    took = dict(phases.seen)
    assert took["admitted"] + took["prefilled"] <= took["first_token"] <= took["finished"]


async def test_a_run_that_ends_at_its_first_token_still_reports_every_phase():
    """max_tokens 1: the run finishes without the first-token pass; the held metrics come out before the
    finish, in order."""
    run, phases = _observed_run("r5", max_tokens=1)
    run.start()
    assert run.task is not None
    await asyncio.wait_for(run.task, 30)
    assert [name for name, _ in phases.seen] == ["admitted", "prefilled", "first_token", "finished"]

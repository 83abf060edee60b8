"""The n > 1 gate (gateway/http_choices.py): choices 1..n-1 start only when choice 0 decodes (its first decode update), so
their prefill finds the prompt in the prefix cache instead of computing it beside choice 0."""
from __future__ import annotations

import asyncio
import time
from typing import Any

from engine.sampling_params import SamplingParams
from gateway.orchestrator import FinishEvent, RequestRun
from gateway.requests import GenerateJob
from rpc.internal.v1 import worker_pb2
from tests.gateway.test_first_token_path import FIRST, _Workers


class _HeldPrefill(_Workers):
    """Fake workers whose first Prefill answers only when `release` is set."""

    def __init__(self, order: list[Any]) -> None:
        super().__init__(order)
        self.release = asyncio.Event()

    def submit(self, request: Any, timeout: float | None, trace_id: str = "") -> Any:
        if isinstance(request, worker_pb2.DecodeRequest) or len(self.prefill_requests) > 0:
            return super().submit(request, timeout, trace_id)
        self.order.append("prefill")
        self.prefill_requests.append(request)
        answer: asyncio.Future[worker_pb2.PrefillResponse] = asyncio.get_running_loop().create_future()

        async def answer_later() -> None:
            await self.release.wait()
            answer.set_result(worker_pb2.PrefillResponse(first_token=FIRST))

        asyncio.ensure_future(answer_later())
        return answer

    async def Cancel(self, request: worker_pb2.CancelRequest, **_: Any) -> worker_pb2.CancelResponse:  # noqa: N802
        self.order.append("cancel")
        return worker_pb2.CancelResponse()


def _run(workers: _Workers, request_id: str, after: asyncio.Event | None) -> RequestRun:
    job = GenerateJob(request_id=request_id, prompt_ids=tuple(range(5, 45)),
                      params=SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
    return RequestRun(job, workers, None, time.perf_counter(), None, cleanup_timeout_s=5.0,  # type: ignore[arg-type]
                      after=after)


async def _spin(times: int = 50) -> None:
    """Lets every ready task run (loop iterations, not wall time)."""
    for _ in range(times):
        await asyncio.sleep(0)


async def _gated_pair() -> tuple[_HeldPrefill, RequestRun, RequestRun]:
    """Choice 0 and choice 1 gated on it, both started, with choice 0's prefill held."""
    workers = _HeldPrefill([])
    first = _run(workers, "c0", None)
    second = _run(workers, "c1", first.decoding)
    first.start()
    second.start()
    await _spin()
    return workers, first, second


async def _finish(run: RequestRun) -> FinishEvent:
    assert run.task is not None
    await asyncio.wait_for(run.task, 30)
    events = [run.events.get_nowait() for _ in range(run.events.qsize())]
    assert isinstance(events[-1], FinishEvent)
    return events[-1]


async def test_a_gated_choice_waits_for_the_first_token_of_choice_0():
    """While choice 0's prefill is held, choice 1 reserves nothing; once choice 0 decodes it runs to the end."""
    workers, first, second = await _gated_pair()
    assert [r.split(".")[0] for r in workers.reserved] == ["c0"] and len(workers.prefill_requests) == 1
    workers.release.set()
    assert (await _finish(first)).reason == "length" and (await _finish(second)).reason == "length"
    assert [r.split(".")[0] for r in workers.reserved] == ["c0", "c1"]


async def test_an_ungated_choice_starts_at_once():
    """Negative control: without the gate, choice 1 reserves and prefills beside choice 0's held prefill."""
    workers = _HeldPrefill([])
    first, second = _run(workers, "c0", None), _run(workers, "c1", None)
    first.start()
    second.start()
    await _spin()
    assert sorted(r.split(".")[0] for r in workers.reserved) == ["c0", "c1"]
    workers.release.set()
    await _finish(first)
    await _finish(second)


async def test_a_failed_choice_0_still_releases_the_others():
    """Choice 0 cancelled before it decodes: the gate opens, choice 1 runs (and ends by itself)."""
    _, first, second = await _gated_pair()
    first.cancel()
    assert (await _finish(first)).reason == "abort"
    assert (await _finish(second)).reason == "length"

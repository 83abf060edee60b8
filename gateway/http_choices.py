"""The runs behind one OpenAI request with n choices: each choice is its own GatewayService run, read by the HTTP
handler as one sequence of (choice index, event).

The prompt is computed and held once: choices 1..n-1 start when choice 0 decodes (its first decode update, or its
end), so their prefill finds the prompt's full pages in the prefill worker's prefix cache and computes only the
last partial page, and their Reserve on choice 0's decode worker (where cache-aware routing sends them) maps the
pages choice 0 holds there: the choices decode on shared prompt pages, each writing only its own. The cost: their
first token comes a decode step and a short prefill after choice 0's."""
from __future__ import annotations

import asyncio

from gateway.orchestrator import ErrorEvent, FinishEvent, RequestRun, TokensEvent
from gateway.service import GatewayService
from rpc.v1 import gateway_pb2


class Choices:
    """The runs of one request's n choices, read as one sequence of (choice index, event); one run is read
    straight from its queue."""

    def __init__(self, runs: list[RequestRun]) -> None:
        self.runs = runs
        self._merged: asyncio.Queue[tuple[int, TokensEvent | FinishEvent | ErrorEvent]] = asyncio.Queue()
        self._pumps = [asyncio.get_running_loop().create_task(self._pump(index, run))
                       for index, run in enumerate(runs)] if len(runs) > 1 else []

    @classmethod
    async def submit(cls, service: GatewayService, requests: list[gateway_pb2.GenerateRequest], arrival: float) -> Choices:
        """Submits every choice's request (all validated now; 1..n-1 gated on choice 0's decoding); if one is
        refused, the ones already started are cancelled."""
        runs: list[RequestRun] = []
        try:
            for message in requests:
                runs.append(await service.submit(message, False, arrival, None, runs[0].decoding if runs else None))
        except BaseException:
            for run in runs:
                run.cancel()
            raise
        return cls(runs)

    async def _pump(self, index: int, run: RequestRun) -> None:
        while True:
            event = await run.events.get()
            self._merged.put_nowait((index, event))
            if not isinstance(event, TokensEvent):
                return

    async def get(self) -> tuple[int, TokensEvent | FinishEvent | ErrorEvent]:
        if not self._pumps:
            return 0, await self.runs[0].events.get()
        return await self._merged.get()

    def get_nowait(self) -> tuple[int, TokensEvent | FinishEvent | ErrorEvent]:
        return (0, self.runs[0].events.get_nowait()) if not self._pumps else self._merged.get_nowait()

    def empty(self) -> bool:
        return self.runs[0].events.empty() if not self._pumps else self._merged.empty()

    def cancel(self) -> None:
        for run in self.runs:
            run.cancel()
        for pump in self._pumps:
            pump.cancel()

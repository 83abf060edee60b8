"""The gateway's request handling, independent of gRPC: validate and start runs, abort them, model info."""
from __future__ import annotations

import asyncio
import logging

from gateway.config import GatewayConfig
from gateway.metrics import GatewayMetrics
from gateway.model_info import ModelFacts
from gateway.orchestrator import RequestRun
from gateway.requests import check_input, parse_generate_request
from gateway.tokenize_pool import TokenizePool
from gateway.tokenizer import TextTokenizer
from gateway.workers import WorkerPool
from rpc.status import AlreadyExists
from rpc.v1 import gateway_pb2

logger = logging.getLogger(__name__)


class GatewayService:
    def __init__(self, config: GatewayConfig, facts: ModelFacts, tokenizer: TextTokenizer | None, pool: WorkerPool,
                 tokenize: TokenizePool | None = None, metrics: GatewayMetrics | None = None) -> None:
        self.config = config
        self._tokenize = tokenize
        self.facts = facts
        self.tokenizer = tokenizer
        self.pool = pool
        self._runs: dict[str, RequestRun] = {}
        self.metrics = metrics if metrics is not None else GatewayMetrics()
        self.pool.migrations.on_migrate = self.metrics.migrations.inc
        self.metrics.track(running=lambda: sum(run.admitted and not run.finished for run in self._runs.values()),
                           waiting=lambda: sum(not (run.admitted or run.finished) for run in self._runs.values()),
                           spares=lambda: len(pool.standing.held()) if pool.standing is not None else 0)

    async def submit(self, request: gateway_pb2.GenerateRequest, both_inputs: bool, arrival: float,
                     deadline: float | None, after: asyncio.Event | None = None) -> RequestRun:
        """Validates (InvalidArgument naming the field; long texts are tokenised off the event loop) and
        starts the request (once `after` is set, when given). A request_id is free again once its run has queued
        its final event."""
        checked = check_input(request, self.facts, self.tokenizer, both_inputs, self.config.max_request_bytes)
        self._check_free(request.request_id)
        prompt_ids = checked if not isinstance(checked, str) else (  # text: tokenised off the loop when long
            await self._tokenize.encode(checked) if self._tokenize is not None else None)  # (None: inline, below)
        job = parse_generate_request(request, self.facts, self.tokenizer, self.config.default_max_tokens, both_inputs,
                                     prompt_ids)
        self._check_free(job.request_id)
        run = RequestRun(job, self.pool, self.tokenizer, arrival, deadline, self.config.cleanup_timeout_s, self.metrics,
                         self.config.disagg_threshold_tokens, after)
        self._runs[job.request_id] = run
        run.start()
        assert run.task is not None
        run.task.add_done_callback(lambda _: self._forget(run))
        return run

    def _check_free(self, request_id: str) -> None:
        run = self._runs.get(request_id)
        if request_id and run is not None and not run.finished:
            raise AlreadyExists(f"request_id: {request_id!r} is already running")

    def _forget(self, run: RequestRun) -> None:
        if self._runs.get(run.job.request_id) is run:
            del self._runs[run.job.request_id]

    def abort(self, request_id: str) -> bool:
        run = self._runs.get(request_id)
        if run is None or run.finished:
            return False
        logger.info("abort requested for %s", request_id)
        run.cancel()
        return True

    async def shutdown(self, timeout_s: float) -> None:
        """Aborts every run and waits (up to timeout_s) for their cleanup on the workers."""
        runs = list(self._runs.values())
        for run in runs:
            run.cancel()
        tasks = [run.task for run in runs if run.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)

    @property
    def num_running(self) -> int:
        return len(self._runs)

    def model_info(self) -> gateway_pb2.GetModelInfoResponse:
        facts = self.facts
        return gateway_pb2.GetModelInfoResponse(
            model=facts.name, vocab_size=facts.vocab_size, max_context=facts.max_context,
            eos_token_ids=list(facts.eos_token_ids), default_max_tokens=self.config.default_max_tokens,
            num_prefill_workers=len(self.config.prefill), num_decode_workers=len(self.config.decode),
            has_tokenizer=self.tokenizer is not None,
        )

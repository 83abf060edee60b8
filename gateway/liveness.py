"""Hang detection for decode workers: a worker that stops answering (SIGSTOP, a deadlocked engine, a stuck
collective) is not the same as a dead one - its DecodeStream stays open and its requests would wait for their
deadlines. Two signals, checked after every load poll (GatewayConfig.load_poll_interval_s, 0.2 s):

- the health probe: GetDecodeLoad (answered by the worker's event loop without waiting for an engine step) fails
  `hang_probe_failures` times in a row (default 2; each waits up to worker_timeout_s, 2 s): ~4.5 s;
- the per-step liveness signal: the DecodeStream carries one message per engine step for all the worker's
  requests; with requests in flight and no message for `stream_silence_s` (default 30 s: a step of a big batch
  under load may take seconds) the engine is stuck even if the probe still answers.

Either way the worker's open DecodeStream is failed: each of its requests ends UNAVAILABLE (as when the worker
dies; gateway/migration.py would re-admit them elsewhere), the stream call is cancelled, so a worker that resumes
sees its stream gone and aborts those requests (their pages, leases and slots come back), and the worker is not
routed to until a probe answers again. Requests that reach it in between - reserved there before the hang, their
Decode submitted after it - fail UNAVAILABLE at once (and migrate) instead of opening a stream to a stopped
process, and a Reserve in flight to it is cancelled (WorkerPool.reserve tries the next worker; the worker frees
a reservation whose answer was lost). Invariant: a worker's stream is failed at most once per hang (the count
restarts when a probe answers)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LivenessConfig:
    """hang_probe_failures: consecutive failed load probes that make a decode worker hung (0: never);
    stream_silence_s: seconds without a DecodeStream message while requests are in flight (0: never)."""

    hang_probe_failures: int = 2
    stream_silence_s: float = 30.0

    def __post_init__(self) -> None:
        if self.hang_probe_failures < 0 or self.stream_silence_s < 0:
            raise ValueError("hang_probe_failures and stream_silence_s must be non-negative")


class DecodeLiveness:
    """Per decode worker: consecutive probe failures and whether its requests were failed for this hang."""

    def __init__(self, config: LivenessConfig) -> None:
        self.config = config
        self._failures: dict[str, int] = {}
        self._failed: set[str] = set()
        self.hangs = 0  # hangs detected since start (metric)

    def probed(self, worker, answered: bool) -> None:
        """After one load probe of `worker` (gateway.workers.DecodeWorker)."""
        address = worker.load.address
        if answered:
            self._failures[address] = 0
            self._failed.discard(address)
            if worker.stream is not None:
                worker.stream.answered()
            self._check_silence(worker)
            return
        self._failures[address] = self._failures.get(address, 0) + 1
        limit = self.config.hang_probe_failures
        if limit and self._failures[address] >= limit:
            self._fail(worker, f"decode worker {address} stopped answering ({self._failures[address]} health "
                               "probes failed)")

    def _check_silence(self, worker) -> None:
        stream, limit = worker.stream, self.config.stream_silence_s
        if stream is None or not limit:
            return
        silent = stream.silent_for(time.monotonic())
        if silent is not None and silent > limit:
            self._fail(worker, f"decode worker {worker.load.address} sent no step for {silent:.1f} s with requests "
                               "in flight")

    def _fail(self, worker, reason: str) -> None:
        address = worker.load.address
        if address in self._failed or worker.stream is None:
            return
        failed = worker.stream.fail_hung(reason)
        self._failed.add(address)
        if failed:
            self.hangs += 1
            logger.warning("%s: failed its %d running decode(s)", reason, failed)

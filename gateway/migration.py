"""Request migration: when a decode worker dies or hangs mid-stream (its DecodeStream call ends UNAVAILABLE:
broken stream, or gateway/liveness.py's hang detection), the request is admitted again on another decode worker
through the normal path - Reserve, Prefill of prompt + every token already streamed (so a prefix cache helps when
there is one), Decode - and the client's stream goes on with the next token: nothing is sent twice, nothing is
skipped. Greedy output is the undisturbed run's (up to the rounding of a prefill vs token-by-token decode at a
near-tie); a sampled request's continuation is drawn again from the same distribution, but its seed restarts on
the new worker, so a seeded sampled request is not reproduced token for token after a migration. A request is
migrated at most `limit` times (`--migration-limit`, default 3; 0: off); with no decode worker left it ends
UNAVAILABLE as before."""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import grpc

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MigrationConfig:
    limit: int = 3  # migrations per request (0: a decode worker's failure ends its requests UNAVAILABLE)

    def __post_init__(self) -> None:
        if self.limit < 0:
            raise ValueError(f"migration limit must be non-negative, got {self.limit}")


class Migrations:
    """The gateway's migration policy and count (on the WorkerPool); on_migrate: the metric's increment."""

    def __init__(self, config: MigrationConfig) -> None:
        self.config = config
        self.count = 0
        self.on_migrate: Callable[[], None] | None = None

    def allows(self, error: BaseException, done: int) -> bool:
        """Whether a request that has migrated `done` times and whose decode failed with `error` moves on."""
        return (isinstance(error, grpc.aio.AioRpcError) and error.code() == grpc.StatusCode.UNAVAILABLE
                and done < self.config.limit)

    def record(self, request_id: str, streamed: int, source: str) -> None:
        self.count += 1
        if self.on_migrate is not None:
            self.on_migrate()
        logger.warning("request %s: decode worker %s lost after %d tokens; migrating it", request_id, source, streamed)

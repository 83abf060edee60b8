"""Logging for every pdserve process: each line carries the process role (gateway, prefill, decode, up)
and its tensor-parallel rank."""
from __future__ import annotations

import logging
import os
import sys

ROLE_ENV = "PDSERVE_LOG_ROLE"
RANK_ENV = "PDSERVE_LOG_RANK"
FORMAT = "%(asctime)s %(levelname)s %(role)s[%(rank)s] %(name)s: %(message)s"


class _RoleFilter(logging.Filter):
    """Stamps role and rank on every record (read when emitted, so set_rank() takes effect at once)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.role = os.environ.get(ROLE_ENV, "pdserve")
        record.rank = os.environ.get(RANK_ENV, "0")
        return True


def configure_logging(role: str, rank: int = 0, level: str | int = "INFO") -> None:
    """Replaces the root handlers with one stderr handler whose lines read `... <role>[<rank>] logger: msg`.

    role and rank also go to the environment, so processes spawned from here (TP followers) inherit
    the role; a follower calls set_rank() with its own rank."""
    os.environ[ROLE_ENV] = role
    os.environ[RANK_ENV] = str(rank)
    if isinstance(level, str):
        level = getattr(logging, level.upper(), logging.INFO)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.addFilter(_RoleFilter())
    logging.basicConfig(level=level, handlers=[handler], force=True)
    logging.getLogger("grpc").setLevel(max(level, logging.WARNING))


def set_rank(rank: int) -> None:
    """Sets the rank shown in this process's log lines."""
    os.environ[RANK_ENV] = str(rank)

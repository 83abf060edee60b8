"""Logging for every pdserve process: each line carries the process role (gateway, prefill, decode, up)
and its tensor-parallel rank, and, inside a request's handling, its request id (`request=<id>`): the
gateway takes it from x-request-id (gRPC metadata or HTTP header) or makes one, and sends it to the
workers as x-request-id metadata; bind_request_id() sets it for the current task / context."""
from __future__ import annotations

import contextvars
import logging
import os
import sys

ROLE_ENV = "PDSERVE_LOG_ROLE"
RANK_ENV = "PDSERVE_LOG_RANK"
FORMAT = "%(asctime)s %(levelname)s %(role)s[%(rank)s] %(name)s:%(request_tag)s %(message)s"
REQUEST_ID_KEY = "x-request-id"  # gRPC metadata key and HTTP header
_REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("pdserve_request_id", default="")


def bind_request_id(request_id: str) -> None:
    """Log lines of the current context (an asyncio task, or a thread's own context) carry request_id."""
    _REQUEST_ID.set(request_id)


def current_request_id() -> str:
    return _REQUEST_ID.get()


def request_metadata(request_id: str) -> tuple[tuple[str, str], ...]:
    """The gRPC metadata that carries a request id to the next service."""
    return ((REQUEST_ID_KEY, request_id),)


class _RoleFilter(logging.Filter):
    """Stamps role and rank on every record (read from the environment when emitted)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.role = os.environ.get(ROLE_ENV, "pdserve")
        record.rank = os.environ.get(RANK_ENV, "0")
        request_id = _REQUEST_ID.get()
        record.request_tag = f" request={request_id}" if request_id else ""
        return True


def configure_logging(role: str, rank: int = 0, level: str | int = "INFO") -> None:
    """Replaces the root handlers with one stderr handler whose lines read `... <role>[<rank>] logger: msg`.

    role and rank also go to the environment, so processes spawned from here inherit the role (TP followers
    format their own lines: engine/runtime/tp_launcher.py)."""
    os.environ[ROLE_ENV] = role
    os.environ[RANK_ENV] = str(rank)
    if isinstance(level, str):
        level = getattr(logging, level.upper(), logging.INFO)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.addFilter(_RoleFilter())
    logging.basicConfig(level=level, handlers=[handler], force=True)
    logging.getLogger("grpc").setLevel(max(level, logging.WARNING))

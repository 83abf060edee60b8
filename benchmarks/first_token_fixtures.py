"""What benchmarks/profile_first_token.py's two sides share: a servicer context, the interceptor-wrapped
handler a server serves, pieces timed by thread CPU, and the interceptor chain's own per-call cost."""
from __future__ import annotations

import logging
import os
import time
from collections import namedtuple
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from rpc.interceptors import MalformedRequestInterceptor, server_interceptors
from rpc.logging_setup import configure_logging

Piece = Callable[[], Awaitable[int]]  # one call; returns its CPU ns
CallDetails = namedtuple("CallDetails", "method invocation_metadata")


def sync_piece(fn: Callable[[], Any]) -> Piece:
    """A synchronous piece: fn's CPU on this thread."""
    async def once() -> int:
        start = time.thread_time_ns()
        fn()
        return time.thread_time_ns() - start

    return once


def quiet_info_logging() -> None:
    """INFO lines formatted as a service formats them (role, request id), written to /dev/null."""
    configure_logging("bench")
    for handler in logging.getLogger().handlers:
        handler.setStream(open(os.devnull, "w"))  # noqa: SIM115 - lives as long as the process


class FakeContext:
    """The grpc.aio.ServicerContext calls our handlers make."""

    def __init__(self, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self._metadata = metadata
        self.callbacks: list[Callable[[Any], None]] = []

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def time_remaining(self) -> float | None:
        return None

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        self.callbacks.append(callback)

    def done(self) -> None:
        for callback in self.callbacks:
            callback(self)

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> None:
        raise RuntimeError(f"aborted: {code.name} {details}")


async def wrapped_handler(server_method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """The handler as a server with MalformedRequestInterceptor serves it."""
    async def continuation(_: Any) -> grpc.RpcMethodHandler:
        return handler

    return await MalformedRequestInterceptor().intercept_service(continuation, CallDetails(server_method, ()))


def interceptor_pieces() -> dict[str, Piece]:
    """Per call: the chain every pdserve server installs (rpc.interceptors.server_interceptors), as gRPC runs
    it for each RPC, without and with an internal token; and the malformed-request wrapper's own call."""
    handler = grpc.unary_unary_rpc_method_handler(_echo, lambda data: data, lambda data: data)
    details = CallDetails("/pdserve.internal.v1.PrefillService/Prefill", (("authorization", "Bearer t0ken"),))

    def chain(tokens: tuple[str, ...]) -> Piece:
        interceptors = server_interceptors(*tokens)

        async def call(index: int, call_details: Any) -> grpc.RpcMethodHandler:
            if index == len(interceptors):
                return handler
            return await interceptors[index].intercept_service(lambda d: call(index + 1, d), call_details)

        async def once() -> int:
            start = time.thread_time_ns()
            await call(0, details)
            return time.thread_time_ns() - start

        return once

    wrapped_box: dict[str, grpc.RpcMethodHandler] = {}

    async def wrapped_call() -> int:
        if "h" not in wrapped_box:
            wrapped_box["h"] = await wrapped_handler(details.method, handler)
        context = FakeContext()
        start = time.thread_time_ns()
        await wrapped_box["h"].unary_unary(b"x", context)
        return time.thread_time_ns() - start

    async def raw_call() -> int:
        context = FakeContext()
        start = time.thread_time_ns()
        await _echo(b"x", context)
        return time.thread_time_ns() - start

    return {"rpc: interceptor chain per call, no token": chain(()),
            "rpc: interceptor chain per call, internal token": chain(("t0ken",)),
            "rpc: a unary handler, bare": raw_call,
            "rpc: a unary handler, malformed-request wrapped": wrapped_call}


async def _echo(request: Any, context: Any) -> Any:
    return request

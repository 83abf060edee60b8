"""What every pdserve gRPC process shares: the event loop (uvloop), health + reflection registration, and
serve(): bind, start, publish health, wait for SIGTERM / SIGINT, then stop gracefully."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Iterable, Sequence

import grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer

from rpc import health_reflection

logger = logging.getLogger(__name__)

# Large enough for KV chunks and long prompts (bytes).
MAX_MESSAGE_BYTES = 64 * 2**20
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.enable_retries", 0),
    # A restarted worker is found again within a couple of seconds (gRPC's default backoff grows to 120 s).
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


# Seconds in-flight RPCs get to finish after SIGTERM before they are cancelled.
STOP_GRACE_S = 2.0

# A worker's engine thread holds the GIL between torch ops; with Python's default 5 ms switch interval
# the event loop thread (gRPC streaming) waits up to that long for each token. 0.5 ms measured 1.8x
# faster single-stream decoding through the gateway on the CPU test model.
SWITCH_INTERVAL_S = 0.0005


def run(main: Callable[[], Awaitable[None]]) -> None:
    """Runs main() on uvloop (asyncio's default loop when uvloop is missing), with a short GIL switch
    interval so the event loop is not starved by the engine thread."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        import uvloop
    except ImportError:  # optional speed-up only
        asyncio.run(main())
        return
    uvloop.run(main())


def add_health_and_reflection(server: grpc.aio.Server, service_names: Iterable[str]) -> HealthServicer:
    """Registers grpc.health.v1 (List included) and server reflection (v1 and v1alpha); call set_serving()
    to publish a status (grpc's HealthServicer answers SERVING for "" until told otherwise)."""
    return health_reflection.add_health_and_reflection(server, service_names)


async def set_serving(health: HealthServicer, service_names: Iterable[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *service_names]:
        await health.set(name, status)


def bound_address(listen: str, port: int) -> str:
    """host:port actually served (listen may say port 0); 0.0.0.0 / [::] advertise as 127.0.0.1.
    A Unix socket (unix:/path) is its own address."""
    if listen.startswith("unix:"):
        return listen
    host = listen.rsplit(":", 1)[0]
    if host in ("0.0.0.0", "[::]", "::", ""):
        host = "127.0.0.1"
    return f"{host}:{port}"


async def wait_for_stop_signal(stop: asyncio.Event | None = None) -> None:
    """Returns on SIGTERM or SIGINT (or when `stop` is set)."""
    event = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    installed = []
    for signum in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(signum, event.set)
            installed.append(signum)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass
    try:
        await event.wait()
    finally:
        for signum in installed:
            loop.remove_signal_handler(signum)


def write_ready_file(path: str | None, address: str, **extra: str) -> None:
    """Writes the served address to path (how a launcher learns a port-0 server's port), then one
    `name=address` line per other endpoint (e.g. http=..., metrics=...); empty ones are left out."""
    if path:
        lines = [address] + [f"{name}={value}" for name, value in extra.items() if value]
        with open(path + ".tmp", "w") as handle:
            handle.write("\n".join(lines) + "\n")
        os.replace(path + ".tmp", path)


def read_ready_file(path: str) -> tuple[str, dict[str, str]]:
    """(the served address, {name: address} of the other endpoints) from a ready file."""
    first, *rest = open(path).read().split("\n")
    extra = dict(line.split("=", 1) for line in rest if "=" in line)
    return first.strip(), {name.strip(): value.strip() for name, value in extra.items()}


async def serve(
    role: str,
    listen: str,
    service_names: Sequence[str],
    register: Callable[[grpc.aio.Server], None],
    on_stop: Callable[[], Awaitable[None]],
    *,
    stop: asyncio.Event | None = None,
    ready_file: str | None = None,
    on_bound: Callable[[str], None] | None = None,
    on_started: Callable[[HealthServicer, str], Awaitable[None]] | None = None,
    serving_when_started: bool = True,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    options: Sequence[tuple[str, object]] = (),
    credentials: grpc.ServerCredentials | None = None,
    endpoints: dict[str, str] | None = None,
    on_draining: Callable[[], None] | None = None,
) -> None:
    """The body of every pdserve gRPC server: registers the services (`register`), health and reflection,
    binds `listen` (port 0 allowed), calls on_bound(address) before and on_started(health, address) after the
    server starts, publishes SERVING (unless serving_when_started is False: then on_started owns health),
    writes ready_file, and runs until SIGTERM / SIGINT (or `stop`). Then health goes NOT_SERVING, in-flight
    RPCs get STOP_GRACE_S to finish, and on_stop() releases what the caller built. endpoints: the process's
    other served addresses (http, metrics), which on_started may fill in; written to the ready file too.
    interceptors: e.g. rpc.interceptors.server_interceptors(token); options: channel arguments overriding
    SERVER_OPTIONS; credentials: serve TLS (grpc.ssl_server_credentials) instead of plaintext. on_draining: called
    when shutdown begins, before the grace period (e.g. to end long-lived streams once their work is done)."""
    overridden = {name for name, _ in options}
    merged = [option for option in SERVER_OPTIONS if option[0] not in overridden] + list(options)
    server = grpc.aio.server(options=merged, interceptors=list(interceptors))
    register(server)
    health = add_health_and_reflection(server, service_names)
    await set_serving(health, service_names, False)
    port = server.add_insecure_port(listen) if credentials is None else server.add_secure_port(listen, credentials)
    address = bound_address(listen, port)
    if on_bound is not None:
        on_bound(address)
    await server.start()
    try:
        if serving_when_started:
            await set_serving(health, service_names, True)
        if on_started is not None:
            await on_started(health, address)
        logger.info("%s serving on %s", role, address)
        write_ready_file(ready_file, address, **(endpoints or {}))
        await wait_for_stop_signal(stop)
    finally:
        logger.info("%s stopping", role)
        await health.enter_graceful_shutdown()
        if on_draining is not None:
            on_draining()
        await server.stop(grace=STOP_GRACE_S)
        await on_stop()
        logger.info("%s stopped", role)

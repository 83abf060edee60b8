"""Helpers for service tests: deterministic prompts, stubs, and polling a decode worker's load."""
from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar
from contextlib import asynccontextmanager

import aiohttp
import grpc
from prometheus_client.parser import text_string_to_metric_families

from engine.sampling_params import SamplingParams
from gateway.decode_stream import DecodeStream
from gateway.prefill_stream import PrefillStream
from rpc.v1 import gateway_pb2_grpc
from rpc.internal.v1 import worker_pb2, worker_pb2_grpc

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]  # (metric, labels) -> value
PROMPT_LENGTHS = (1, 2, 7, 16, 17, 33, 64, 100, 128, 255, 300, 512, 777, 1024, 1500, 2048)
FIRST_ORDINARY_TOKEN = 4  # ids 0..3 are the special tokens
VOCAB_LIMIT = 300          # the test tokenizer's vocabulary (the model's is 320)


def up_args(**overrides: object) -> argparse.Namespace:
    """`pdserve up`'s parsed defaults with some attributes replaced (for its pure start-up checks)."""
    from pdserve.commands import up

    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    args = parser.parse_args([])
    for name, value in overrides.items():
        setattr(args, name, value)
    return args


def log_tail(path, lines: int = 40) -> str:
    """The last lines of a log file (a failed `pdserve up` start: its stderr holds the workers' too)."""
    with open(path, errors="replace") as log:
        return "".join(log.readlines()[-lines:])


def token_prompts(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_ORDINARY_TOKEN, VOCAB_LIMIT) for _ in range(length)] for length in lengths]


T = TypeVar("T")


async def eventually(predicate: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Polls predicate until it holds; raises AssertionError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.01)


async def until_value(predicate: Callable[[], Awaitable[T]], what: str, timeout: float = 120.0) -> T:
    """Awaits predicate() every 0.1 s until it returns something truthy, and returns that; raises AssertionError
    naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = await predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


def greedy(max_tokens: int, speculative: bool | None = None) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_tokens, temperature=0.0, ignore_eos=True, speculative=speculative)


async def greedy_through_gateway(address: str, prompts: list[list[int]], max_tokens: int, speculative: bool,
                                 timeout: float = 300.0) -> list:
    """Every prompt sent at once through the gateway at `address`, greedy, ignore_eos: their GenerateResults
    (speculative=True: the server's default speculation, False: none)."""
    from gateway.client import build_request, generate

    async with gateway_stub(address) as stub:
        return list(await asyncio.gather(*(
            generate(stub, build_request(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                         speculative=None if speculative else False), timeout=timeout)
            for prompt in prompts)))


@asynccontextmanager
async def gateway_stub(address: str) -> AsyncIterator[gateway_pb2_grpc.GatewayServiceStub]:
    async with grpc.aio.insecure_channel(address) as channel:
        yield gateway_pb2_grpc.GatewayServiceStub(channel)


async def scrape(http: aiohttp.ClientSession, address: str) -> Samples:
    """A service's GET /metrics at `address`, parsed."""
    async with http.get(f"http://{address}/metrics") as response:
        assert response.status == 200
        text = await response.text()
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


async def gateway_quiet(http_address: str, timeout: float = 60.0) -> None:
    """Waits until the gateway at `http_address` (its HTTP front) has no request running or waiting: every run,
    a straggler whose client already gave up included, has ended and cleaned up. Fails loudly after `timeout`."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as http:
        while True:
            samples = await scrape(http, http_address)
            busy = [samples[(name, frozenset())] for name in ("pdserve_requests_running", "pdserve_requests_waiting")]
            if busy == [0, 0]:
                return
            assert time.monotonic() < deadline, f"the gateway still has requests running / waiting: {busy}"
            await asyncio.sleep(0.05)


async def decode_load(address: str) -> worker_pb2.GetDecodeLoadResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        return await worker_pb2_grpc.DecodeServiceStub(channel).GetDecodeLoad(worker_pb2.GetDecodeLoadRequest(), timeout=30)


async def prefill_load(address: str) -> worker_pb2.GetPrefillLoadResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        return await worker_pb2_grpc.PrefillServiceStub(channel).GetPrefillLoad(worker_pb2.GetPrefillLoadRequest(), timeout=30)


def unspared_free_pages(load: worker_pb2.GetDecodeLoadResponse) -> int:
    """Free pages plus the pages spares hold (unclaimed standing leases a gateway keeps, gateway/standing_leases.py):
    what would be free without them. Constant while a spare is taken and refilled, unlike free_pages."""
    return load.free_pages + load.standing_pages


def at_rest(load: worker_pb2.GetDecodeLoadResponse, baseline: int, spares: int = 1) -> bool:
    """Nothing runs or waits, the only leases held are exactly `spares` spares (one per gateway in front that
    keeps them: a leaked lease, standing or not, is one too many) and the pages but for theirs are `baseline`."""
    return ((load.running, load.waiting, load.leases, load.standing_leases) == (0, 0, spares, spares)
            and unspared_free_pages(load) == baseline)


# How long a decode worker must read the same at-rest load before a helper believes it: more than a few of the
# gateway's load-poll intervals (0.2 s). A spare taken by a request still in flight (its Prefill not answered
# yet) looks like a spare on the decode worker until the gateway's refill adds the next one, within about one
# poll interval: a reading that lasts catches it (two standing leases), one reading may not.
SETTLE_S = 1.0


async def _settled(address: str, condition: Callable[[worker_pb2.GetDecodeLoadResponse], bool],
                   timeout: float) -> tuple[bool, worker_pb2.GetDecodeLoadResponse]:
    """(True, the load) once `condition` held on every poll for SETTLE_S with the same unspared free pages;
    (False, the last load) after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    since: float | None = None
    value = -1
    while True:
        load, now = await decode_load(address), time.monotonic()
        if not condition(load):
            since = None
        elif since is None or unspared_free_pages(load) != value:
            since, value = now, unspared_free_pages(load)
        elif now - since >= SETTLE_S:
            return True, load
        if now > deadline:
            return False, load
        await asyncio.sleep(0.05)


async def idle_free_pages(address: str, timeout: float = 60.0) -> int:
    """The decode worker's idle baseline: free pages plus the spares' pages once nothing runs or waits and every
    lease held is a spare, unchanged for SETTLE_S (a spare being replaced can skew one reading)."""
    settled, load = await _settled(
        address, lambda load: load.running == 0 and load.waiting == 0 and load.leases == load.standing_leases, timeout)
    if not settled:
        raise AssertionError(f"decode worker never went idle: {load}")
    return unspared_free_pages(load)


async def wait_for_free_pages(address: str, expected: int, timeout: float = 60.0,
                              spares: int = 1) -> worker_pb2.GetDecodeLoadResponse:
    """Polls GetDecodeLoad until the worker is at_rest(load, expected, spares) for SETTLE_S; returns the last Load
    either way (callers assert at_rest on it)."""
    return (await _settled(address, lambda load: at_rest(load, expected, spares), timeout))[1]


async def prefill_once(stub: worker_pb2_grpc.PrefillServiceStub, request: worker_pb2.PrefillRequest, timeout: float,
                       metadata: tuple[tuple[str, str], ...] = ()) -> worker_pb2.PrefillResponse:
    """One prompt over a PrefillStream of its own (as the gateway sends it), closed afterwards; raises the
    request's AioRpcError (the stream's, e.g. UNAUTHENTICATED, when the worker refused the stream)."""
    stream = PrefillStream(stub, metadata, "test")
    try:
        return await stream.prefill(request, timeout)
    finally:
        await stream.close()


async def decode_once(stub: worker_pb2_grpc.DecodeServiceStub, request: worker_pb2.DecodeRequest, timeout: float,
                      metadata: tuple[tuple[str, str], ...] = ()) -> list[int]:
    """One request over a DecodeStream of its own (as the gateway sends it), closed afterwards: its tokens
    (after the first); raises the request's AioRpcError."""
    stream = DecodeStream(stub, metadata, "test")
    try:
        return [token async for chunk in stream.submit(request, timeout) for token in chunk.token_ids]
    finally:
        await stream.close()


def up_specs(monkeypatch, argvs: list[list[str]]) -> list:
    """The ClusterSpec `pdserve up` builds for each argv (nothing is started: Cluster is replaced)."""
    import argparse

    from pdserve import launcher
    from pdserve.commands import up

    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    parser.add_argument("--log-level", default="WARNING")  # the top-level parser's
    specs = []

    class _Stop(Exception):
        pass

    def capture(spec, *args, **kwargs):
        specs.append(spec)
        raise _Stop

    monkeypatch.setattr(launcher, "Cluster", capture)
    monkeypatch.setattr(up, "configure_logging", lambda *args: None)  # leave pytest's logging alone
    monkeypatch.setattr(up.signal, "signal", lambda *args: None)  # and its signal handlers
    for argv in argvs:
        try:
            up.run(parser.parse_args(argv))
        except _Stop:
            continue
        raise AssertionError(f"pdserve up {argv} never built its cluster")
    return specs

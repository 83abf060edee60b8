"""Helpers for service tests: deterministic prompts, stubs, and polling a decode worker's load."""
from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import aiohttp
import grpc
from prometheus_client.parser import text_string_to_metric_families

from engine.sampling_params import SamplingParams
from rpc.v1 import gateway_pb2_grpc
from rpc.internal.v1 import worker_pb2, worker_pb2_grpc

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]  # (metric, labels) -> value
PROMPT_LENGTHS = (1, 2, 7, 16, 17, 33, 64, 100, 128, 255, 300, 512, 777, 1024, 1500, 2048)
FIRST_ORDINARY_TOKEN = 4  # ids 0..3 are the special tokens
VOCAB_LIMIT = 300          # the test tokenizer's vocabulary (the model's is 320)


def token_prompts(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_ORDINARY_TOKEN, VOCAB_LIMIT) for _ in range(length)] for length in lengths]


async def eventually(predicate: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Polls predicate until it holds; raises AssertionError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.01)


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


async def idle_free_pages(address: str, timeout: float = 30.0) -> int:
    """The decode worker's idle baseline: free pages plus the spares' pages once nothing runs or waits and every
    lease held is a spare, the same on two polls in a row (a spare being replaced can skew one reading)."""
    deadline = time.monotonic() + timeout
    seen: int | None = None
    while True:
        load = await decode_load(address)
        idle = load.running == 0 and load.waiting == 0 and load.leases == load.standing_leases
        if idle and seen == unspared_free_pages(load):
            return seen
        seen = unspared_free_pages(load) if idle else None
        if time.monotonic() > deadline:
            raise AssertionError(f"decode worker never went idle: {load}")
        await asyncio.sleep(0.05)


async def wait_for_free_pages(address: str, expected: int, timeout: float = 60.0,
                              spares: int = 1) -> worker_pb2.GetDecodeLoadResponse:
    """Polls GetDecodeLoad until the worker is at_rest(load, expected, spares) on two polls in a row; returns the
    last Load either way (callers assert at_rest on it)."""
    deadline = time.monotonic() + timeout
    load, streak = await decode_load(address), 0
    while streak < 2 and time.monotonic() < deadline:
        streak = streak + 1 if at_rest(load, expected, spares) else 0
        if streak < 2:
            await asyncio.sleep(0.05)
            load = await decode_load(address)
    return load

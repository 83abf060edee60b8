"""Cache-aware routing over real worker processes (2 prefill + 2 decode, prefix cache on), each test with an
in-process gateway over them (its KV index, fed by the workers' WatchKVEvents, read directly).

Invariants:
- a multi-turn conversation's later turns go to the decode and prefill workers of its first turn, report cached
  tokens >= 90% of their history in usage, and produce the greedy tokens of an in-process engine with the prefix
  cache off; negative control: with weight 0 (load only) the turns do not all stay on one prefill worker;
- the index converges to every worker's true contents (a fresh WatchKVEvents snapshot) after its event streams
  are dropped in the middle of a run;
- killing the decode worker that holds a conversation sends the next turn to the other one (a miss, not an error),
  and once it is restarted the index holds its new instance's contents: no entry of the old one is left."""
from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from gateway.config import GatewayConfig
from gateway.kv_index import PromptKeys
from gateway.orchestrator import RequestRun
from gateway.route_note import RouteNote
from gateway.server import serve as serve_gateway
from gateway.workers import WorkerPool
from rpc.internal.v1 import worker_pb2, worker_pb2_grpc
from tests.services.conftest import launch, worker_address
from tests.services.helpers import eventually, greedy, greedy_through_gateway, token_prompts, until_value

PREFILL = ("prefill-0", "prefill-1")
DECODE = ("decode-0", "decode-1")
ANSWER = 8  # tokens per answer (greedy, ignore_eos)
# A conversation: a 400-token first message (25 full pages), then 24-token messages.
FIRST, LATER = token_prompts((400,), seed=11)[0], token_prompts((24, 24, 24), seed=12)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def routing_cluster(service_model: Path, tmp_path_factory: pytest.TempPathFactory):
    cluster = launch(service_model, tmp_path_factory.mktemp("routing_logs"), num_prefill=2, num_decode=2)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def no_cache_engine(service_model: Path):
    """The reference: an in-process engine over the same model and draft with the prefix cache off."""
    from engine import LLM

    with LLM(str(service_model), attention_backend="torch", kv_memory_bytes=64 * 2**20, num_threads=1,
             prefix_cache=False) as llm:
        yield llm


@dataclass
class Gateway:
    address: str
    pool: WorkerPool
    routes: list[RouteNote]  # one per finished run, in order


@asynccontextmanager
async def running_gateway(cluster, service_model: Path, tmp_path: Path, monkeypatch,
                          weight: float = 1.0) -> AsyncIterator[Gateway]:
    pools: list[WorkerPool] = []
    routes: list[RouteNote] = []
    start, finish = WorkerPool.start, RequestRun._finish

    def recording_finish(self: RequestRun, reason: str, stop: str = "") -> None:
        routes.append(dataclasses.replace(self.route))
        finish(self, reason, stop)

    monkeypatch.setattr(WorkerPool, "start", lambda self: pools.append(self) or start(self))
    monkeypatch.setattr(RequestRun, "_finish", recording_finish)
    config = GatewayConfig(model_dir=str(service_model), prefill=tuple(worker_address(cluster, r) for r in PREFILL),
                           decode=tuple(worker_address(cluster, r) for r in DECODE), listen="127.0.0.1:0",
                           load_poll_interval_s=0.05, standing_lease_tokens=0, cache_routing_weight=weight,
                           disagg_threshold_tokens=0)  # every turn through a prefill worker (its cache is watched)
    stop, ready = asyncio.Event(), tmp_path / f"gateway-{weight}.addr"
    task = asyncio.create_task(serve_gateway(config, stop=stop, ready_file=str(ready)))
    try:
        await eventually(lambda: ready.exists() or task.done(), "the gateway's ready file")
        assert not task.done(), "the gateway did not start"
        yield Gateway(ready.read_text().strip(), pools[0], routes)
    finally:
        stop.set()
        await task


async def worker_snapshot(address: str) -> worker_pb2.WatchKVEventsResponse:
    """The first message of a fresh WatchKVEvents: the worker's whole cache now."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = worker_pb2_grpc.KVEventServiceStub(channel).WatchKVEvents(worker_pb2.WatchKVEventsRequest(), timeout=60)
        async for batch in call:
            call.cancel()
            return batch
    raise AssertionError(f"{address} ended its KV event stream without a snapshot")


async def index_matches(pool: WorkerPool, address: str) -> bool:
    batch = await worker_snapshot(address)
    cache = pool.kv_index.cache_of(address)
    return (cache is not None and cache.instance_id == batch.instance_id
            and cache.pages == {page.key for page in batch.snapshot.pages}
            and cache.checkpoints == set(batch.snapshot.checkpoint_keys))


async def converse(gateway: Gateway, messages: list[list[int]]) -> tuple[list[list[int]], list]:
    """Sends the turns one after the other (each the whole history plus the next message); before each later
    turn waits until the index knows the earlier turns' pages (events are asynchronous) and a load poll shows the
    previous turn's decode pages released (as a user's think time would: a worker reports a finished request's
    pages a step or so after it stopped running it).
    Returns the prompts and their results."""
    history: list[int] = []
    prompts, results = [], []
    for message in messages:
        prompt = history + message
        if history:
            keys, pool = PromptKeys(prompt), gateway.pool
            held = len(prompts[-1]) // 16 * 16  # the previous prompt's full pages (on its prefill worker)
            first = len(prompts[0]) // 16 * 16  # the first turn's (its decode worker publishes no duplicate after)
            await eventually(lambda: any(pool.overlap(w.load.address, keys).lookup_tokens >= held for w in pool.prefill)
                             and any(pool.overlap(w.load.address, keys).page_tokens >= first for w in pool.decode)
                             and all(w.load.running == w.load.load_pages == 0 for w in pool.decode),  # polled at rest
                             "the earlier turns' pages in the index and the previous turn's pages released")
        result = (await greedy_through_gateway(gateway.address, [prompt], ANSWER, speculative=True))[0]
        prompts.append(prompt)
        results.append(result)
        history = prompt + list(result.token_ids)
    return prompts, results


async def test_later_turns_stay_with_their_history(routing_cluster, service_model, no_cache_engine, tmp_path,
                                                   monkeypatch):
    """Turns 2.. of a conversation land on turn 1's decode and prefill workers, report >= 90% of their history
    cached, and equal the no-cache engine's greedy tokens; the route's expected prefill overlap equals what the
    worker reported. Negative control: at weight 0 the prefill worker alternates between turns (load ties)."""
    async with running_gateway(routing_cluster, service_model, tmp_path, monkeypatch) as gateway:
        prompts, results = await converse(gateway, [FIRST, *LATER])
        routes = list(gateway.routes)
    reference = [no_cache_engine.generate([prompt], greedy(ANSWER))[0] for prompt in prompts]
    assert [list(result.token_ids) for result in results] == reference
    assert len({route.decode for route in routes}) == 1 and len({route.prefill for route in routes}) == 1, [
        route.describe() for route in routes]
    for turn in range(1, len(prompts)):
        history = len(prompts[turn - 1]) + ANSWER
        cached = results[turn].complete.usage.cached_tokens
        assert cached >= 0.9 * history, (turn, cached, history)
        assert routes[turn].expected_prefill == routes[turn].actual_prefill == cached, routes[turn]
        assert routes[turn].expected_decode > 0, routes[turn]  # the decode worker holds the earlier turns' pages
    assert routes[0].expected_prefill == routes[0].actual_prefill == 0

    other = [token_prompts((400,), seed=21)[0], *token_prompts((24, 24, 24), seed=22)]
    async with running_gateway(routing_cluster, service_model, tmp_path, monkeypatch, weight=0.0) as gateway:
        await converse(gateway, other)
        load_only = list(gateway.routes)
    assert len({route.prefill for route in load_only}) == 2, load_only  # ties rotate: the cache is not followed


async def test_index_converges_after_dropped_streams(routing_cluster, service_model, tmp_path, monkeypatch):
    """Every worker's event stream is dropped while a request runs (twice); afterwards the index equals each
    worker's own snapshot (same instance, pages and checkpoints)."""
    async with running_gateway(routing_cluster, service_model, tmp_path, monkeypatch) as gateway:
        pool = gateway.pool
        addresses = [w.load.address for w in (*pool.prefill, *pool.decode)]
        await until_value(lambda: all_match(pool, addresses), "the index before the run")
        losses = pool.kv_watch.losses
        prompt = token_prompts((600,), seed=31)[0]
        run = asyncio.create_task(greedy_through_gateway(gateway.address, [prompt], 48, speculative=True))
        for _ in range(2):
            await eventually(lambda: all(pool.kv_watch.streaming(a) for a in addresses), "the streams (re)opened")
            for address in addresses:
                pool.kv_watch.drop(address)
        (result,) = await run
        assert len(result.token_ids) == 48
        assert pool.kv_watch.losses >= losses + len(addresses)
        await until_value(lambda: all_match(pool, addresses), "the index to converge")
        assert any(pool.kv_index.cache_of(a).pages for a in addresses)  # (not trivially equal: pages are held)


async def test_killed_decode_worker_is_a_miss_and_leaves_no_stale_entry(routing_cluster, service_model, tmp_path,
                                                                         monkeypatch):
    """The decode worker holding a conversation is killed: the next turn runs on the other one (no error); the
    killed worker, restarted, is indexed from its new instance's snapshot: none of its old keys remain."""
    async with running_gateway(routing_cluster, service_model, tmp_path, monkeypatch) as gateway:
        pool = gateway.pool
        prompts, results = await converse(gateway, [token_prompts((400,), seed=41)[0], LATER[0]])
        holder = gateway.routes[-1].decode
        old = pool.kv_index.cache_of(holder)
        assert old is not None and old.pages
        old_instance, old_pages = old.instance_id, set(old.pages)
        child = next(c for c in routing_cluster.children if c.address == holder)
        child.process.kill()
        child.process.wait(60)
        history = prompts[-1] + list(results[-1].token_ids)
        (after,) = await greedy_through_gateway(gateway.address, [history + LATER[1]], ANSWER, speculative=True)
        assert len(after.token_ids) == ANSWER and after.complete is not None
        routes = [route.describe() for route in gateway.routes]
        assert gateway.routes[-1].decode != holder, routes
        assert gateway.routes[-1].expected_decode == 0, routes  # a miss: the other decode worker never saw it
        routing_cluster.respawn(child)
        await eventually(lambda: child.ready_file.exists(), "the restarted decode worker", timeout=300)
        await until_value(lambda: index_matches(pool, holder), "the restarted worker's snapshot in the index")
        cache = pool.kv_index.cache_of(holder)
        assert cache.instance_id != old_instance and not cache.pages & old_pages


async def all_match(pool: WorkerPool, addresses: list[str]) -> bool:
    for address in addresses:
        if not await index_matches(pool, address):
            return False
    return True

"""DecodeService with its engine in a process of its own (process_port.ProcessPort), over the tiny service model
and a shared-memory pool: reserve -> decode -> stream -> release, abort, engine death, construction errors,
no segment left behind. Each test starts an engine process: all are slow."""
from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import psutil
import pytest

from decode_worker.config import DecodeWorkerConfig
from decode_worker.engine_api import snapshot_of
from decode_worker.engine_process import EngineFacts, load_of
from decode_worker.engine_view import EngineView
from decode_worker.server import _Receivers
from decode_worker.service import DecodeService
from decode_worker.streams import EngineFailed
from engine.engine_config import EngineConfig
from engine.paths import MODELS_DIR
from engine.runtime.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.weights import weight_store
from kvtransfer.destination import TransportKind
from rpc.convert import load_to_proto
from rpc.internal.v1 import worker_pb2
from rpc.status import Unavailable
from tests.decode_worker.thread_port import thread_port
from tests.services.decode_hooks import mark_kv_complete
from tests.services.helpers import eventually, greedy
from tests.services.k3_service_model import make_k3_service_model

pytestmark = pytest.mark.slow
PAGE_SIZE = 16
PROMPT = [5 + i % 200 for i in range(40)]


def _config(model: Path, draft: bool = False, **engine: object) -> DecodeWorkerConfig:
    fields = {"kv_memory_bytes": 256 * 1024} | engine
    return DecodeWorkerConfig.build(model_dir=str(model), draft_model_dir=None if draft else "",
                                    attention_backend="torch", page_size=PAGE_SIZE, num_threads=1, **fields)


async def _started(config: DecodeWorkerConfig, lost: list[str] | None = None,
                   engine_process: bool = True) -> tuple[DecodeService, _Receivers]:
    """engine_process=False: the engine on a thread of the test (tests/decode_worker/thread_port.py), the oracle."""
    receivers = _Receivers()
    service = DecodeService(config, receivers, on_engine_lost=None if lost is None else lost.append,
                            port_factory=None if engine_process else thread_port(config))
    await service.start()
    receivers.push.advertise(["127.0.0.1:1"] * len(receivers.pools))  # no pushes here; expect() needs an address
    return service, receivers


async def _stopped(service: DecodeService, receivers: _Receivers) -> None:
    await service.stop()
    receivers.close()


async def _generate(service: DecodeService, request_id: str, max_tokens: int, speculative: bool | None = False) -> list[int]:
    destination = await service.reserve(request_id, len(PROMPT), max_tokens, TransportKind.SHM)
    mark_kv_complete(service.engine, destination)
    return [token async for update in service.decode(request_id, destination.lease_id, PROMPT, 7,
                                                     greedy(max_tokens, speculative)) for token in update.token_ids]


@pytest.mark.parametrize("draft", [False, True], ids=["plain", "spec"])
async def test_process_path_streams_what_the_thread_path_does(service_model, draft):
    """The same reservation and Decode give the same greedy tokens with the engine on a thread and in its own
    process (speculation off and on); afterwards every page is free again and, once stopped, the engine
    process has exited and its pool segments are gone from /dev/shm."""
    outputs = {}
    for engine_process in (False, True):
        service, receivers = await _started(_config(service_model, draft), engine_process=engine_process)
        try:
            total = service.load.free_pages
            outputs[engine_process] = [await _generate(service, f"r{i}", 12, None if draft else False) for i in range(2)]
            await eventually(lambda: service.load.free_pages == total and service.load.running == 0, "pages freed")
            pid = service._port.pid if engine_process else None
            names = list(service.engine.pool_names)
        finally:
            await _stopped(service, receivers)
        if engine_process:
            assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
            assert names and not [name for name in names if Path("/dev/shm", name).exists()]
    assert all(len(tokens) == 11 for tokens in outputs[True])  # the first of the 12 came from prefill
    assert outputs[True] == outputs[False]


async def test_k3_state_slots_through_the_engine_process(tmp_path):
    """A K3 model (KDA state slots in the pool): a reservation made through the engine process holds a slot
    (the load shows it taken), the request decodes what it decodes on a thread, and its pages and slot
    come back when it finishes."""
    model = make_k3_service_model(tmp_path)
    outputs = {}
    for engine_process in (False, True):
        service, receivers = await _started(_config(model, kv_memory_bytes=2 * 2**20, max_running=3),
                                            engine_process=engine_process)
        try:
            pages, slots = service.load.free_pages, service.load.free_state_slots
            assert slots == 4
            destination = await service.reserve("k", len(PROMPT), 10, TransportKind.SHM)
            assert destination.state_slot is not None and service.load.free_state_slots == slots - 1
            mark_kv_complete(service.engine, destination)
            outputs[engine_process] = [token async for update in service.decode(
                "k", destination.lease_id, PROMPT, 7, greedy(10)) for token in update.token_ids]
            await eventually(lambda: (service.load.free_pages, service.load.free_state_slots) == (pages, slots),
                             "pages and slot freed")
        finally:
            await _stopped(service, receivers)
    assert len(outputs[True]) == 9 and outputs[True] == outputs[False]


async def test_cancel_and_release_free_the_pages(service_model):
    """A Decode stream closed early aborts its request in the engine process, and Release of a running
    request does too: both give every page back."""
    service, receivers = await _started(_config(service_model))
    try:
        total = service.load.free_pages
        destination = await service.reserve("early", len(PROMPT), 200, TransportKind.SHM)
        mark_kv_complete(service.engine, destination)
        stream = service.decode("early", destination.lease_id, PROMPT, 7, greedy(200))
        assert (await anext(stream)).token_ids
        await stream.aclose()
        await eventually(lambda: service.load.free_pages == total and service.load.running == 0, "cancel freed")

        destination = await service.reserve("released", len(PROMPT), 200, TransportKind.SHM)
        mark_kv_complete(service.engine, destination)
        stream = service.decode("released", destination.lease_id, PROMPT, 7, greedy(200))
        first = await anext(stream)
        assert first.token_ids and not first.finished
        assert await service.release("released")
        rest = [update async for update in stream]
        assert rest and rest[-1].finished and rest[-1].finish_reason == "abort"
        await eventually(lambda: service.load.free_pages == total and service.load.running == 0, "release freed")
    finally:
        await _stopped(service, receivers)


async def test_engine_process_death_fails_streams_and_is_reported(service_model):
    """Killing the engine process mid-stream ends the open stream with EngineFailed (no hang), calls
    on_engine_lost, makes Reserve UNAVAILABLE, and stop() still completes with no pool segment left, nor the
    weight segment the killed process owned."""
    lost: list[str] = []
    service, receivers = await _started(_config(service_model), lost)
    names = list(service.engine.pool_names)
    weights = _weight_segments_of(service._port.pid)
    try:
        destination = await service.reserve("doomed", len(PROMPT), 1000, TransportKind.SHM)
        mark_kv_complete(service.engine, destination)
        stream = service.decode("doomed", destination.lease_id, PROMPT, 7, greedy(1000))
        assert (await anext(stream)).token_ids
        os.kill(service._port.pid, signal.SIGKILL)
        with pytest.raises(EngineFailed, match="exit code -9"):
            await asyncio.wait_for(_drain(stream), timeout=60)
        assert lost and "exit code -9" in lost[0]
        with pytest.raises(Unavailable):
            await service.reserve("after", len(PROMPT), 8, TransportKind.SHM)
    finally:
        await _stopped(service, receivers)
    assert not [name for name in names if Path("/dev/shm", name).exists()]
    assert weights and not [path for path in weights if path.exists()]  # its weight segment did not outlive it


def _weight_segments_of(pid: int) -> list[Path]:
    """The weight segments (engine/weights/weight_store.py) whose header names `pid` as their owner."""
    owned = []
    for path in Path(weight_store.SHM_DIR).glob(weight_store.PREFIX + "*"):
        try:
            with open(path, "rb") as segment:
                raw = segment.read(weight_store.HEADER.size)
        except OSError:  # (another test's segment, gone meanwhile)
            continue
        if len(raw) == weight_store.HEADER.size:
            magic, _, owner, *_ = weight_store.HEADER.unpack(raw)
            if magic == weight_store.MAGIC and owner == pid:
                owned.append(path)
    return owned


async def _drain(stream) -> None:
    async for _ in stream:
        pass


async def test_engine_construction_error_surfaces_at_start(service_model, tmp_path):
    """An engine that cannot be built (a config.json the engine rejects) fails start() with the engine's
    error, and the engine process is gone."""
    broken = tmp_path / "broken"
    broken.mkdir()
    config = json.loads((service_model / "config.json").read_text())
    config["num_attention_heads"] = 7  # not divisible: the engine refuses the model
    (broken / "config.json").write_text(json.dumps(config))
    service = DecodeService(_config(broken), _Receivers())
    with pytest.raises(RuntimeError, match="engine failed to start"):
        await service.start()
    pid = service._port.pid
    assert pid is not None and (not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)


@pytest.mark.parametrize("cache", [True, False], ids=["cache", "no-cache"])
async def test_prefix_cache_figures_through_the_engine_process(tmp_path, cache):
    """A K3 model through the engine process: once a request has decoded past a page boundary, the load (and the
    GetDecodeLoad answer built from it) shows the decode engine's prefix cache - pages cached, checkpoints held
    (the decode checkpoint at the last page boundary), the checkpoint pool's size; with --no-prefix-cache every
    one of those reads 0."""
    model = make_k3_service_model(tmp_path)
    service, receivers = await _started(_config(model, kv_memory_bytes=2 * 2**20, max_running=3, prefix_cache=cache))
    try:
        destination = await service.reserve("k", len(PROMPT), 12, TransportKind.SHM)
        mark_kv_complete(service.engine, destination)
        tokens = [token async for update in service.decode("k", destination.lease_id, PROMPT, 7, greedy(12))
                  for token in update.token_ids]
        assert len(tokens) == 11  # 40 prompt + 12 tokens: the cache passes the page boundary at 48
        if cache:
            await eventually(lambda: service.load.cached_pages >= 3 and service.load.checkpoints >= 1,
                             "the cache's figures forwarded")
        load = service.load
        message = load_to_proto(worker_pb2.GetDecodeLoadResponse, load)
        figures = (message.cached_pages, message.checkpoints, message.checkpoint_slots)
        assert figures == (load.cached_pages, load.checkpoints, load.checkpoint_slots)
        assert all(figure > 0 for figure in figures) if cache else figures == (0, 0, 0)
        assert message.prefix_queried_tokens == message.prefix_hit_tokens == 0  # no lookup on the decode side yet
    finally:
        await _stopped(service, receivers)


def test_a_hit_travels_from_the_engine_to_the_load_answer():
    """The engine process's Load message carries its engine's prefix-cache figures and the worker's EngineView /
    LoadSnapshot / GetDecodeLoad read them unchanged: after a K3 hit (pdserve-k3-tiny, two prompts sharing 64
    tokens) hit and queried tokens, pages, checkpoints and slots are all non-zero; without a cache all zero."""
    prompt = [5 + i % 200 for i in range(70)]
    for cache in (True, False):
        config = EngineConfig(model_dir=str(MODELS_DIR / "pdserve-k3-tiny"), page_size=PAGE_SIZE,
                              kv_memory_bytes=24 * 2**20, prefix_cache=cache, state_checkpoint_interval=32)
        with LLMEngine(config) as engine:
            for rid, tokens in (("a", prompt + [9]), ("b", prompt + [11, 12])):
                engine.add_request(rid, tokens, SamplingParams(max_new_tokens=2, temperature=0.0))
                while engine.has_work():
                    engine.step()
            stats = engine.prefix_cache_stats
            view = EngineView(EngineFacts(engine.config, engine.cache_shape, (), engine.device, 4096,
                                          engine.allocator.num_pages, engine.num_state_slots, load_of(engine)))
            message = load_to_proto(worker_pb2.GetDecodeLoadResponse, snapshot_of(view, 0))
        figures = (message.prefix_hit_tokens, message.prefix_queried_tokens, message.cached_pages,
                   message.checkpoints, message.checkpoint_slots)
        assert figures == (stats.hit_tokens, stats.queried_tokens, stats.cached_pages, stats.checkpoints,
                           stats.checkpoint_slots)
        if cache:
            assert message.prefix_hit_tokens == 64 and all(figure > 0 for figure in figures)
        else:
            assert figures == (0, 0, 0, 0, 0)


@pytest.mark.parametrize("k3", [False, True], ids=["deepseek", "k3"])
async def test_kv_events_mirror_equals_the_engine_cache(service_model, tmp_path, k3):
    """The decode worker's mirror of its engine process's KV events (ProcessPort.kv_events, what WatchKVEvents
    serves) ends with exactly the pages and checkpoints the same requests leave in an engine on a thread
    (its own log, whose contents PrefixCache.check_consistency ties to the cache's nodes), and holds the
    engine's first pages of the prompt under the keys the gateway computes (engine/cache/page_keys.py)."""
    from engine.cache.page_keys import page_keys

    model = make_k3_service_model(tmp_path) if k3 else service_model
    contents = {}
    for engine_process in (False, True):
        config = _config(model, kv_memory_bytes=2 * 2**20, max_running=3) if k3 else _config(model)
        service, receivers = await _started(config, engine_process=engine_process)
        try:
            for index in range(2):
                await _generate(service, f"e{index}", 20)
            await eventually(lambda: service.load.running == 0, "the requests finished")
            if engine_process:
                log = service.kv_events
                await eventually(lambda: log.sequence > 1, "the engine's events in the mirror")
            else:
                engine = service._port.engine_thread.engine
                log = engine.kv_events
                engine.prefix_cache.check_consistency()
            snapshot = log.snapshot()
            contents[engine_process] = ({(p.key, p.parent) for p in snapshot.pages}, set(snapshot.checkpoints),
                                        snapshot.root, snapshot.page_size)
        finally:
            await _stopped(service, receivers)
    assert contents[True] == contents[False]
    pages, checkpoints, root, page_size = contents[True]
    assert page_size == PAGE_SIZE and {key for key, _ in pages} >= set(page_keys(root, PROMPT, PAGE_SIZE))
    assert bool(checkpoints) is k3  # K3 keeps a decode checkpoint at the end of each request

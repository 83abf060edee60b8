"""Reservations that start from the decode engine's prefix cache (decode_worker/leases.allocate_admitted and
free_lease; LLMEngine.add_prefilled / add_local_prefill with the hit; engine/runtime/reserved_prompts.py), on a real
engine of models/pdserve-tiny and of the K3 model (KDA state: checkpoints pinned by the lease).

Invariants, checked after every operation of a seeded random run (reserve, refused reserve, release, claim by a
prefilled request then abort, claim by a local prefill that runs to its end or is aborted part-way):
- the prefix cache's bookkeeping holds (PrefixCache.check_consistency: references vs evictable pages, parents held);
- a live reservation holds one reference on each of its pages, so none of its hit pages can be evicted;
- a refused reservation leaves the references as they were;
- once every reservation and request is gone every page is free (cached or on the free list), no checkpoint is
  pinned and every state slot is free: each path gave each reference back exactly once."""
from __future__ import annotations

import random

import pytest

from decode_worker.leases import allocate_admitted, free_lease
from engine.engine_config import EngineConfig
from engine.paths import DSV3_MODEL_DIR, K3_MODEL_DIR
from engine.runtime.llm_engine import LLMEngine
from engine.runtime.reserved_prompts import PromptReservation
from engine.sampling_params import SamplingParams
from rpc.status import ResourceExhausted
from tests.services.helpers import token_prompts

BASE = token_prompts((300,), seed=21)[0]
TAILS = token_prompts((1, 7, 16, 30, 45, 80), seed=22)


@pytest.fixture(scope="module", params=[DSV3_MODEL_DIR, K3_MODEL_DIR], ids=["pdserve-tiny", "k3-default"])
def engine(request: pytest.FixtureRequest):
    config = EngineConfig(model_dir=str(request.param), attention_backend="torch", kv_memory_bytes=48 * 2**20,
                          num_threads=1, prefill_tokens_while_decoding=64)
    with LLMEngine(config) as engine:
        for index, tail in enumerate(TAILS[:2]):  # fill the cache (and, for K3, its prefill checkpoints)
            engine.add_request(f"warm{index}", BASE + tail, SamplingParams(max_new_tokens=3, temperature=0.0))
        _drain(engine)
        yield engine


def _drain(engine: LLMEngine) -> None:
    for _ in range(10_000):
        if not engine.has_work():
            return
        engine.step()
    raise AssertionError("the engine never ran out of work")


def _check(engine: LLMEngine, live: dict[str, tuple[list[int], PromptReservation]]) -> None:
    engine.prefix_cache.check_consistency()
    for _, reservation in live.values():
        assert all(engine.allocator.refcount(page) >= 1 for page in reservation.page_ids)


def test_local_prefill_from_a_hit_equals_a_cold_run(engine):
    """(First: the random runs below publish pages whose KV was never written.) add_local_prefill from a reservation's hit (K3: restored from its checkpoint, hit pages past it its branch)
    produces the greedy tokens of the same prompt run without the cache (a fresh engine with prefix_cache off)."""
    prompt = BASE + TAILS[3]
    reservation = allocate_admitted(engine, len(prompt), engine.config.spec_block_size, 0, prompt)
    assert reservation.hit.cached_pages > 0
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    engine.add_local_prefill("local", prompt, reservation.page_ids, params, reservation.state_slot, reservation.hit)
    tokens: list[int] = []
    for _ in range(1000):
        if not engine.has_work():
            break
        tokens += [t for out in engine.step() if out.request_id == "local" for t in out.new_token_ids]
    assert tokens == _cold_tokens(engine, prompt, params) and len(tokens) == 6
    assert engine.num_free_pages == engine.allocator.num_pages


def _cold_tokens(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[int]:
    """The prompt's greedy tokens on a fresh engine of the same model with the prefix cache off."""
    cold_config = EngineConfig(model_dir=engine.config.model_dir, attention_backend="torch",
                               kv_memory_bytes=48 * 2**20, num_threads=1, prefix_cache=False)
    with LLMEngine(cold_config) as cold:
        cold.add_request("cold", prompt, params)
        expected: list[int] = []
        while cold.has_work():
            expected += [t for out in cold.step() if out.request_id == "cold" for t in out.new_token_ids]
    return expected


def test_local_prefill_past_the_checkpoint_joins_the_branch(engine):
    """A hit whose cached pages run past its last checkpoint (K3): the local prefill recomputes those pages once as
    its branch, swaps them for the cached ones and checkpoints there, so the next reservation of the same prompt is
    checkpointed to the whole hit; the tokens equal a cold run's. Without KDA state there is no branch: every hit
    page is usable at once."""
    warm = BASE + TAILS[5]
    engine.add_request("branch-warm", warm, SamplingParams(max_new_tokens=2, temperature=0.0))
    _drain(engine)
    prompt = BASE + TAILS[5][:60] + TAILS[4][:10]
    block = engine.config.spec_block_size
    reservation = allocate_admitted(engine, len(prompt), block, 0, prompt)
    hit = reservation.hit
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    if engine.state_pool is not None:
        assert 0 < hit.checkpoint_pages < hit.cached_pages  # a branch of cached pages past the checkpoint
    else:
        assert hit.checkpoint_pages == 0 and hit.cached_pages == (len(BASE) + 60) // engine.config.page_size
    engine.add_local_prefill("branch-local", prompt, reservation.page_ids, params, reservation.state_slot, hit)
    tokens: list[int] = []
    for _ in range(1000):
        if not engine.has_work():
            break
        tokens += [t for out in engine.step() if out.request_id == "branch-local" for t in out.new_token_ids]
    assert tokens == _cold_tokens(engine, prompt, params)
    again = allocate_admitted(engine, len(prompt), block, 0, prompt)
    try:
        assert again.hit.cached_pages >= hit.cached_pages
        if engine.state_pool is not None:  # the branch's end was checkpointed: the whole old hit is usable now
            assert again.hit.checkpoint_pages >= hit.cached_pages
    finally:
        free_lease(engine, again.page_ids, again.state_slot, again.hit.checkpoint)
    engine.prefix_cache.check_consistency()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_path_gives_each_reference_back_once(engine, seed):
    rng = random.Random(seed)
    block = engine.config.spec_block_size
    pinned_before = dict(engine.prefix_cache.checkpoints._pins) if engine.prefix_cache.checkpoints else {}
    assert not pinned_before
    live: dict[str, tuple[list[int], PromptReservation]] = {}
    hits = 0
    for step in range(40):
        op = rng.choice(["reserve", "reserve", "refused", "release", "claim", "local"])
        prompt = BASE[: rng.randrange(40, len(BASE))] + rng.choice(TAILS)
        if op == "reserve" or (op != "refused" and not live):
            reservation = allocate_admitted(engine, len(prompt), block, 0, prompt)
            hits += reservation.hit.cached_pages > 0
            assert len(reservation.page_ids) == -(-len(prompt) // engine.config.page_size)
            assert reservation.hit.cached_pages * engine.config.page_size < len(prompt)
            live[f"r{seed}-{step}"] = (prompt, reservation)
        elif op == "refused":
            refs = [engine.allocator.refcount(page) for page in range(engine.allocator.num_pages)]
            with pytest.raises(ResourceExhausted):
                allocate_admitted(engine, len(prompt), block, 10**6, prompt)  # headroom for a million requests
            assert refs == [engine.allocator.refcount(page) for page in range(engine.allocator.num_pages)]
        else:
            request_id = rng.choice(sorted(live))
            prompt, reservation = live.pop(request_id)
            params = SamplingParams(max_new_tokens=2, temperature=0.0)
            if op == "release":
                free_lease(engine, reservation.page_ids, reservation.state_slot, reservation.hit.checkpoint)
            elif op == "claim":  # (no KV was written: the request is aborted before any step reads it)
                engine.add_prefilled(request_id, prompt, 5, reservation.page_ids, params, reservation.state_slot,
                                     reservation.hit)
                assert engine.abort(request_id)
                engine.step()  # collects the aborted request
            else:
                engine.add_local_prefill(request_id, prompt, reservation.page_ids, params, reservation.state_slot,
                                         reservation.hit)
                if rng.random() < 0.5:
                    engine.step()  # one prefill chunk, then gone
                    engine.abort(request_id)
                _drain(engine)
        _check(engine, live)
    assert hits, "no reservation found a cached page: the run tested nothing of the hits"
    for prompt, reservation in live.values():
        free_lease(engine, reservation.page_ids, reservation.state_slot, reservation.hit.checkpoint)
    _drain(engine)
    engine.prefix_cache.check_consistency()
    assert engine.num_free_pages == engine.allocator.num_pages
    assert all(engine.allocator.refcount(page) == 0 for page in range(engine.allocator.num_pages))
    if engine.prefix_cache.checkpoints is not None:
        assert not engine.prefix_cache.checkpoints._pins
        assert engine.num_free_state_slots == engine.num_state_slots

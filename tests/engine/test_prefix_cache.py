"""Prefix cache exactness on the embedded checkpoints (pdserve-tiny: DeepSeek-V3 shape, pdserve-k3-tiny: K3 with
KDA layers), each with its draft (speculation on), against the same engine with the cache off.

Invariants: a request served partly from the cache emits the same greedy tokens as with the cache off and the
same logprobs (top 5 at every generated position) within 1e-4; it reports how many prompt tokens it took from
the cache; a hit never covers a page after a changed token (negative control), on K3 never goes past the last
state checkpoint, and a checkpoint whose pages were evicted is never used."""
from __future__ import annotations

import logging

import pytest
import torch

from engine import SamplingParams
from engine.engine_config import EngineConfig
from engine.runtime.llm_engine import LLMEngine
from engine.paths import MODELS_DIR

TINY = str(MODELS_DIR / "pdserve-tiny")
K3 = str(MODELS_DIR / "pdserve-k3-tiny")
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, logprobs=5)


def _prompt(seed: int, length: int) -> list[int]:
    return torch.randint(3, 3000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams = GREEDY):
    """One request alone to completion: (tokens, logprobs, num_cached_tokens)."""
    engine.add_request(rid, prompt, params)
    tokens, logprobs, cached = [], [], None
    while engine.has_work():
        for out in engine.step():
            tokens += out.new_token_ids
            logprobs += out.logprobs
            cached = out.num_cached_tokens
    return tokens, logprobs, cached


def _assert_same(got, want) -> None:
    assert got[0] == want[0]
    assert len(got[1]) == len(want[1]) == len(got[0])
    for a, b in zip(got[1], want[1]):
        assert a.top_ids == b.top_ids
        assert max(abs(x - y) for x, y in zip([a.logprob] + a.top_logprobs, [b.logprob] + b.top_logprobs)) <= 1e-4


def _engines(model_dir: str, **options):
    base = dict(model_dir=model_dir, page_size=16, kv_memory_bytes=48 * 2**20, **options)
    return LLMEngine(EngineConfig(prefix_cache=False, **base)), LLMEngine(EngineConfig(prefix_cache=True, **base))


@pytest.mark.parametrize("options", [{}, {"max_batched_tokens": 24}], ids=["whole", "chunked"])
def test_deepseek_tiny_hits_are_exact(options):
    """pdserve-tiny: B shares 70 tokens with A (hit ends inside a page: 64 cached), C changes token 40 (only the
    first 2 pages hit), D repeats A's prompt exactly (the last token is computed: 4 of 5 pages hit)."""
    off, on = _engines(TINY, **options)
    with off, on:
        base = _prompt(0, 70)
        prompts = {"a": base + [7, 8, 9, 10, 11, 12, 13, 14, 15, 16],
                   "b": base + [21, 22, 23],
                   "c": base[:40] + [base[40] + 1] + base[41:] + [31],
                   "d": base + [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]}
        want_cached = {"a": 0, "b": 64, "c": 32, "d": 64}
        for rid, prompt in prompts.items():
            want = _run(off, rid, prompt)
            got = _run(on, rid, prompt)
            _assert_same(got, want)
            assert got[2] == want_cached[rid], rid
            assert want[2] == 0
        stats = on.prefix_cache_stats
        assert stats.hit_tokens == sum(want_cached.values()) and stats.queried_tokens == sum(map(len, prompts.values()))
        assert on.num_free_pages == on.allocator.num_pages and stats.cached_pages > 0
        assert off.prefix_cache_stats.cached_pages == 0


@pytest.mark.parametrize("model", [TINY, K3], ids=["pdserve-tiny", "k3"])
def test_tp2_hits_are_exact(model):
    """TP=2 (two processes; one TP group per process at a time, so the engines run one after the other): a
    shared prefix of 50 tokens hits 3 pages (K3: the first prompt's last page boundary, 48, is checkpointed; each
    rank restores its own share of the state) and the outputs equal the TP=2 cache-off engine's."""
    base = _prompt(1, 50)
    requests = (("a", base + [5, 6]), ("b", base + [9]))
    results = {}
    for cache in (False, True):
        config = EngineConfig(model_dir=model, tp_size=2, attention_backend="torch", page_size=16,
                              kv_memory_bytes=48 * 2**20, prefix_cache=cache, state_checkpoint_interval=32)
        with LLMEngine(config) as engine:
            results[cache] = [_run(engine, rid, prompt) for rid, prompt in requests]
    for got, want in zip(results[True], results[False]):
        _assert_same(got, want)
    assert [got[2] for got in results[True]] == [0, 48]


def test_k3_hits_end_on_checkpoints_and_are_exact():
    """pdserve-k3-tiny, checkpoints every 32 tokens: B shares 80 tokens with A (5 full pages match, the hit ends
    on the checkpoint at 64, between the 64 and 96 ones; B recomputes 64..80 and checkpoints there, a branch
    point); with the 80 and 64 checkpoints dropped C (same prompt as B) falls back to 32; after every cached page
    is evicted (and with it every checkpoint) D hits nothing; E changes token 10 (negative control: nothing
    before the first checkpoint is usable)."""
    off, on = _engines(K3, state_checkpoint_interval=32)
    with off, on:
        base = _prompt(2, 80)
        a = base + _prompt(3, 30)
        b = base + [17, 18, 19]
        for rid, prompt, cached in (("a", a, 0), ("b", b, 64)):
            _assert_same(got := _run(on, rid, prompt), _run(off, rid, prompt))
            assert got[2] == cached, rid
        cache = on.prefix_cache
        key64 = cache.chain(cache.chain(cache.chain(cache.chain(cache.root, base[:16]), base[16:32]), base[32:48]),
                            base[48:64])
        cache.drop_checkpoint(cache.chain(key64, base[64:80]))
        cache.drop_checkpoint(key64)
        _assert_same(got := _run(on, "c", b), _run(off, "c", b))
        assert got[2] == 32
        before = on.prefix_cache_stats
        assert before.checkpoints > 0
        pages = on.allocate_pages(on.num_free_pages * 16)  # takes every free page: evicts the whole cache
        on.free_pages(pages)
        after = on.prefix_cache_stats
        assert after.cached_pages == 0 and after.checkpoints == 0 and after.evicted_checkpoints >= before.checkpoints
        _assert_same(got := _run(on, "d", b), _run(off, "d", b))
        assert got[2] == 0
        e = list(a)
        e[10] += 1
        _assert_same(got := _run(on, "e", e), _run(off, "e", e))
        assert got[2] == 0
        assert on.num_free_pages == on.allocator.num_pages
        assert on.num_free_state_slots == on.num_state_slots


@pytest.mark.parametrize("options", [{}, {"max_batched_tokens": 24}], ids=["whole", "chunked"])
def test_k3_branch_point_hits_are_exact(options):
    """pdserve-k3-tiny, checkpoints every 64 tokens: A (130 tokens) leaves checkpoints at 64 and 128; B shares
    100 tokens (6 full pages, the last checkpoint at 64): it restores 64, its chunk ends at the matched run's end
    (96, a branch point, not 112, its prompt's last page boundary; also with 24-token chunks) and checkpoints
    there; C shares the same 100 tokens and hits
    all 96 from the branch-point checkpoint; E changes token 70 (inside the branch's first page: negative
    control, only the 64 before it hit). Every output equals the cache-off engine's (tokens, top-5 logprobs
    within 1e-4)."""
    off, on = _engines(K3, state_checkpoint_interval=64, **options)
    with off, on:
        base = _prompt(8, 100)
        e = list(base)
        e[70] += 1
        requests = (("a", base + _prompt(9, 30), 0), ("b", base + _prompt(10, 20), 64),
                    ("c", base + [31, 32, 33], 96), ("e", e + [31, 32, 33], 64))
        checkpoints = []
        for rid, prompt, cached in requests:
            got = _run(on, rid, prompt)
            _assert_same(got, _run(off, rid, prompt))
            assert got[2] == cached, rid
            checkpoints.append(on.prefix_cache_stats.checkpoints)
        assert checkpoints[1] > checkpoints[0]  # B saved the branch point's checkpoint
        assert on.num_free_pages == on.allocator.num_pages
        assert on.num_free_state_slots == on.num_state_slots


@pytest.mark.parametrize("speculative", [False, None], ids=["plain", "spec"])
def test_k3_next_turn_resumes_from_the_finished_request(speculative):
    """Multi-turn: turn 2 = turn 1's prompt + its output + a new message hits past turn 1's prompt (a checkpoint
    taken while turn 1 decoded: from the slot on plain steps, from the verify scratch when a speculative step
    passes a page boundary)."""
    params = SamplingParams(max_new_tokens=40, temperature=0.0, logprobs=5, speculative=speculative)
    off, on = _engines(K3)
    with off, on:
        turn1 = _prompt(4, 45)
        want1 = _run(off, "t1", turn1, params)
        _assert_same(_run(on, "t1", turn1, params), want1)
        turn2 = turn1 + want1[0] + [40, 41, 42]
        got = _run(on, "t2", turn2, params)
        _assert_same(got, _run(off, "t2", turn2, params))
        assert got[2] >= (len(turn1) + len(want1[0]) - 1) // 16 * 16 - 16 and got[2] > len(turn1)


def test_k3_checkpoint_pool_stays_within_its_share(caplog):
    """The checkpoint pool takes at most checkpoint_memory_fraction of kv_memory_bytes, pages + slots + verify
    scratch + checkpoints stay within kv_memory_bytes, and the start-up line gives pages, slots and checkpoints."""
    budget = 48 * 2**20
    with caplog.at_level(logging.INFO, logger="engine.runtime.llm_engine"):
        engine = LLMEngine(EngineConfig(model_dir=K3, kv_memory_bytes=budget, checkpoint_memory_fraction=0.25))
    with engine:
        runner, state = engine.runner, engine.state_pool
        tensors = [runner.cache.kv, runner.cache.draft, state.raw, state.snapshot_conv, state.snapshot_recurrent,
                   runner.checkpoints]
        used = sum(t.numel() * t.element_size() for t in tensors if t is not None)
        checkpoint_bytes = runner.checkpoints.numel()
        assert 0 < checkpoint_bytes <= budget // 4 and used <= budget
        slots = engine.prefix_cache_stats.checkpoint_slots
        assert slots == runner.checkpoints.shape[0] == budget // 4 // state.shape.slot_stride
    line = next(r.getMessage() for r in caplog.records if "engine ready" in r.getMessage())
    assert f"{slots} checkpoint slots" in line and f"{engine.num_state_slots} state slots" in line

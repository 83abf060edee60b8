"""Core lending on real processes (rpc/core_board.py, `pdserve up`'s default on a CPU node): a prefill worker
pinned to CPU 0 and a decode worker pinned to CPU 1 share a board; the decode worker runs steps on both CPUs
while the prefill worker is idle (its metric counts them), its outputs stay those of the in-process engine, and
the board lives in the deployment's run directory (gone after stop); and the other way, the prefill worker
on the idle decode worker's CPU."""
from __future__ import annotations

import asyncio
import os
from pathlib import Path

import aiohttp
import pytest

from tests.services.conftest import MAX_TOKENS, PROMPTS, launch
from tests.services.helpers import greedy_through_gateway, scrape

pytestmark = pytest.mark.slow


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="core lending needs two CPUs to lend between")
async def test_decode_borrows_idle_prefill_cores_and_outputs_stay_exact(service_model: Path, reference,
                                                                        tmp_path: Path):
    prefill_cpu, decode_cpu = sorted(os.sched_getaffinity(0))[:2]
    (tmp_path / "logs").mkdir()
    cluster = launch(service_model, tmp_path / "logs", prefill_args=("--cpus", str(prefill_cpu)),
                     decode_args=("--cpus", str(decode_cpu)), lend_cpus=str(prefill_cpu))
    try:
        board = cluster._board
        assert board is not None and Path(board).is_file()
        prompts, expected = PROMPTS[:6], reference[False][:6]
        for prompt, tokens in zip(prompts, expected):  # one at a time: the prefill worker idles between
            result = (await greedy_through_gateway(cluster.gateway_address, [prompt], MAX_TOKENS, False))[0]
            assert list(result.token_ids) == tokens
        results = await greedy_through_gateway(cluster.gateway_address, prompts, MAX_TOKENS, False)
        assert [list(result.token_ids) for result in results] == expected  # decode and prefill overlapping
        async with aiohttp.ClientSession() as http:
            samples = await scrape(http, cluster.metrics_addresses()["decode-0"])
        steps = samples[("pdserve_decode_engine_steps_total", frozenset())]
        borrowed = samples[("pdserve_decode_borrowed_core_steps_total", frozenset())]
        assert steps > 0 and borrowed > 0
        log = (tmp_path / "logs" / "decode-0.log").read_text()
        assert "core lending: 1 own core(s), 1 more while prefill is idle" in log
    finally:
        await asyncio.to_thread(cluster.stop)
    assert not Path(board).exists()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="core lending needs two CPUs to lend between")
async def test_prefill_borrows_the_idle_decode_core_and_outputs_stay_exact(service_model: Path, reference,
                                                                          tmp_path: Path):
    """The other way round (lend_back_cpus): with the decode worker idle, the prefill worker runs its steps on the
    decode CPU too (its metric counts them, its log says so, its steps are capped at 512 tokens); outputs exact,
    one request at a time and several overlapping (then the decode worker takes its core back)."""
    prefill_cpu, decode_cpu = sorted(os.sched_getaffinity(0))[:2]
    (tmp_path / "logs").mkdir()
    cluster = launch(service_model, tmp_path / "logs", prefill_args=("--cpus", str(prefill_cpu)),
                     decode_args=("--cpus", str(decode_cpu)), lend_cpus=str(prefill_cpu),
                     lend_back_cpus=str(decode_cpu))
    try:
        prompts, expected = PROMPTS[:6], reference[False][:6]
        for prompt, tokens in zip(prompts[:2], expected[:2]):  # one at a time: the decode worker idles meanwhile
            result = (await greedy_through_gateway(cluster.gateway_address, [prompt], MAX_TOKENS, False))[0]
            assert list(result.token_ids) == tokens
        results = await greedy_through_gateway(cluster.gateway_address, prompts, MAX_TOKENS, False)
        assert [list(result.token_ids) for result in results] == expected
        async with aiohttp.ClientSession() as http:
            samples = await scrape(http, cluster.metrics_addresses()["prefill-0"])
        assert samples[("pdserve_prefill_borrowed_core_steps_total", frozenset())] > 0
        log = (tmp_path / "logs" / "prefill-0.log").read_text()
        assert "core lending: 1 own core(s), 1 more while decode is idle (2 thread(s) then, steps of <= 512" in log
    finally:
        await asyncio.to_thread(cluster.stop)

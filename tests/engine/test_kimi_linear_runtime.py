"""Kimi Linear through the engine: state slots follow sequences (finish, abort, preemption), greedy
generation equals transformers', and TP=2 equals TP=1
(speculative decoding with KDA layers: tests/engine/test_spec_hybrid.py)."""
from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine import LLM, SamplingParams
from engine.attention.head_padding import HeadPaddedBackend
from engine.attention.torch_backend import TorchAttentionBackend
from engine.runtime.distributed import TPGroup
from engine.runtime.forward_batch import ForwardMode
from engine.models.kimi_linear import load_model
from tests.engine.kimi_linear_models import KIMI_VARIANTS, StatefulRunner, make_kimi_checkpoint

PROMPTS = [[5, 6, 7, 8], list(range(9, 80)), [3] * 37]
GREEDY = SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def kimi_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("kimi_runtime")
    return {variant: make_kimi_checkpoint(root, variant) for variant in KIMI_VARIANTS}


def test_finish_and_abort_free_the_slot(kimi_dirs):
    """A slot is taken with the first prefill chunk and returned on abort and on finish."""
    with LLM(str(kimi_dirs["base"]), attention_backend="torch", draft_model="") as llm:
        engine = llm.engine
        baseline = engine.state_pool.num_free
        params = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
        engine.add_request("a", PROMPTS[0], params)
        engine.add_request("b", PROMPTS[1], params)
        engine.step()
        assert engine.state_pool.num_free == baseline - 2
        assert engine.abort("b")
        assert engine.state_pool.num_free == baseline - 1
        while engine.has_work():
            engine.step()
        assert engine.state_pool.num_free == baseline
        llm.logits(PROMPTS[1])  # full_logits borrows a slot and gives it back
        assert engine.state_pool.num_free == baseline


@pytest.mark.slow
def test_preemption_recomputes_state_from_zero(kimi_dirs, caplog):
    """With a pool so small that sequences are preempted (slots freed, state recomputed from a zeroed
    slot) and prefill chunked in 7s, greedy outputs equal an unconstrained engine's; slots and pages
    all come back."""
    model_dir = str(kimi_dirs["heads24"])
    prompts = [list(range(3, 3 + n)) for n in (3, 30, 17, 45, 8, 21)]
    params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    with LLM(model_dir, attention_backend="torch", draft_model="") as llm:
        expected = llm.generate(prompts, params)
    slot_bytes = 2 * (2 * 3 * 48 * 4 + 6 * 8 * 8 * 4)  # 2 KDA layers x (conv window + recurrent state), fp32
    with caplog.at_level(logging.INFO, logger="engine.runtime.llm_engine"):
        with LLM(model_dir, attention_backend="torch", draft_model="", max_batched_tokens=7, max_running=3,
                 page_size=4, kv_memory_bytes=8 * slot_bytes, prefix_cache=False) as llm:  # the cache-off split
            engine = llm.engine
            assert engine.state_pool.num_slots == 4 and engine.allocator.num_pages == 33
            assert llm.generate(prompts, params) == expected
            assert engine.state_pool.num_free == 4 and engine.num_free_pages == 33
    assert "preempted" in caplog.text


def _reference_greedy(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import KimiLinearForCausalLM

    model = KimiLinearForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=64, min_new_tokens=64, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in prompts]


@pytest.mark.slow
@pytest.mark.parametrize("variant", KIMI_VARIANTS)
def test_greedy_generation_matches_transformers(kimi_dirs, variant):
    """64 greedy tokens from 3 prompts through engine.LLM are identical to transformers' generate."""
    with LLM(str(kimi_dirs[variant]), attention_backend="torch", draft_model="") as llm:
        assert llm.generate(PROMPTS, GREEDY) == _reference_greedy(kimi_dirs[variant], PROMPTS)


@pytest.mark.slow
def test_engine_tp2_equals_tp1(kimi_dirs):
    """TP=2 through the engine (a follower process holding its own state pool) gives the TP=1 logits
    within 1e-4 and identical greedy generations."""
    model_dir = str(kimi_dirs["heads24"])
    with LLM(model_dir, attention_backend="torch", draft_model="") as llm:
        logits1, out1 = llm.logits(PROMPTS[1]), llm.generate(PROMPTS, GREEDY)
    with LLM(model_dir, tp_size=2, attention_backend="torch", draft_model="") as llm:
        logits2, out2 = llm.logits(PROMPTS[1]), llm.generate(PROMPTS, GREEDY)
    assert (logits1 - logits2).abs().max().item() < 1e-4
    assert out1 == out2


def _scenario(model_dir: Path, tp: TPGroup) -> dict[str, torch.Tensor]:
    """Batched prefill, a continued chunk and a mixed decode; MLA heads padded to 16 or 32 per rank."""
    attention = HeadPaddedBackend(TorchAttentionBackend(), (16, 32))
    config, model = load_model(model_dir, tp, attention, torch.float32)
    runner = StatefulRunner(model, config)
    out = {"prefill": runner.step(ForwardMode.EXTEND, [(0, PROMPTS[1][:50]), (1, PROMPTS[2])])[0],
           "chunk": runner.step(ForwardMode.EXTEND, [(0, PROMPTS[1][50:])])[0],
           "decode": runner.step(ForwardMode.DECODE, [(0, [4]), (1, [5])])[0]}
    out["state"] = runner.state_of(0)[1]
    return out


def _worker(rank: int, port: int, model_dirs: list[Path], result_dir: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        results = {str(path): _scenario(path, TPGroup(rank=rank, size=2)) for path in model_dirs}
        torch.save(results, result_dir / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_model_tp2_equals_tp1(kimi_dirs, tmp_path):
    """Both TP=2 ranks return the TP=1 logits (1e-4) for every variant (heads24: 12 MLA heads per rank
    padded to 16); the rank's state holds its half of the KDA heads."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    model_dirs = [kimi_dirs[v] for v in KIMI_VARIANTS]
    mp.spawn(_worker, args=(port, model_dirs, tmp_path), nprocs=2, join=True)
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        for path in model_dirs:
            expected = _scenario(path, TPGroup())
            got = results[str(path)]
            for key in ("prefill", "chunk", "decode"):
                torch.testing.assert_close(got[key], expected[key], atol=1e-4, rtol=0, msg=f"{path.name} {key}")
            heads = expected["state"].shape[1] // 2
            local = expected["state"][:, rank * heads : (rank + 1) * heads]
            torch.testing.assert_close(got["state"], local, atol=1e-4, rtol=0, msg=f"{path.name} state")

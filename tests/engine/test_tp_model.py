"""Tensor parallelism changes nothing but speed: TP=2 (two gloo processes) gives the TP=1 logits on
every rank, through batched prefill, chunked prefill and absorbed decode, for every tiny variant
(heads24 runs 12 heads per rank)."""
from __future__ import annotations

import pytest

import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.attention.torch_backend import TorchAttentionBackend
from engine.runtime.distributed import TPGroup
from engine.runtime.forward_batch import ForwardMode
from engine.models.deepseek_v3 import load_model
from tests.engine.tiny_models import VARIANTS, PagedRunner

TOL = 1e-4


def _scenario(model_dir: Path, tp: TPGroup) -> dict[str, torch.Tensor]:
    """Runs the same steps at any TP size; returns the logits of each step and one captured layer."""
    config, model = load_model(model_dir, tp, TorchAttentionBackend(), torch.float32)
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=generator).tolist() for n in (23, 9)]
    runner = PagedRunner(model, config)
    out: dict[str, torch.Tensor] = {}
    out["prefill"], captured = runner.step(ForwardMode.EXTEND, [(0, prompts[0][:15]), (1, prompts[1])], capture_layers=(0,))
    out["captured"] = captured.captured[0]
    out["chunk"], _ = runner.step(ForwardMode.EXTEND, [(0, prompts[0][15:20])])
    out["decode"], _ = runner.step(ForwardMode.DECODE, [(0, prompts[0][20:]), (1, [3])])
    out["embed"] = model.embed(torch.tensor([0, config.vocab_size // 2, config.vocab_size - 1]))
    return out


def _worker(rank: int, world_size: int, port: int, model_dirs: list[Path], result_dir: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        tp = TPGroup(rank=rank, size=world_size)
        results = {str(path): _scenario(path, tp) for path in model_dirs}
        torch.save(results, result_dir / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_tp2_logits_equal_tp1(tiny_checkpoint, tmp_path: Path) -> None:
    """Both TP=2 ranks return the TP=1 logits (1e-4), captured hidden states and embeddings."""
    model_dirs = [tiny_checkpoint(variant) for variant in VARIANTS]
    mp.spawn(_worker, args=(2, _free_port(), model_dirs, tmp_path), nprocs=2, join=True)
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        for path in model_dirs:
            expected = _scenario(path, TPGroup())
            got = results[str(path)]
            assert got.keys() == expected.keys()
            for key in expected:
                torch.testing.assert_close(got[key], expected[key], atol=TOL, rtol=0, msg=f"{path.name} {key} rank {rank}")

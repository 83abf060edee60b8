"""Tensor parallelism changes nothing but speed for Kimi K3: TP=2 (two gloo processes; 24 KDA / MLA heads
-> 12 per rank, experts 4 per rank, the latent sum all-reduced before its norm) gives the TP=1 logits and
captured streams on every rank, through batched prefill, a chunk and decode steps."""
from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.attention.torch_backend import TorchAttentionBackend
from engine.runtime.distributed import TPGroup
from engine.runtime.forward_batch import ForwardMode
from engine.models.kimi_k3 import load_model
from tests.engine.k3_checkpoint import make_k3_checkpoint
from tests.engine.k3_runner import HybridRunner

TOL = 1e-4
VARIANTS = {"hybrid": {}, "mla_only": dict(linear_attn_config={"kda_layers": [], "full_attn_layers": list(range(1, 9))}),
            "bf16_experts": dict(experts="bf16")}  # unquantised routed experts, 4 per rank


def _scenario(model_dir: Path, tp: TPGroup) -> dict[str, torch.Tensor]:
    """The same steps at any TP size: logits of each step and one captured layer."""
    _, model = load_model(model_dir, tp, TorchAttentionBackend(), torch.float32)
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 320, (n,), generator=generator).tolist() for n in (23, 9)]
    runner = HybridRunner(model)
    out: dict[str, torch.Tensor] = {}
    out["prefill"], captured = runner.step(ForwardMode.EXTEND, [(0, prompts[0][:15]), (1, prompts[1])], capture_layers=(3,))
    out["captured"] = captured.captured[0]
    out["chunk"], _ = runner.step(ForwardMode.EXTEND, [(0, prompts[0][15:20])])
    out["decode"], _ = runner.step(ForwardMode.DECODE, [(0, prompts[0][20:21]), (1, [3])])
    out["decode2"], _ = runner.step(ForwardMode.DECODE, [(0, prompts[0][21:22]), (1, [5])])
    return out


def _worker(rank: int, world_size: int, port: int, model_dirs: list[Path], result_dir: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        tp = TPGroup(rank=rank, size=world_size)
        torch.save({str(path): _scenario(path, tp) for path in model_dirs}, result_dir / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_k3_tp2_equals_tp1(tmp_path: Path) -> None:
    """Both TP=2 ranks return the TP=1 logits and captured stream within 1e-4."""
    model_dirs = [make_k3_checkpoint(tmp_path / "ckpt", name, 0, **over) for name, over in VARIANTS.items()]
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    mp.spawn(_worker, args=(2, _free_port(), model_dirs, out_dir), nprocs=2, join=True)
    for path in model_dirs:
        expected = _scenario(path, TPGroup())
        for rank in range(2):
            got = torch.load(out_dir / f"rank{rank}.pt")[str(path)]
            assert got.keys() == expected.keys()
            for key in expected:
                torch.testing.assert_close(got[key], expected[key], atol=TOL, rtol=0, msg=f"{path.name} {key} rank {rank}")

"""One copy of the weights per node: a prefill and a decode worker (TP=2 each) map the same shared weight
segments, so the weights are resident about once (not once per rank); outputs are the same with sharing on
and off; SIGKILL of the worker that owns the segments, then stop, leaves nothing in /dev/shm."""
from __future__ import annotations

import asyncio
import os
import re
import signal
from pathlib import Path

import pytest
import torch

from gateway.client import build_request, generate
from pdserve.launcher import Cluster, ClusterSpec
from tests.engine.tiny_models import tiny_config_kwargs
from tests.gateway.text_tokenizer import make_tokenizer
from tests.services.helpers import gateway_stub, token_prompts
from tests.services.processes import alive, descendants

pytestmark = pytest.mark.slow

WEIGHT_SEGMENT = re.compile(r"/dev/shm/(pdserve-w-[0-9a-f]+)")
SIZE = dict(vocab_size=8192, hidden_size=768, intermediate_size=2048, moe_intermediate_size=512, num_hidden_layers=4,
            num_attention_heads=12, q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32,
            v_head_dim=64, n_routed_experts=8, num_experts_per_tok=2)


@pytest.fixture(scope="module")
def big_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """A ~236 MB random DeepSeek-V3-shaped checkpoint (fp32) written by transformers, and its weight bytes."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    out = tmp_path_factory.mktemp("shared_weights") / "model"
    torch.manual_seed(0)
    kwargs = {**tiny_config_kwargs("heads24"), **SIZE}
    kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**kwargs)).float().eval()
    model.save_pretrained(out)
    make_tokenizer(out)
    return out, sum(p.numel() * p.element_size() for p in model.parameters())


def _pss_kib(pid: int) -> tuple[int, int]:
    """(total PSS, PSS of shared weight segments) of one process, in KiB, from /proc/<pid>/smaps."""
    total = weights = 0
    in_weights = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if not line.split()[0].endswith(":"):  # a mapping's header line: "start-end perms offset dev inode path"
            in_weights = bool(WEIGHT_SEGMENT.search(line))
        elif line.startswith("Pss:"):
            kib = int(line.split()[1])
            total += kib
            weights += kib if in_weights else 0
    return total, weights


def _segments(pids: set[int]) -> set[str]:
    names: set[str] = set()
    for pid in pids:
        try:
            names |= set(WEIGHT_SEGMENT.findall(Path(f"/proc/{pid}/maps").read_text()))
        except OSError:
            continue
    return names


def _greedy(address: str, prompts: list[list[int]]) -> list[list[int]]:
    async def run() -> list[list[int]]:
        async with gateway_stub(address) as stub:
            return [(await generate(stub, build_request(p, max_tokens=8, temperature=0.0, ignore_eos=True,
                                                         speculative=False), timeout=300)).token_ids for p in prompts]

    return asyncio.run(run())


def _run(model: Path, log_dir: Path, share: bool, kill_owner: bool = False) -> dict[str, object]:
    worker_args = ("--kv-memory-mb", "16", "--num-threads", "1") + (() if share else ("--no-shared-weights",))
    spec = ClusterSpec(model_dir=str(model), listen="127.0.0.1:0", attention_backend="torch", worker_args=worker_args,
                       prefill_tp=2, decode_tp=2, draft_model="")
    log_dir.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(spec, log_dir=log_dir)
    try:
        address = cluster.start(timeout_s=600)
        workers = {c.process.pid for c in cluster.children if not c.role.startswith("gateway")}
        ranks = workers | {pid for leader in workers for pid in descendants(leader)}
        outputs = _greedy(address, token_prompts((5, 40), seed=3))
        pss = [_pss_kib(pid) for pid in sorted(ranks)]
        segments = _segments(ranks)

        if kill_owner:
            owner = next(pid for pid in sorted(ranks) if _owns_a_segment(pid, segments))
            os.kill(owner, signal.SIGKILL)
    finally:
        cluster.stop()
    return {"outputs": outputs, "ranks": ranks, "total_kib": sum(t for t, _ in pss),
            "weights_kib": sum(w for _, w in pss), "segments": segments}


def _owns_a_segment(pid: int, segments: set[str]) -> bool:
    from engine.weights.weight_store import SHM_DIR, _read_header

    for name in segments:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
        try:
            header = _read_header(fd)
        finally:
            os.close(fd)
        if header is not None and header[1] == pid:
            return True
    return False


def test_weights_resident_once_with_sharing(big_model, tmp_path):
    """Sum over the 4 worker ranks of the PSS of shared weight segments <= 1.25x the checkpoint's bytes;
    the same node without sharing holds >= 1.5x more; greedy outputs are identical; SIGKILL of the owner
    then stop leaves no weight segment behind and no rank alive."""
    model, weight_bytes = big_model
    shared = _run(model, tmp_path / "on", share=True, kill_owner=True)
    private = _run(model, tmp_path / "off", share=False)
    assert shared["outputs"] == private["outputs"]
    assert len(shared["segments"]) == 2, "one segment per TP rank, shared by prefill and decode"
    assert private["segments"] == set()
    weights_shared = shared["weights_kib"] * 1024
    non_weight = shared["total_kib"] - shared["weights_kib"]
    weights_private = (private["total_kib"] - non_weight) * 1024
    ratio_on, ratio_off = weights_shared / weight_bytes, weights_private / weight_bytes
    print(f"weight bytes {weight_bytes / 2**20:.1f} MiB: PSS of weights with sharing {ratio_on:.2f}x, "  # noqa: T201
          f"without {ratio_off:.2f}x")
    assert ratio_on <= 1.25, ratio_on
    assert ratio_off >= 1.5 * ratio_on, (ratio_on, ratio_off)
    assert not alive(shared["ranks"]) and not alive(private["ranks"])
    assert not [name for name in shared["segments"] if Path("/dev/shm", name).exists()]

"""benchmarks/peer_vllm.py's pure parts: the workloads both systems get, the checkpoint's vLLM-specific config keys,
and the cached peer environment being reused (nothing installed when its stamp is there)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import psutil

from benchmarks import peer_servers
from benchmarks.peer_vllm import SPECIAL_IDS, ratio_spread, workloads


def _args(**overrides: object) -> argparse.Namespace:
    values = dict(concurrency=[1, 4], prompts_per_slot=2, min_prompts=3, input_len=12, output_len=5, seed=0,
                  long_input=40, long_prompts=2, long_concurrency=2)
    values.update(overrides)
    return argparse.Namespace(**values)


def test_workloads_are_sized_and_fresh_every_round() -> None:
    """One workload per concurrency (max(slot x c, min) requests of exact lengths, no special ids) plus the long
    round; the same round gives the same token ids (both systems see the same requests), another round other
    ones (no round finds the previous one's prompts in pdserve's prefix cache)."""
    first, again, other = workloads(_args(), 0), workloads(_args(), 0), workloads(_args(), 1)
    assert [(label, c, len(reqs)) for label, c, reqs in first] == [
        ("c=1, 12+5", 1, 3), ("c=4, 12+5", 4, 8), ("long c=2, 40+5", 2, 2)]
    for (_, _, reqs), (_, _, same), (_, _, fresh) in zip(first, again, other):
        assert [r.token_ids for r in reqs] == [r.token_ids for r in same]
        assert not {tuple(r.token_ids) for r in reqs} & {tuple(r.token_ids) for r in fresh}
        for request in reqs:
            assert request.output_len == 5 and request.ignore_eos
            assert not set(request.token_ids) & SPECIAL_IDS
    assert all(len(r.token_ids) == 40 for r in first[2][2])
    assert [label for label, _, _ in workloads(_args(long_input=0), 0)] == ["c=1, 12+5", "c=4, 12+5"]


def test_ratio_spread() -> None:
    assert ratio_spread([1.0, 2.0, 4.0]) == "2.00x (1.00..4.00)"
    assert ratio_spread([]) == "-"


def test_checkpoint_has_the_keys_vllm_needs(tmp_path: Path, monkeypatch) -> None:
    """config.json names the architecture, noaux_tc routing and sigmoid scoring; the tokenizer is copied; a second
    call with the same seed reuses the files."""
    small = dict(peer_servers.PEER_SHAPE, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                 num_hidden_layers=2, num_attention_heads=2, q_lora_rank=32, vocab_size=4096)
    monkeypatch.setattr(peer_servers, "PEER_SHAPE", small)
    count = peer_servers.write_peer_checkpoint(tmp_path / "ckpt", seed=3)
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert config["topk_method"] == "noaux_tc" and config["scoring_func"] == "sigmoid"
    assert config["kv_lora_rank"] + config["qk_rope_head_dim"] == 576  # vLLM's CPU MLA kernel width
    assert (tmp_path / "ckpt" / "tokenizer.json").is_file()
    weights = tmp_path / "ckpt" / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert peer_servers.write_peer_checkpoint(tmp_path / "ckpt", seed=3) == count > 0
    assert weights.stat().st_mtime_ns == stamp


def test_cached_environment_is_reused(tmp_path: Path, monkeypatch) -> None:
    """A venv whose stamp exists is returned as is: no command runs."""
    venv = tmp_path / f"vllm-cpu-{peer_servers.VLLM_VERSION}"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / ".pdserve-peer-ready").write_text("x\n")
    monkeypatch.setattr(peer_servers, "run_logged", lambda *a, **k: (_ for _ in ()).throw(AssertionError("installed")))
    assert peer_servers.ensure_vllm_venv(tmp_path) == venv / "bin" / "python"


def test_an_idle_server_settles_and_a_busy_one_is_read_as_busy(tmp_path: Path) -> None:
    """Server.settle (run before each measured run for the other system): a sleeping process tree reads as idle at
    once; a child spinning on a core reads as busy (any share of a core, however loaded the machine) and settle
    gives up at its deadline."""
    import subprocess
    import sys

    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    busy = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.run([sys.executable, '-c', "
                             "'while True: pass'])"])
    try:
        log = tmp_path / "log"
        assert peer_servers.Server("idle", idle, "http://x", log).settle(below_cores=0.05, timeout_s=60) < 0.05
        spinning = peer_servers.Server("busy", busy, "http://x", log)
        assert spinning.settle(below_cores=0.01, timeout_s=1.0) > 0.01
    finally:
        for process in (idle, busy):
            for child in psutil.Process(process.pid).children(recursive=True):
                child.kill()
            process.kill()
            process.wait()


def test_only_new_unmapped_multiprocessing_segments_are_removed(tmp_path: Path) -> None:
    """remove_left_behind: a segment or semaphore that appeared during the run and nobody maps goes; one that was
    there before, one still mapped, and anything not multiprocessing's (pdserve's own pools) stay."""
    for name in ("psm_old", "psm_new", "sem.mp-new", "psm_mapped", "pdserve-kv-1"):
        (tmp_path / name).write_bytes(b"x")
    before = {"psm_old"}
    removed = peer_servers.remove_left_behind(before, str(tmp_path), mapped=lambda name: name == "psm_mapped")
    assert removed == ["psm_new", "sem.mp-new"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pdserve-kv-1", "psm_mapped", "psm_old"]

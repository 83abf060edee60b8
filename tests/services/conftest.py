"""Shared fixtures for service tests: the test model, one launched deployment (decode + prefill +
gateway processes on loopback) for the whole session, and in-process reference outputs."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.launcher import Cluster, ClusterSpec
from tests.run_wide import run_wide
from tests.services.helpers import PROMPT_LENGTHS, greedy, token_prompts
from tests.services.service_model import make_service_model

WORKER_ARGS = ("--kv-memory-mb", "64", "--num-threads", "1")
MAX_TOKENS = 16
PROMPTS = token_prompts(PROMPT_LENGTHS)  # 16 prompts of 1 to 2048 tokens


@pytest.fixture(scope="session")
def service_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    with run_wide(tmp_path_factory, "service_model") as root:
        return make_service_model(root)  # returns the existing directory when another worker built it


def launch(model: Path, log_dir: Path, **overrides: object) -> Cluster:
    """A deployment (started; the caller stops it). Unless `gateway_args` are given, the gateway always disaggregates
    (--disagg-threshold-tokens 0): these tests follow a request through the prefill worker (the decode worker's own
    prefills: tests/services/test_decode_reuse.py)."""
    overrides.setdefault("gateway_args", ("--disagg-threshold-tokens", "0"))
    spec = ClusterSpec(model_dir=str(model), listen="127.0.0.1:0", attention_backend="torch", worker_args=WORKER_ARGS,
                       **overrides)  # type: ignore[arg-type]
    cluster = Cluster(spec, log_dir=log_dir)
    try:
        cluster.start(timeout_s=300)
    except BaseException:
        for log in sorted(log_dir.glob("*.log")):
            print(f"==== {log.name}\n{log.read_text()[-4000:]}")  # noqa: T201 - shown by pytest on failure
        raise
    return cluster


@pytest.fixture(scope="session")
def cluster(service_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """1 prefill + 1 decode (TP 1, shm transport, with the draft) + gateway."""
    log_dir = tmp_path_factory.mktemp("cluster_logs")
    cluster = launch(service_model, log_dir)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def llm(service_model: Path) -> Iterator[object]:
    """The in-process reference: LLM over the same model (and draft)."""
    from engine import LLM

    with LLM(str(service_model), attention_backend="torch", kv_memory_bytes=64 * 2**20,
             num_threads=1) as llm:
        yield llm


@pytest.fixture(scope="session")
def reference(service_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[bool, list[list[int]]]:
    """In-process greedy outputs of PROMPTS: with speculation (speculative=None, the draft is loaded) and without.
    Computed once per run (by the first xdist worker that needs them) and read back by the others."""
    with run_wide(tmp_path_factory, "service_reference") as root:
        saved = root / "outputs.json"
        if not saved.exists():
            from engine import LLM

            with LLM(str(service_model), attention_backend="torch", kv_memory_bytes=64 * 2**20,
                     num_threads=1) as llm:
                outputs = {str(spec): llm.generate(PROMPTS, greedy(MAX_TOKENS, None if spec else False))
                           for spec in (True, False)}
            saved.write_text(json.dumps(outputs))
        return {spec: json.loads(saved.read_text())[str(spec)] for spec in (True, False)}


def worker_address(cluster: Cluster, role: str) -> str:
    return next(child.address for child in cluster.children if child.role == role)

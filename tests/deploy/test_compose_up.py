"""The cpu profile for real, through scripts/compose.sh (Docker Engine, or podman + docker-compose v1):
built, up and SERVING, greedy text through the containers equal to the in-process engine's, the bench
profile completing every request, and `down` leaving no container, network, volume, API socket or /dev/shm
segment behind. Run with `pytest -m compose` (deselected otherwise, tests/conftest.py); ~10-15 min fresh."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

from pdserve.healthcheck import check
from tests.deploy.compose_helpers import (ROOT, SCRIPT, compose_skip_reason, new_shm_segments, podman_service_running,
                                          run_script)

pytestmark = [pytest.mark.slow, pytest.mark.compose]
DEFAULT_MODEL = ROOT / "models" / "pdserve-tiny"
PROMPT = "def fibonacci(n):\n"
MAX_TOKENS = 32
BENCH = {"BENCH_PROMPTS": "6", "BENCH_CONCURRENCY": "3", "BENCH_INPUT_LEN": "64", "BENCH_OUTPUT_LEN": "16"}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def in_process_text() -> str:
    """Greedy completion of PROMPT by engine.LLM on the default model, decoded with its tokenizer."""
    from engine import LLM
    from engine.sampling_params import SamplingParams
    from gateway.tokenizer import TextTokenizer

    tokenizer = TextTokenizer.from_model_dir(DEFAULT_MODEL)
    with LLM(str(DEFAULT_MODEL), attention_backend="torch", num_threads=1) as llm:
        tokens = llm.generate([tokenizer.encode(PROMPT)], SamplingParams(max_new_tokens=MAX_TOKENS, temperature=0.0))[0]
    return tokenizer.decode(tokens)


def generate_through(address: str) -> str:
    """`pdserve generate` (greedy) against the containers' gateway; its stdout without the final newline."""
    result = subprocess.run([sys.executable, "-m", "pdserve.cli", "generate", "--gateway", address, "--max-tokens",
                             str(MAX_TOKENS), "--temperature", "0", "--quiet", PROMPT],
                            capture_output=True, text=True, timeout=600, check=True)
    assert result.stdout.endswith("\n"), result.stdout
    return result.stdout[:-1]


@pytest.fixture
def compose_env(tmp_path):
    reason = compose_skip_reason()
    if reason:
        pytest.skip(reason)
    return {**os.environ, "COMPOSE_PROJECT_NAME": f"pdserve-test-{os.getpid()}", "GATEWAY_PORT": str(free_port()),
            "BENCH_RUNS_DIR": str(tmp_path / "runs"), **BENCH}


def test_cpu_profile_serves_benches_and_goes_down_cleanly(compose_env, tmp_path):
    """build + up -> the gateway is SERVING on the published port; generate's greedy text through the three
    containers == engine.LLM's; the bench profile's JSONL has every request completed and none failed;
    down -> no container, network or volume of the project, no podman API socket, no new /dev/shm segment.
    On any failure the containers' logs are printed."""
    project = compose_env["COMPOSE_PROJECT_NAME"]
    address = f"127.0.0.1:{compose_env['GATEWAY_PORT']}"
    (tmp_path / "runs").mkdir()
    expected = in_process_text()
    shm_before = set(os.listdir("/dev/shm"))
    run_script(compose_env, "build", timeout=1200)
    try:
        up = run_script(compose_env, "up", timeout=900)
        assert up.stdout.strip().splitlines()[-1] == address
        assert check(address) == (True, "SERVING")
        assert generate_through(address) == expected
        run_script(compose_env, "compose", "--profile", "bench", "run", "--rm", "bench", timeout=900)
        runs = [json.loads(line) for line in (tmp_path / "runs" / "bench.jsonl").read_text().splitlines()]
        assert len(runs) == 1
        assert runs[0]["completed"] == int(BENCH["BENCH_PROMPTS"]) and runs[0]["failed"] == 0, runs[0]
        assert runs[0]["total_output_tokens"] == int(BENCH["BENCH_PROMPTS"]) * int(BENCH["BENCH_OUTPUT_LEN"])
    except BaseException:
        logs = subprocess.run([str(SCRIPT), "compose", "--profile", "cpu", "logs", "--no-color", "--tail", "300"],
                              env=compose_env, cwd=ROOT, capture_output=True, text=True, timeout=300)
        print(f"---- the containers' logs ----\n{logs.stdout}{logs.stderr}", file=sys.stderr)
        raise
    finally:
        down = run_script(compose_env, "down", timeout=600, check=False)
    assert down.returncode == 0, down.stderr
    # Through the script: a bare `podman` would leave its lock file in /dev/shm, which the script releases.
    label = f"label=com.docker.compose.project={project}"
    assert run_script(compose_env, "engine", "ps", "-aq", "--filter", label, timeout=120).stdout == ""
    assert run_script(compose_env, "engine", "volume", "ls", "-q", "--filter", label, timeout=120).stdout == ""
    networks = run_script(compose_env, "engine", "network", "ls", "--format", "{{.Name}}", timeout=120).stdout
    assert f"{project}_default" not in networks.split()
    assert not podman_service_running()
    assert new_shm_segments(shm_before) == set()


def test_compose_skip_reason_names_what_is_missing(monkeypatch):
    """Without docker, podman, root or apt-get the reason says so (the test above then skips, never fails)."""
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    reason = compose_skip_reason()
    assert reason and "podman" in reason and "root" in reason

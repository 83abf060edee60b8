"""docker/Dockerfile.rocm built for real on a CPU stand-in base (scripts/compose.sh build-rocm-standin:
no AITER, CPU torch): the image's Python layer works - `pdserve --help` and `pdserve plan` for a preset run
inside it. The ROCm base, AITER and the GPU flags are checked only as text (test_dockerfiles, test_compose)."""
from __future__ import annotations

import os
from subprocess import CompletedProcess

import pytest

from tests.deploy.compose_helpers import compose_skip_reason, run_script

pytestmark = [pytest.mark.slow, pytest.mark.compose]
IMAGE = "pdserve:rocm-standin"


def run_in_image(*command: str) -> CompletedProcess[str]:
    """`docker/podman run --rm` through the script (which then releases podman's /dev/shm lock file)."""
    return run_script(dict(os.environ), "engine", "run", "--rm", "--network", "none", IMAGE, *command,
                      timeout=600, check=False)


def test_rocm_image_python_layer_on_a_stand_in_base():
    """The ROCm Dockerfile builds on the stand-in; inside it `pdserve --help` lists every command, `pdserve
    plan --model kimi-k3 --json` prints a plan for 8 MI355X, and PyPI's unrelated `aiter` is absent."""
    reason = compose_skip_reason()
    if reason:
        pytest.skip(reason)
    run_script(dict(os.environ), "build-rocm-standin", timeout=1800)
    try:
        help_text = run_in_image("pdserve", "--help")
        assert help_text.returncode == 0, help_text.stderr
        for command in ("up", "generate", "bench", "plan", "gateway", "prefill", "decode"):
            assert command in help_text.stdout
        plan = run_in_image("pdserve", "plan", "--model", "kimi-k3", "--gpu", "MI355X", "--json")
        assert plan.returncode == 0, plan.stderr
        assert "MI355X" in plan.stdout
        aiter = run_in_image("python3", "-c", "import importlib.util as u; print(u.find_spec('aiter'))")
        assert aiter.stdout.strip() == "None", aiter.stdout + aiter.stderr
    finally:
        run_script(dict(os.environ), "engine", "rmi", IMAGE, f"docker.io/library/{IMAGE}", timeout=300, check=False)

"""The container images' Dockerfiles (no docker engine here to build them): base images, the CPU torch
wheel, AMD AITER from source, every package copied, nothing fetched at run time."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs with continuation lines joined and comments dropped."""
    text = (ROOT / "docker" / name).read_text()
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    result = []
    for line in joined.splitlines():
        if line.strip():
            keyword, _, rest = line.strip().partition(" ")
            result.append((keyword.upper(), " ".join(rest.split())))
    return result


def args_of(name: str, keyword: str) -> list[str]:
    return [rest for key, rest in instructions(name) if key == keyword]


def build_arg_defaults(name: str) -> dict[str, str]:
    """ARG NAME=default -> {NAME: default} (quotes dropped; the last declaration wins)."""
    pairs = (arg.split("=", 1) for arg in args_of(name, "ARG") if "=" in arg)
    return {key: value.strip('"') for key, value in pairs}


def test_cpu_image_base_and_torch_wheel():
    """By default python:3.11-slim (BASE_IMAGE), with torch 2.13.0 from the PyTorch CPU index (not PyPI's
    CUDA wheel: TORCH_SOURCE); the pdserve stage builds on the torch stage and installs pdserve editable."""
    defaults = build_arg_defaults("Dockerfile.cpu")
    assert defaults["BASE_IMAGE"] == "python:3.11-slim"
    assert args_of("Dockerfile.cpu", "FROM") == ["${BASE_IMAGE} AS torch", "torch AS cpu"]
    assert defaults["TORCH_SOURCE"] == "--index-url https://download.pytorch.org/whl/cpu"
    assert defaults["PIP_SOURCE"] == ""
    runs = args_of("Dockerfile.cpu", "RUN")
    assert "pip install ${TORCH_SOURCE} torch==2.13.0" in runs
    assert any(run.startswith("pip install ${PIP_SOURCE} -e .") for run in runs)


def test_rocm_image_defaults_install_aiter_and_require_rocm_torch():
    """Only the stand-in build check turns AITER and the ROCm torch assertion off; the defaults keep both."""
    defaults = build_arg_defaults("Dockerfile.rocm")
    assert defaults["INSTALL_AITER"] == "1" and defaults["REQUIRE_ROCM_TORCH"] == "1"
    runs = " ".join(args_of("Dockerfile.rocm", "RUN"))
    assert 'if [ "${INSTALL_AITER}" = 1 ]' in runs and 'if [ "${REQUIRE_ROCM_TORCH}" = 1 ]' in runs


def test_rocm_image_base_and_aiter_from_source():
    """A rocm/pytorch base; AITER cloned from ROCm/aiter and built at image build time; pdserve installed
    with --no-deps so the base image's ROCm torch and triton are kept."""
    base = [arg for arg in args_of("Dockerfile.rocm", "ARG") if arg.startswith("BASE_IMAGE=")]
    assert base and base[0].split("=", 1)[1].startswith("rocm/pytorch:")
    assert args_of("Dockerfile.rocm", "FROM") == ["${BASE_IMAGE}"]
    runs = " ".join(args_of("Dockerfile.rocm", "RUN"))
    assert "https://github.com/ROCm/aiter.git" in runs
    assert "setup.py develop" in runs
    assert "pip install ${PIP_SOURCE} --no-deps -e ." in runs
    assert "'torch', 'triton'" in runs  # excluded from the dependencies pip installs


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.rocm"])
def test_unrelated_pypi_aiter_is_never_installed(name):
    """PyPI's `aiter` is an unrelated project: no pip command names it (amd-aiter is the real one)."""
    for run in args_of(name, "RUN"):
        for command in re.split(r"&&|;", run):
            if re.search(r"\bpip3? install\b", command):
                assert not re.search(r"(?<![\w-])aiter(?![\w.-])", command), command


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.rocm"])
def test_nothing_is_downloaded_at_run_time(name):
    """The model is baked in (CPU) or mounted (ROCm); hubs are offline; the start command fetches nothing."""
    env = " ".join(args_of(name, "ENV"))
    assert "HF_HUB_OFFLINE=1" in env and "TRANSFORMERS_OFFLINE=1" in env
    for start in args_of(name, "CMD") + args_of(name, "ENTRYPOINT"):
        assert not re.search(r"pip|curl|wget|git |huggingface-cli|hf download", start), start
    assert "models/ models/" in args_of(name, "COPY")


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.rocm"])
def test_every_package_is_copied(name):
    """Each top-level package pyproject.toml installs is copied into the image (an editable install of a
    missing package would break at import time)."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = [pattern.rstrip("*") for pattern in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]]
    copies = {copy.split()[0].rstrip("/") for copy in args_of(name, "COPY")}
    assert packages and set(packages) <= copies
    assert {"pyproject.toml", "protos", "models"} <= copies

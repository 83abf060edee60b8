"""compose.yaml: every command line parses with the real `pdserve` CLI parser, and the cpu / rocm / bench
setups have the health checks, dependencies, devices and shared memory the services need."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
ROLES = ("gateway", "prefill", "decode")
_VARIABLE = re.compile(r"\$\$|\$\{(\w+)(?::?-([^}]*))?\}")


def interpolate(value: Any) -> Any:
    """Compose's ${VAR:-default} with every variable unset (the defaults a fresh checkout runs with)."""
    if isinstance(value, str):
        return _VARIABLE.sub(lambda m: "$" if m.group(0) == "$$" else (m.group(2) or ""), value)
    if isinstance(value, list):
        return [interpolate(item) for item in value]
    if isinstance(value, dict):
        return {key: interpolate(item) for key, item in value.items()}
    return value


def load_services() -> dict[str, dict[str, Any]]:
    document = yaml.safe_load((ROOT / "compose.yaml").read_text())
    return interpolate(document["services"])


SERVICE_NAMES = sorted(load_services())


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    return load_services()


def profile_roles(services: dict[str, dict[str, Any]], profile: str) -> dict[str, tuple[str, dict[str, Any]]]:
    """role -> (service name, service) for the services of one profile, by their network alias."""
    found = {}
    for name, service in services.items():
        if profile in service.get("profiles", []):
            for alias in service["networks"]["default"]["aliases"]:
                assert alias not in found, f"two {alias} services in profile {profile}"
                found[alias] = (name, service)
    return found


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


@pytest.mark.parametrize("name", SERVICE_NAMES)
def test_every_command_line_parses_with_the_real_cli(services, name, capsys):
    """Each service runs `pdserve <command> ...` and build_parser().parse_args accepts it."""
    command = services[name]["command"]
    assert command[0] == "pdserve"
    try:
        args = build_parser().parse_args(command[1:])
    except SystemExit:
        pytest.fail(f"{name}: `{' '.join(command)}` does not parse: {capsys.readouterr().err.strip()}")
    assert args.command == command[1]


def test_profiles_hold_a_full_setup_each(services):
    """cpu and rocm each have one gateway, prefill and decode; bench is its own profile."""
    for profile in ("cpu", "rocm"):
        assert set(profile_roles(services, profile)) == set(ROLES), profile
    bench = [name for name, service in services.items() if service.get("profiles") == ["bench"]]
    assert len(bench) == 1 and services[bench[0]]["command"][1] == "bench"
    assert flag(services[bench[0]]["command"], "--gateway") == "gateway:50051"


@pytest.mark.parametrize("profile", ["cpu", "rocm"])
def test_addresses_health_checks_and_dependencies_agree(services, profile):
    """The gateway dials the prefill/decode aliases on the ports they listen on; every service is health
    checked through grpc.health.v1 on its own port; the gateway waits for healthy workers, prefill for
    a healthy decode; every long-running service restarts."""
    roles = profile_roles(services, profile)
    ports = {role: flag(service["command"], "--listen").rsplit(":", 1)[1] for role, (_, service) in roles.items()}
    gateway = roles["gateway"][1]["command"]
    assert flag(gateway, "--prefill") == f"prefill:{ports['prefill']}"
    assert flag(gateway, "--decode") == f"decode:{ports['decode']}"
    for role, (name, service) in roles.items():
        test = service["healthcheck"]["test"]
        assert test[0] == "CMD" and "pdserve.healthcheck" in test, name
        assert test[-1] == f"127.0.0.1:{ports[role]}", name
        assert service["restart"] in ("unless-stopped", "always", "on-failure"), name
    depends = roles["gateway"][1]["depends_on"]
    assert {depends[roles[role][0]]["condition"] for role in ("prefill", "decode")} == {"service_healthy"}
    assert roles["prefill"][1]["depends_on"][roles["decode"][0]]["condition"] == "service_healthy"


def test_only_the_gateways_publish_ports(services):
    """Workers are reachable only inside the compose network."""
    published = {name for name, service in services.items() if service.get("ports")}
    gateways = {profile_roles(services, profile)["gateway"][0] for profile in ("cpu", "rocm")}
    assert published == gateways


def test_prefill_and_decode_share_dev_shm(services):
    """KV moves through POSIX shared memory: on CPU prefill joins decode's (shareable) IPC namespace,
    on ROCm both use the host's."""
    cpu = profile_roles(services, "cpu")
    assert cpu["decode"][1]["ipc"] == "shareable"
    assert cpu["prefill"][1]["ipc"] == f"service:{cpu['decode'][0]}"
    assert cpu["decode"][1]["shm_size"]
    rocm = profile_roles(services, "rocm")
    assert rocm["decode"][1]["ipc"] == rocm["prefill"][1]["ipc"] == "host"


def test_cpu_workers_split_the_cores_and_lend_them_like_up(services):
    """On CPU the workers take up's halves of the cores (--cpus prefill-half / decode-half, any machine) and lend
    each other the idle half through one core board on the /dev/shm they share (without it the decode engine's
    threads collide with the serving processes: the containers served 62% of up's throughput, BENCHMARKS.md)."""
    cpu = profile_roles(services, "cpu")
    prefill, decode = cpu["prefill"][1]["command"], cpu["decode"][1]["command"]
    assert (flag(prefill, "--cpus"), flag(prefill, "--borrow-cpus")) == ("prefill-half", "decode-half")
    assert (flag(decode, "--cpus"), flag(decode, "--borrow-cpus")) == ("decode-half", "prefill-half")
    assert flag(prefill, "--core-board") == flag(decode, "--core-board")
    assert flag(decode, "--core-board").startswith("/dev/shm/")
    for service in profile_roles(services, "rocm").values():
        assert "--cpus" not in service[1]["command"] and "--core-board" not in service[1]["command"]


def test_rocm_workers_reach_the_gpus(services):
    """ROCm prefill and decode: /dev/kfd + /dev/dri, group video, seccomp unconfined, the same 8 GPUs at
    TP8 for both, and the model mounted read-only where --model points."""
    rocm = profile_roles(services, "rocm")
    visible = set()
    for role in ("prefill", "decode"):
        name, service = rocm[role]
        assert {"/dev/kfd", "/dev/dri"} <= set(service["devices"]), name
        assert "video" in service["group_add"], name
        assert "seccomp=unconfined" in service["security_opt"], name
        assert service["shm_size"], name
        gpus = service["environment"]["HIP_VISIBLE_DEVICES"]
        visible.add(gpus)
        assert len(gpus.split(",")) == int(flag(service["command"], "--tp-size")) == 8, name
        model = flag(service["command"], "--model")
        assert any(volume.endswith(f":{model}:ro") for volume in service["volumes"]), name
    assert visible == {"0,1,2,3,4,5,6,7"}
    assert "devices" not in rocm["gateway"][1]  # the gateway needs no GPU
    assert rocm["decode"][1]["command"][rocm["decode"][1]["command"].index("--draft-model") + 1] == "/models/draft"


def test_cpu_setup_runs_the_baked_in_model(services):
    """The CPU services read the embedded default model inside the image: no volume, no device."""
    for name, service in profile_roles(services, "cpu").values():
        assert flag(service["command"], "--model") == "/opt/pdserve/models/pdserve-tiny", name
        assert "volumes" not in service and "devices" not in service, name
        assert service["build"]["dockerfile"] == "docker/Dockerfile.cpu", name


@pytest.mark.parametrize("profile", ["cpu", "rocm", "bench"])
def test_docker_compose_v1_validates(profile):
    """`docker-compose -f compose.yaml config -q` accepts every profile (as .ci/run checks)."""
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose v1 is not installed (apt-get install docker-compose)")
    result = subprocess.run([binary, "-f", "compose.yaml", "config", "-q"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "COMPOSE_PROFILES": profile})
    assert result.returncode == 0, result.stderr


def test_rocm_workers_run_on_the_gpus(services):
    """The rocm profile's prefill and decode workers ask for the GPU explicitly (--device cuda, one GPU per rank)."""
    rocm = profile_roles(services, "rocm")
    for role in ("prefill", "decode"):
        command = rocm[role][1]["command"]
        assert flag(command, "--device") == "cuda" and "--gpus" in command

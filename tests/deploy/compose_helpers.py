"""Shared by the compose bring-up tests: running scripts/compose.sh, whether containers can run here, and
looking for what a setup could leave behind (the podman API socket process, /dev/shm segments)."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "compose.sh"


def docker_engine_running() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode == 0


def compose_skip_reason() -> str | None:
    """None when scripts/compose.sh can run containers here, else why not."""
    if "DOCKER_HOST" not in os.environ and docker_engine_running():
        return None
    root = os.geteuid() == 0
    if shutil.which("podman") is not None:
        return None if root else "podman is installed but the compose tests need root (rootful podman)"
    if root and shutil.which("apt-get") is not None:
        return None
    return ("no Docker engine, no podman, and podman cannot be installed here "
            "(scripts/compose.sh installs it from Debian's packages as root with apt-get)")


def run_script(env: dict[str, str], *args: str, timeout: float, check: bool = True) -> subprocess.CompletedProcess[str]:
    """scripts/compose.sh ARGS; with check, a non-zero exit fails with the end of its output."""
    result = subprocess.run([str(SCRIPT), *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"compose.sh {' '.join(args)} exited {result.returncode}\n"
                             f"stdout: {result.stdout[-3000:]}\nstderr: {result.stderr[-6000:]}")
    return result


def _cmdlines() -> list[list[str]]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                found.append(Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0"))
            except OSError:
                continue
    return [[part.decode(errors="replace") for part in cmdline] for cmdline in found]


def podman_service_running() -> bool:
    """A `podman system service` on scripts/compose.sh's socket is alive."""
    return any(cmdline[:3] == ["podman", "system", "service"] and any("pdserve-compose" in part for part in cmdline)
               for cmdline in _cmdlines())


def _mapped_shm() -> set[str]:
    names = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                maps = Path(f"/proc/{entry}/maps").read_text()
            except OSError:
                continue
            names.update(line.split("/dev/shm/", 1)[1].split()[0] for line in maps.splitlines() if "/dev/shm/" in line)
    return names


def new_shm_segments(before: set[str]) -> set[str]:
    """/dev/shm entries that appeared since `before` and that no living process maps (left behind).
    Other users' live segments on a shared machine are mapped by their processes and so not counted."""
    return set(os.listdir("/dev/shm")) - before - _mapped_shm()

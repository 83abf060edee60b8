"""Starting and stopping a whole pdserve deployment on this machine: decode worker(s), prefill worker(s),
then the gateway, each a child process in its own process group (so its TP follower ranks go with it).

Ports: workers listen on port 0 and report their bound address through a ready file; the gateway is
started with those addresses. Stop: SIGTERM to each leader (gateway, prefill, decode, in that order) so
it shuts down gracefully, then SIGKILL to whatever is left in its group, then stale shared-memory
segments of dead owners are removed."""
from __future__ import annotations

import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from pdserve.process_groups import PARENT_ENV, kill_group
from pdserve.cpu_split import parse_cpu_list
from rpc.core_board import MAX_DECODE_SLOTS, MAX_PREFILL_SLOTS, create_board
from rpc.server import read_ready_file

logger = logging.getLogger(__name__)
INTERNAL_MODES = ("uds", "tcp")


@dataclass(frozen=True)
class ClusterSpec:
    model_dir: str
    num_prefill: int = 1
    num_decode: int = 1
    prefill_tp: int = 1
    decode_tp: int = 1
    listen: str = "127.0.0.1:50051"
    http_listen: str = "127.0.0.1:0"  # the gateway's HTTP front (OpenAI API, /health, /metrics); "": none
    worker_metrics: bool = True        # workers serve /metrics on a port of their own (port 0)
    attention_backend: str = "auto"
    transport: str = "auto"
    draft_model: str | None = None  # None: the model's draft/ folder if present; "": none
    worker_args: tuple[str, ...] = ()   # extra flags for both workers (e.g. --kv-memory-mb 64)
    prefill_args: tuple[str, ...] = ()
    decode_args: tuple[str, ...] = ()
    gateway_args: tuple[str, ...] = ()
    log_level: str = "INFO"
    internal: str = "uds"  # how the workers listen: "uds" (Unix sockets in a 0700 directory) or "tcp" (+ token)
    tls_cert: str | None = None  # the gateway's TLS certificate and key (PEM files)
    tls_key: str | None = None
    api_key_file: str | None = None  # keys clients must send to the gateway
    lend_cpus: str | None = None  # core lending (rpc/core_board.py): the prefill workers' CPUs, lent to the decode worker
    lend_back_cpus: str | None = None  # with lend_cpus: the decode workers' CPUs, lent to prefill workers while decode idles

    def __post_init__(self) -> None:
        for name in ("num_prefill", "num_decode", "prefill_tp", "decode_tp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.internal not in INTERNAL_MODES:
            raise ValueError(f"internal must be one of {INTERNAL_MODES}, got {self.internal!r}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        if self.transport not in ("auto", "shm", "grpc", "device"):
            raise ValueError(f"transport must be auto, shm, grpc or device, got {self.transport!r}")
        if self.lend_cpus and (self.decode_tp != 1 or self.num_decode > MAX_DECODE_SLOTS
                               or self.num_prefill > MAX_PREFILL_SLOTS):
            raise ValueError(f"core lending needs decode TP 1, at most {MAX_DECODE_SLOTS} decode and "
                             f"{MAX_PREFILL_SLOTS} prefill workers")
        if self.lend_back_cpus and (not self.lend_cpus or self.prefill_tp != 1):
            raise ValueError("lending the decode workers' cores to prefill needs core lending and prefill TP 1")
        if not Path(self.model_dir, "config.json").is_file():
            raise ValueError(f"model directory {self.model_dir!r} has no config.json")


def kv_pool_flags(transport: str) -> tuple[str, ...]:
    """The decode workers' --kv-pool for a forced transport (auto / grpc: the decode worker's own default)."""
    return {"shm": ("--kv-pool", "shm"), "device": ("--kv-pool", "device")}.get(transport, ())


@dataclass
class Child:
    role: str
    process: subprocess.Popen[bytes]
    ready_file: Path
    address: str = ""
    command: list[str] = field(default_factory=list)  # how it was started (a restart runs it again)
    output: IO[bytes] | None = None
    endpoints: dict[str, str] = field(default_factory=dict)  # other served addresses: http, metrics

    @property
    def alive(self) -> bool:
        return self.process.poll() is None


@dataclass
class Cluster:
    spec: ClusterSpec
    log_dir: Path | None = None  # children's output goes to <log_dir>/<role>.log; None: inherit
    children: list[Child] = field(default_factory=list)
    gateway_address: str = ""

    def __post_init__(self) -> None:
        self._run_dir = Path(tempfile.mkdtemp(prefix="pdserve-up-"))  # 0700: the workers' sockets live here
        self._logs: list[IO[bytes]] = []
        self._interrupt: threading.Event | None = None
        self._board: str | None = None  # the core board file (core lending)
        self.internal_token: str | None = None
        self._token_file = self._run_dir / "internal.token"
        if self.spec.internal == "tcp":
            self.internal_token = secrets.token_urlsafe(32)
            descriptor = os.open(self._token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(descriptor, "w") as handle:
                handle.write(self.internal_token + "\n")

    def _security_args(self) -> list[str]:
        return ["--internal-token-file", str(self._token_file)] if self.internal_token else []

    def _listen(self, name: str) -> str:
        return f"unix:{self._run_dir / name}.sock" if self.spec.internal == "uds" else "127.0.0.1:0"

    def _spawn(self, role: str, name: str, args: list[str]) -> Child:
        ready = self._run_dir / f"{name}.addr"
        command = [sys.executable, "-m", "pdserve.cli", "--log-level", self.spec.log_level, role, *args,
                   "--ready-file", str(ready)]
        output: IO[bytes] | None = None
        if self.log_dir is not None:
            output = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - closed in stop()
            self._logs.append(output)
        child = Child(name, self._popen(command, output), ready, command=command, output=output)
        self.children.append(child)
        logger.info("started %s (pid %d)", name, child.process.pid)
        return child

    @staticmethod
    def _popen(command: list[str], output: IO[bytes] | None) -> subprocess.Popen[bytes]:
        environment = {**os.environ, PARENT_ENV: str(os.getpid())}  # the child arms die_with_parent itself
        return subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT if output else None,
                                start_new_session=True, env=environment)

    def respawn(self, child: Child) -> None:
        """Starts a dead child again on the address it had (the gateway and the other workers keep
        theirs): what is left of its process group is killed, its socket and ready file removed."""
        kill_group(child.process, child.role)
        command = list(child.command)
        pinned = {"--listen": child.address, "--http-listen": child.endpoints.get("http"),
                  "--metrics-listen": child.endpoints.get("metrics")}
        for flag, address in pinned.items():  # port 0 picked these once: keep them
            if address and flag in command:
                command[command.index(flag) + 1] = address
        if child.address.startswith("unix:"):
            Path(child.address[len("unix:"):]).unlink(missing_ok=True)
        child.ready_file.unlink(missing_ok=True)
        child.process = self._popen(command, child.output)
        logger.info("restarted %s (pid %d)", child.role, child.process.pid)

    def _worker_args(self, name: str, tp: int, extra: tuple[str, ...]) -> list[str]:
        args = ["--listen", self._listen(name), *self._security_args(), "--model", self.spec.model_dir, "--tp-size", str(tp),
                "--attention-backend", self.spec.attention_backend, *self.spec.worker_args, *extra]
        if self.spec.worker_metrics:
            args += ["--metrics-listen", "127.0.0.1:0"]
        if self.spec.draft_model is not None:
            args += ["--draft-model", self.spec.draft_model]
        return args

    def _check_interrupted(self) -> None:
        if self._interrupt is not None and self._interrupt.is_set():
            raise InterruptedError("interrupted while starting")

    def _wait_ready(self, children: list[Child], deadline: float) -> None:
        pending = list(children)
        while pending:
            self._check_interrupted()
            for child in list(pending):
                if child.ready_file.exists():
                    child.address, child.endpoints = read_ready_file(str(child.ready_file))
                    pending.remove(child)
                elif not child.alive:
                    raise RuntimeError(f"{child.role} exited with code {child.process.returncode} before it was ready")
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"{', '.join(c.role for c in pending)} not ready in time")
            time.sleep(0.05)

    def start(self, timeout_s: float = 600.0, interrupt: threading.Event | None = None) -> str:
        """Launches everything and waits until the gateway reports SERVING; returns its address.
        On failure (or when `interrupt` is set meanwhile) everything started is stopped and the error raised."""
        self._interrupt = interrupt
        deadline = time.monotonic() + timeout_s
        try:
            decode_args = (*kv_pool_flags(self.spec.transport), *self.spec.decode_args)
            lending: tuple[str, ...] = ()
            if self.spec.lend_cpus:
                self._board = create_board(str(self._run_dir))  # removed with the run directory
                lending = ("--core-board", self._board)
                # each decode worker's share of the lent cores in threads (none when they are fewer: the wider
                # mask alone then spreads the decode workers that share their own cores)
                threads = len(parse_cpu_list(self.spec.lend_cpus)) // self.spec.num_decode
                decode_args += (*lending, "--borrow-cpus", self.spec.lend_cpus, "--borrow-threads", str(threads))
            decode = [self._spawn("decode", f"decode-{i}", self._worker_args(
                f"decode-{i}", self.spec.decode_tp, (*decode_args, *(("--core-board-slot", str(i)) if lending else ()))))
                      for i in range(self.spec.num_decode)]
            prefill_args = (*self.spec.prefill_args, *lending)
            if self.spec.lend_back_cpus:  # each prefill worker's share of the decode cores in threads, as above
                threads = len(parse_cpu_list(self.spec.lend_back_cpus)) // self.spec.num_prefill
                prefill_args += ("--borrow-cpus", self.spec.lend_back_cpus, "--borrow-threads", str(threads))
            prefill = [self._spawn("prefill", f"prefill-{i}", self._worker_args(
                f"prefill-{i}", self.spec.prefill_tp, (*prefill_args, *(("--core-board-slot", str(i)) if lending else ()))))
                       for i in range(self.spec.num_prefill)]
            self._wait_ready(decode + prefill, deadline)
            args = ["--listen", self.spec.listen, "--model", self.spec.model_dir, "--transport", self.spec.transport,
                    "--http-listen", self.spec.http_listen, *self._security_args(), *self._gateway_security_args()]
            for child in prefill:
                args += ["--prefill", child.address]
            for child in decode:
                args += ["--decode", child.address]
            gateway = self._spawn("gateway", "gateway", args + list(self.spec.gateway_args))
            self._wait_ready([gateway], deadline)
            self.gateway_address = gateway.address
            self._wait_serving(deadline)
        except BaseException:
            self.stop()
            raise
        return self.gateway_address

    def _gateway_security_args(self) -> list[str]:
        args: list[str] = []
        if self.spec.tls_cert and self.spec.tls_key:
            args += ["--tls-cert", self.spec.tls_cert, "--tls-key", self.spec.tls_key]
        if self.spec.api_key_file:
            args += ["--api-key-file", self.spec.api_key_file]
        return args

    def _wait_serving(self, deadline: float) -> None:
        from pdserve.healthcheck import check

        status = ""
        root = Path(self.spec.tls_cert).read_bytes() if self.spec.tls_cert else None
        while time.monotonic() < deadline:
            self._check_interrupted()
            serving, status = check(self.gateway_address, timeout=2.0, tls_root=root)
            if serving:
                return
            dead = self.dead_children()
            if dead:
                raise RuntimeError(f"{dead[0].role} exited with code {dead[0].process.returncode}")
            time.sleep(0.1)
        raise TimeoutError(f"gateway at {self.gateway_address} not SERVING in time ({status})")

    @property
    def http_address(self) -> str:
        """The gateway's HTTP host:port ("" when it serves none)."""
        return next((c.endpoints.get("http", "") for c in self.children if c.role == "gateway"), "")

    def metrics_addresses(self) -> dict[str, str]:
        """role (gateway, prefill-0, decode-0, ...) -> host:port serving GET /metrics."""
        found = {c.role: c.endpoints["metrics"] for c in self.children if "metrics" in c.endpoints}
        if self.http_address:
            found["gateway"] = self.http_address
        return found

    def dead_children(self) -> list[Child]:
        return [child for child in self.children if not child.alive]

    def stop(self, timeout_s: float = 30.0) -> None:
        """Gateway first, then prefill, then decode: SIGTERM, wait, SIGKILL the group. Idempotent."""
        order = {"gateway": 0, "prefill": 1, "decode": 2}
        for child in sorted(self.children, key=lambda c: order.get(c.role.split("-")[0], 3)):
            if child.alive:
                child.process.send_signal(signal.SIGTERM)
                try:
                    child.process.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    logger.warning("%s did not stop within %.0f s; killing it", child.role, timeout_s)
            kill_group(child.process, child.role)
        self.children.clear()
        for handle in self._logs:
            handle.close()
        self._logs.clear()
        self._board = None
        from kvtransfer.shm_pool import cleanup_stale_segments

        cleanup_stale_segments()
        from engine.weights.weight_store import remove_stale_segments

        remove_stale_segments()
        for path in self._run_dir.glob("*"):
            path.unlink(missing_ok=True)
        if self._run_dir.exists():
            self._run_dir.rmdir()

"""`pdserve up` (here with the grpc KV transport) serves `pdserve generate`, and Ctrl-C (SIGINT) stops
every process it started, leaving nothing in /dev/shm."""
from __future__ import annotations

import re
import selectors
import signal
import subprocess
import sys
import time

from gateway.tokenizer import TextTokenizer
from tests.services.helpers import greedy, token_prompts
from tests.services.processes import alive, descendants, existing_segments, mapped_kv_segments

UP_LINE = re.compile(r"pdserve is up: gateway (\S+)")


def _read_until_up(process: subprocess.Popen[str], timeout: float) -> str:
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        if not selector.select(timeout=1.0):
            assert process.poll() is None, f"pdserve up exited with {process.returncode}: {seen}"
            continue
        line = process.stdout.readline()
        seen.append(line)
        match = UP_LINE.search(line)
        if match:
            return match.group(1)
        assert line or process.poll() is None, f"pdserve up exited with {process.returncode}: {seen}"
    raise AssertionError(f"pdserve up did not come up in {timeout} s: {seen}")


def test_up_generate_and_ctrl_c(service_model, llm, tmp_path):
    """up prints where to connect; generate streams the greedy completion (== the in-process engine's text);
    SIGINT makes up exit 0 with none of its descendants alive and its KV segments unlinked."""
    prompt = token_prompts((40,), seed=7)[0]
    expected = TextTokenizer.from_model_dir(service_model).decode(llm.generate([prompt], greedy(10, False))[0])
    log = open(tmp_path / "up.log", "w")  # noqa: SIM115
    up = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "up", "--model", str(service_model), "--listen", "127.0.0.1:0",
         "--transport", "grpc", "--attention-backend", "torch", "--num-threads", "1", "--kv-memory-mb", "64",
         "--draft-model", ""],
        stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
    try:
        address = _read_until_up(up, timeout=300)
        processes = descendants(up.pid)
        segments = mapped_kv_segments(processes)
        assert len(processes) >= 3 and segments
        generated = subprocess.run(
            [sys.executable, "-m", "pdserve.cli", "generate", "--gateway", address, "--token-ids",
             ",".join(map(str, prompt)), "--max-tokens", "10", "--temperature", "0", "--ignore-eos", "--no-spec"],
            capture_output=True, text=True, timeout=120)
        assert generated.returncode == 0, generated.stderr
        assert generated.stdout == expected + "\n"
        assert "[length] 10 tokens" in generated.stderr
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=90) == 0
        assert not alive(processes)
        assert not existing_segments(segments)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        log.close()

"""The gateway's tokenisation pool: long texts are encoded in pool processes with the same ids as inline,
and the pool's processes die with the gateway (a SIGKILLed gateway leaves no orphan behind)."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from engine.paths import DEFAULT_MODEL_DIR
from gateway.tokenize_pool import TokenizePool, TokenizePoolConfig
from gateway.tokenizer import TextTokenizer
from rpc.processes import alive, descendants

TOKENIZER = DEFAULT_MODEL_DIR / "tokenizer.json"

pytestmark = pytest.mark.slow  # spawns interpreters that import the project


def test_pool_encodes_like_inline():
    """A text over inline_chars goes through a pool process and gets the inline tokenizer's ids."""
    tokenizer = TextTokenizer.from_file(TOKENIZER)
    pool = TokenizePool(tokenizer, TOKENIZER, TokenizePoolConfig(inline_chars=8, processes=1))
    text = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n" * 20
    try:
        assert asyncio.run(pool.encode(text)) == tokenizer.encode(text)
    finally:
        pool.close()


def test_pool_processes_die_with_a_sigkilled_parent():
    """SIGKILL of the process that owns the pool: every pool process is gone within a generous deadline."""
    code = textwrap.dedent(f"""
        import asyncio, sys
        from gateway.tokenize_pool import TokenizePool, TokenizePoolConfig
        from gateway.tokenizer import TextTokenizer
        pool = TokenizePool(TextTokenizer.from_file({str(TOKENIZER)!r}), {str(TOKENIZER)!r},
                            TokenizePoolConfig(processes=2))
        asyncio.run(pool.warm_up())
        print("ready", flush=True)
        sys.stdin.read()
    """)
    parent = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "ready"
        children = descendants(parent.pid)
        assert children, "the pool started no process"
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(30)
        deadline = time.monotonic() + 60
        while alive(children):
            assert time.monotonic() < deadline, f"pool processes outlived their parent: {alive(children)}"
            time.sleep(0.05)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()

"""engine/runtime/host_memory.py: engine processes keep freed activation memory (mallopt), so a step's buffers
do not come back as fresh zero pages (a minor fault per 4 KiB) every step; PDSERVE_RETAIN_FREED_MEMORY=0 opts out.
Each case runs in a fresh interpreter (the settings are per process) and reads glibc's own accounting (mallinfo2):
where a 24 MiB block comes from, and whether the heap keeps it once freed. (What it saves on real engine steps is
measured by benchmarks/bench_allocator.py.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt and mallinfo2 are glibc's")

PROBE = textwrap.dedent("""
    import ctypes, json
    from engine.runtime.host_memory import retain_freed_memory

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                          "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    applied = retain_freed_memory()
    before = libc.mallinfo2()
    block = libc.malloc(24 * 2**20)
    during = libc.mallinfo2()
    libc.free(block)
    after = libc.mallinfo2()
    print(json.dumps({"applied": applied, "again": retain_freed_memory(), "mmapped": during.hblkhd - before.hblkhd,
                      "heap_grew": during.arena - before.arena, "trimmed": during.arena - after.arena}))
""")
BLOCK = 24 * 2**20


def _probe(**env: str) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, cwd=root,
                            env={**os.environ, "PYTHONPATH": root, **env})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_freed_blocks_stay_in_the_heap():
    """Retained: a 24 MiB block comes from the heap (no mmap of its own) and the heap keeps it after free (no trim),
    so the next step's buffer of that size reuses mapped pages."""
    probe = _probe(PDSERVE_RETAIN_FREED_MEMORY="1")
    assert probe["applied"] and probe["again"]
    assert probe["mmapped"] == 0 and probe["heap_grew"] > 0, probe
    assert probe["trimmed"] == 0, probe


def test_the_switch_keeps_glibc_defaults():
    """PDSERVE_RETAIN_FREED_MEMORY=0: nothing set, and glibc's default maps such a block on its own (its memory
    goes back to the kernel on free): what the retained settings avoid."""
    probe = _probe(PDSERVE_RETAIN_FREED_MEMORY="0")
    assert not probe["applied"] and not probe["again"]
    assert probe["mmapped"] >= BLOCK and probe["heap_grew"] == 0, probe

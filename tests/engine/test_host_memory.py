"""engine/runtime/host_memory.py: engine processes keep freed activation memory (mallopt), so a step's buffers
do not come back as fresh zero pages (a minor fault per 4 KiB) every step; PDSERVE_RETAIN_FREED_MEMORY=0 opts out.
Each case runs in a fresh interpreter: the settings are per process. (What it saves on real engine steps, where
glibc's moving defaults do trim, is measured by benchmarks/bench_allocator.py.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's")

# The same buffers (1..24 MiB) allocated, fully written and freed every round, as engine steps do; minor faults
# counted over the last 4 of 12 rounds, once the heap has grown to the pattern's peak (the first rounds map it).
PROBE = textwrap.dedent("""
    import json, resource
    import torch
    from engine.runtime.host_memory import retain_freed_memory
    applied = retain_freed_memory()
    sizes = [1, 24, 3, 16, 8, 2, 12]
    def round_trip():
        kept = []
        for mib in sizes:
            buffer = torch.empty(mib * 1024 * 1024 // 4)
            buffer.fill_(1.0)
            kept.append(buffer)
            if len(kept) > 2:
                kept.pop(0)
    for _ in range(8):
        round_trip()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(4):
        round_trip()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    pages = 4 * sum(sizes) * 1024 * 1024 // 4096
    print(json.dumps({"applied": applied, "faults": faults, "pages": pages, "again": retain_freed_memory()}))
""")


def _probe(**env: str) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, cwd=root,
                            env={**os.environ, "PYTHONPATH": root, **env})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_retained_memory_serves_repeated_buffers_without_page_faults():
    probe = _probe()
    assert probe["applied"] and probe["again"]
    # A buffer whose memory had gone back to the kernel would cost a fault per page written.
    assert probe["faults"] < 0.05 * probe["pages"], probe


def test_the_switch_turns_it_off():
    probe = _probe(PDSERVE_RETAIN_FREED_MEMORY="0")
    assert not probe["applied"] and not probe["again"]

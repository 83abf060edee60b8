"""A 10-second variant of benchmarks/soak.py on the shared deployment: mixed traffic with cancels,
deadlines and aborts leaves pages and leases exactly at the idle baseline and fds / threads flat (RSS is
checked loosely: 10 s is too short to tell slow growth from allocator warm-up; the 10-minute soak is the
real check). It keeps both cores busy for its whole duration, so the duration is the suite's cost."""
from __future__ import annotations

import time

import pytest

from benchmarks.soak import flatness, soak, take_sample
from tests.services.conftest import worker_address
from tests.services.helpers import idle_free_pages

pytestmark = pytest.mark.slow


async def test_short_soak_stays_flat(cluster):
    """Mixed traffic for 10 s (4 clients): every kind of ending occurs, and the end state is flat."""
    decode = [worker_address(cluster, "decode-0")]
    pids = {child.role: child.process.pid for child in cluster.children}
    idle = await idle_free_pages(decode[0])
    assert (await take_sample(time.monotonic(), decode, pids)).free_pages == idle
    samples, final, counts = await soak(cluster.gateway_address, decode, pids, duration_s=10, concurrency=4,
                                        sample_every_s=2, warm_up_s=4, seed=1)
    assert samples, "no sample was taken after the warm-up"
    assert counts.get("complete", 0) > 0 and counts.get("cancel", 0) > 0, counts
    problems = flatness(samples[0], final, idle, fd_slack=8, thread_slack=4, rss_growth=0.5)
    assert not problems, (problems, counts)

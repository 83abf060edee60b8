"""SharedPagePool: private zero-copy segments, layout-checked attach, and cleanup after a killed owner."""
from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap

import pytest
import torch

from kvtransfer.errors import LayoutMismatch, SegmentError
from kvtransfer.shm_pool import SHM_DIR, SharedPagePool, cleanup_stale_segments

from .conftest import DEEPSEEK_V3, SMALL_WITH_DRAFT


def test_segment_is_private_and_named_unguessably():
    """Mode exactly 0600, owned by us, the pdserve-kv- prefix, 128 random bits in the name."""
    with SharedPagePool.create(SMALL_WITH_DRAFT, 4) as pool, SharedPagePool.create(SMALL_WITH_DRAFT, 4) as other:
        info = os.stat(os.path.join(SHM_DIR, pool.name))
        assert stat.S_IMODE(info.st_mode) == 0o600
        assert info.st_uid == os.getuid()
        assert pool.name.startswith("pdserve-kv-") and len(pool.name) == len("pdserve-kv-") + 32
        assert pool.name != other.name


def test_mode_is_0600_even_with_a_permissive_umask():
    """fchmod makes the mode exact whatever the umask says."""
    old = os.umask(0)
    try:
        with SharedPagePool.create(SMALL_WITH_DRAFT, 2) as pool:
            assert stat.S_IMODE(os.stat(os.path.join(SHM_DIR, pool.name)).st_mode) == 0o600
    finally:
        os.umask(old)


def test_attached_views_share_memory_with_the_owner_bf16():
    """A bf16 write through the owner's cache is visible through an attached pool (one mapping, no copy)."""
    with SharedPagePool.create(SMALL_WITH_DRAFT, 5) as pool:
        assert pool.tensor.dtype == torch.bfloat16 and pool.cache.kv.shape == (4, 5, 16, 80)
        assert pool.cache.draft.shape == (2, 5, 16, 128)
        values = torch.randn(16, 80).to(torch.bfloat16)
        pool.cache.kv[3, 4] = values
        pool.cache.draft[1, 0, 2] = 7.0
        with SharedPagePool.attach(pool.name, SMALL_WITH_DRAFT) as attached:
            assert not attached.is_owner and attached.header.owner_pid == os.getpid()
            assert torch.equal(attached.cache.kv[3, 4], values)
            assert attached.cache.draft[1, 0, 2].eq(7.0).all()
            attached.cache.kv[0, 0, 0, 0] = -3.0
        assert pool.cache.kv[0, 0, 0, 0].item() == -3.0
        assert os.path.exists(os.path.join(SHM_DIR, pool.name))  # an attacher never unlinks
    assert not os.path.exists(os.path.join(SHM_DIR, pool.name))


def test_attach_with_another_layout_is_refused():
    """Attaching with a different layout raises LayoutMismatch naming both layouts."""
    with SharedPagePool.create(SMALL_WITH_DRAFT, 2) as pool:
        with pytest.raises(LayoutMismatch, match=SMALL_WITH_DRAFT.hash) as caught:
            SharedPagePool.attach(pool.name, DEEPSEEK_V3)
        assert DEEPSEEK_V3.hash in str(caught.value)


def test_attach_refuses_missing_and_foreign_segments():
    """A missing name, a path, or a segment without our header raise SegmentError."""
    with pytest.raises(SegmentError):
        SharedPagePool.attach("pdserve-kv-doesnotexist", SMALL_WITH_DRAFT)
    with pytest.raises(SegmentError):
        SharedPagePool.attach("../etc/passwd", SMALL_WITH_DRAFT)
    foreign = f"pdserve-kv-test-foreign-{os.getpid()}"  # per process: suites running side by side never share it
    path = os.path.join(SHM_DIR, foreign)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.write(fd, b"\0" * 8192)
        with pytest.raises(SegmentError, match="not a pdserve KV pool"):
            SharedPagePool.attach(foreign, SMALL_WITH_DRAFT)
    finally:
        os.close(fd)
        os.unlink(path)


def test_views_outlive_close():
    """close() never unmaps under a live tensor: a cache taken before close still reads correctly."""
    pool = SharedPagePool.create(SMALL_WITH_DRAFT, 2)
    cache = pool.cache
    cache.kv[1, 1] = 2.5
    pool.close()
    pool.unlink()
    assert cache.kv[1, 1].eq(2.5).all()


def test_deepseek_layout_pool_sizes():
    """A DeepSeek-V3 pool holds 61 x pages x 64 x 576 bf16 values in its page region."""
    with SharedPagePool.create(DEEPSEEK_V3, 2) as pool:
        assert pool.cache.kv.shape == (61, 2, 64, 576)
        assert pool.header.data_bytes == 2 * DEEPSEEK_V3.bytes_per_page
        assert pool.mapping_bytes == os.stat(os.path.join(SHM_DIR, pool.name)).st_size


CHILD = textwrap.dedent("""
    import sys, time
    from kvtransfer.layout import KVLayout
    from kvtransfer.shm_pool import SharedPagePool
    layout = KVLayout(2, 16, 4, 8)
    pools = [SharedPagePool.create(layout, 3, rank, prefix=sys.argv[1]) for rank in range(2)]
    print(" ".join(pool.name for pool in pools), flush=True)
    time.sleep(120)
""")


@pytest.mark.slow  # a child interpreter that imports kvtransfer (torch): ~2 s of CPU
def test_segments_of_a_sigkilled_owner_are_cleaned_at_next_start(shm_leak_guard):
    """A child creates two pools and is SIGKILLed (no atexit); cleanup_stale_segments removes exactly those,
    and leaves a live owner's segment alone."""
    # A prefix of this test's own: a cluster starting beside it (another xdist worker, another suite) runs the
    # same start-up cleanup over the default prefix, and must not win the race for these segments.
    prefix = f"pdserve-test-stale-{os.getpid()}-"
    with SharedPagePool.create(SMALL_WITH_DRAFT, 2, prefix=prefix) as alive:
        child = subprocess.Popen([sys.executable, "-c", CHILD, prefix], stdout=subprocess.PIPE, text=True)
        shm_leak_guard.track_pid(child.pid)
        try:
            names = child.stdout.readline().split()
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=30)
            child.stdout.close()
        assert len(names) == 2 and all(os.path.exists(os.path.join(SHM_DIR, name)) for name in names)
        removed = cleanup_stale_segments(prefix)
        assert set(names) <= set(removed)
        assert alive.name not in removed
        assert not any(os.path.exists(os.path.join(SHM_DIR, name)) for name in names)
        assert os.path.exists(os.path.join(SHM_DIR, alive.name))

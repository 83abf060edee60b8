"""A process that attached another's KV pool lets go of it once that owner is gone: the prefill side's ShmWriter
and an engine's model runner close the pools of dead decode workers when they attach a new one, so a decode
worker that died and came back does not leave its old pool mapped (its memory pinned) in the prefill worker."""
from __future__ import annotations

import dataclasses
import subprocess

from kvtransfer.shm_pool import SharedPagePool
from kvtransfer.shm_transport import ShmWriter

from .conftest import SMALL_WITH_DRAFT


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()  # reaped: no process has this pid now
    return child.pid


def test_owner_alive_follows_the_creating_process():
    """A pool's owner is alive while its creator runs; a header naming a reaped process is not."""
    with SharedPagePool.create(SMALL_WITH_DRAFT, 2) as pool:
        attached = SharedPagePool.attach(pool.name, SMALL_WITH_DRAFT)
        assert attached.owner_alive()
        attached.header = dataclasses.replace(attached.header, owner_pid=_dead_pid())
        assert not attached.owner_alive()
        attached.close()


def test_the_writer_closes_a_dead_owners_pool_when_it_attaches_another():
    """ShmWriter.pool(new) closes and forgets every attached pool whose owner is gone, and keeps the live ones."""
    with SharedPagePool.create(SMALL_WITH_DRAFT, 2) as dead, SharedPagePool.create(SMALL_WITH_DRAFT, 2) as live, \
            SharedPagePool.create(SMALL_WITH_DRAFT, 2) as new:
        writer = ShmWriter(SMALL_WITH_DRAFT)
        try:
            gone, kept = writer.pool(dead.name), writer.pool(live.name)
            gone.header = dataclasses.replace(gone.header, owner_pid=_dead_pid())
            writer.pool(new.name)
            assert set(writer._pools) == {live.name, new.name}
            assert gone.tensor is None and kept.tensor is not None  # closed / still mapped
        finally:
            writer.close()

"""KVReceiver.admit_now over shm (the gRPC push receiver's case is in test_grpc_push.py): a request whose
KV is complete and cheap to verify is admitted at once (the decode worker then skips a thread hop); one
still pending or too large to checksum inline is left to admit() (None); a failed request raises exactly
what admit() raises."""
from __future__ import annotations

import pytest
import torch

from engine.cache.kv_cache import PageAllocator
from kvtransfer.errors import ChecksumMismatch, UnknownTransfer
from kvtransfer.leases import LeaseTable
from kvtransfer.shm_pool import SharedPagePool
from kvtransfer.shm_receiver import ShmReceiver
from kvtransfer.shm_transport import ShmWriter

from .conftest import SMALL_WITH_DRAFT, random_cache

LAYOUT = SMALL_WITH_DRAFT


@pytest.fixture
def shm():
    """(receiver, reserve, failed ids) over one shm pool."""
    with SharedPagePool.create(LAYOUT, 16, num_slots=4) as pool:
        allocator, leases, failed = PageAllocator(16), LeaseTable(grace_s=0), []
        receiver = ShmReceiver([pool], on_failed=failed.append)

        def reserve(request_id: str, num_tokens: int):
            return receiver.expect(leases.grant(request_id, allocator.allocate(LAYOUT.pages_for_tokens(num_tokens)), 60),
                                   num_tokens)

        yield pool, receiver, reserve, failed


def test_shm_admits_a_complete_small_request_at_once(shm):
    """Written and small: admit_now returns admit()'s result and the request is admitted (forgotten); before
    the writer finished, or when the checksum would read more than the limit, it returns None and leaves the
    request pending."""
    pool, receiver, reserve, failed = shm
    writer, source = ShmWriter(LAYOUT), random_cache(LAYOUT, 3, seed=3)
    destination = reserve("r", 40)
    assert receiver.admit_now("r", 1 << 20) is None  # nothing written yet
    writer.push(source, [0, 1, 2], destination)
    assert receiver.admit_now("r", 3 * LAYOUT.bytes_per_page - 1) is None  # over the inline limit
    assert len(receiver) == 1
    result = receiver.admit_now("r", 3 * LAYOUT.bytes_per_page)
    assert result is not None and result.bytes == 3 * LAYOUT.bytes_per_page and len(receiver) == 0
    with pytest.raises(UnknownTransfer):
        receiver.admit_now("r", 1 << 20)  # admitted once only
    assert failed == []
    writer.close()


def test_shm_admit_now_reports_a_corrupted_request(shm):
    """A complete request whose pages no longer match the writer's checksum fails inline as in admit()."""
    pool, receiver, reserve, failed = shm
    writer, source = ShmWriter(LAYOUT), random_cache(LAYOUT, 2, seed=4)
    destination = reserve("bad", 20)
    writer.push(source, [0, 1], destination)
    pool.cache.kv[0, destination.page_ids[1], 3].view(torch.uint8)[0] ^= 1
    with pytest.raises(ChecksumMismatch):
        receiver.admit_now("bad", 1 << 20)
    assert failed == ["bad"] and len(receiver) == 0
    writer.close()

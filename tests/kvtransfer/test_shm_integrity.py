"""Shm transport integrity: corruption, short writes, stale records, cancelled and expired leases each fail
only their own request, with a clear error, and hand its pages back (on_failed / lease expiry)."""
from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from engine.cache.kv_cache import PageAllocator
from kvtransfer.completion import CompletionRecord, SlotState, key_of
from kvtransfer.errors import (
    BadChunk, ChecksumMismatch, IncompleteTransfer, LeaseExpired, OutOfSlots, TransferAborted, TransferTimeout,
    UnknownTransfer,
)
from kvtransfer.layout import SegmentKind
from kvtransfer.leases import LeaseTable
from kvtransfer.shm_pool import SharedPagePool
from kvtransfer.shm_receiver import ShmReceiver
from kvtransfer.shm_transport import ShmWriter

from .conftest import SMALL_WITH_DRAFT, random_cache

LAYOUT = SMALL_WITH_DRAFT


@pytest.fixture
def decode():
    """(pool, receiver, allocator, leases, failed ids): on_failed frees the request's pages, as decode does."""
    with SharedPagePool.create(LAYOUT, 16, num_slots=4) as pool:
        allocator, leases, failed = PageAllocator(16), LeaseTable(grace_s=0), []
        held: dict[str, list[int]] = {}

        def on_failed(request_id: str) -> None:
            failed.append(request_id)
            allocator.free(held.pop(request_id))

        receiver = ShmReceiver([pool], on_failed=on_failed)

        def reserve(request_id: str, num_tokens: int, ttl_s: float = 60):
            pages = allocator.allocate(LAYOUT.pages_for_tokens(num_tokens))
            held[request_id] = pages
            return receiver.expect(leases.grant(request_id, pages, ttl_s), num_tokens)

        reserve.leases = leases
        yield pool, receiver, allocator, reserve, failed


def test_corrupted_page_fails_only_that_request(decode):
    """A byte flipped after the writer's checksum: ChecksumMismatch for that request (pages freed through
    on_failed); another request written at the same time is admitted."""
    pool, receiver, allocator, reserve, failed = decode
    writer, source = ShmWriter(LAYOUT), random_cache(LAYOUT, 4, seed=1)
    bad, good = reserve("bad", 40), reserve("good", 33)
    writer.push(source, [0, 1, 2], bad)
    writer.push(source, [3, 2, 1], good)
    pool.cache.draft[1, bad.page_ids[2], 5].view(torch.uint8)[7] ^= 1  # one bit, in the last draft layer
    with pytest.raises(ChecksumMismatch, match="rank 0"):
        receiver.admit("bad")
    assert failed == ["bad"] and allocator.num_free == 16 - 3
    assert receiver.admit("good").bytes == 3 * LAYOUT.bytes_per_page
    assert len(receiver) == 0
    writer.close()


def test_short_write_is_refused_by_the_writer_and_fails_the_request(decode):
    """A layer never written: finish() raises IncompleteTransfer naming it, the record says FAILED, admit
    raises TransferAborted and the pages go back."""
    pool, receiver, allocator, reserve, failed = decode
    writer, source = ShmWriter(LAYOUT), random_cache(LAYOUT, 2, seed=2)
    destination = reserve("r", 20)
    handle = writer.open(destination)
    for kind, layer in LAYOUT.segments()[:-1]:  # the last draft layer is missing
        pages = source.layer(layer) if kind == SegmentKind.TARGET else source.draft_layer(layer)
        handle.write_pages(kind, layer, 0, pages[:2])
    with pytest.raises(IncompleteTransfer, match="draft layer 1"):
        handle.finish()
    assert receiver.ready("r")
    with pytest.raises(TransferAborted):
        receiver.admit("r")
    assert failed == ["r"] and allocator.num_free == 16
    writer.close()


def test_record_with_wrong_byte_or_token_count_is_a_short_write(decode):
    """A COMPLETE record claiming fewer bytes or other tokens than reserved is refused (IncompleteTransfer)."""
    pool, receiver, allocator, reserve, failed = decode
    for field, value in [("bytes_written", 1), ("num_tokens", 7)]:
        destination = reserve(field, 20)
        writer = ShmWriter(LAYOUT)
        result = writer.push(random_cache(LAYOUT, 2, seed=3), [0, 1], destination)
        record = pool.completions.read(destination.completion_slot)
        assert record.state == SlotState.COMPLETE and record.checksum == result.checksum
        pool.completions.write(destination.completion_slot, dataclasses.replace(record, **{field: value}))
        with pytest.raises(IncompleteTransfer):
            receiver.admit(field)
        writer.close()
    assert failed == ["bytes_written", "num_tokens"]


def test_stale_record_of_an_earlier_lease_is_never_accepted(decode):
    """A slot reused by a new lease still holding the previous lease's COMPLETE record: the new request
    waits (TransferTimeout) instead of being admitted on old bytes; its own record then admits it."""
    pool, receiver, allocator, reserve, failed = decode
    writer, source = ShmWriter(LAYOUT), random_cache(LAYOUT, 2, seed=4)
    first = reserve("first", 10)
    writer.push(source, [0], first)
    old_record = pool.completions.read(first.completion_slot)
    receiver.admit("first")
    allocator.free([first.page_ids[0]])
    second = reserve("second", 10)
    assert second.completion_slot == first.completion_slot
    assert second.completion_sequence == first.completion_sequence + 1  # the old record can never match
    pool.completions.write(second.completion_slot, old_record)  # a late duplicate of the old record
    with pytest.raises(TransferTimeout):
        receiver.admit("second", timeout_s=0.05)
    pool.completions.reserve(second.completion_slot, "second", second.binding, second.completion_sequence - 1)
    writer.push(source, [1], second)
    receiver.admit("second")
    assert failed == []
    writer.close()


def test_cancelled_request_refuses_the_late_writer(decode):
    """After decode cancels (abort), the writer's finish() raises UnknownTransfer: nothing is recorded."""
    pool, receiver, allocator, reserve, failed = decode
    destination = reserve("r", 5)
    handle = ShmWriter(LAYOUT).open(destination, in_place=True)
    receiver.cancel("r")
    with pytest.raises(UnknownTransfer, match="not reserved for this lease"):
        handle.finish()
    assert pool.completions.read(destination.completion_slot).state == SlotState.EMPTY
    with pytest.raises(UnknownTransfer):
        receiver.admit("r")


def test_expired_lease_frees_pages_and_blocks_writers(decode):
    """A lease past its deadline: the writer refuses to open (LeaseExpired); expire() hands the lease back
    and its pages return to the allocator."""
    pool, receiver, allocator, reserve, failed = decode
    destination = reserve("r", 30, ttl_s=0.001)
    while time.time() * 1000 <= destination.lease_deadline_unix_ms:  # until the deadline has passed
        time.sleep(0.001)
    with pytest.raises(LeaseExpired):
        ShmWriter(LAYOUT).open(destination)
    expired = reserve.leases.expire()
    assert [lease.lease_id for lease in expired] == [destination.lease_id]
    allocator.free(list(expired[0].page_ids))
    receiver.cancel("r")
    assert allocator.num_free == 16 and len(receiver) == 0 and len(reserve.leases) == 0


def test_wrong_page_count_and_out_of_slots(decode):
    """Tokens that need another page count are refused at expect(); with every slot held, expect() raises
    OutOfSlots until a request is admitted."""
    pool, receiver, allocator, reserve, failed = decode
    with pytest.raises(ValueError, match="need 2 pages"):
        receiver.expect(LeaseTable().grant("x", [1, 2, 3], 60), 20)
    destinations = [reserve(f"r{index}", 1) for index in range(4)]
    with pytest.raises(OutOfSlots):
        reserve("one-too-many", 1)
    writer = ShmWriter(LAYOUT)
    writer.open(destinations[0], in_place=True).finish()
    receiver.admit("r0")
    reserve("fits-now", 1)
    writer.close()


def test_writer_rejects_badly_shaped_data(decode):
    """Pages of the wrong shape, dtype, layer or position raise BadChunk before anything is written."""
    pool, receiver, allocator, reserve, failed = decode
    handle = ShmWriter(LAYOUT).open(reserve("r", 20))
    good = torch.zeros(2, 16, 80, dtype=torch.bfloat16)
    for kind, layer, first, data in [
        (SegmentKind.TARGET, 0, 0, good.float()), (SegmentKind.TARGET, 4, 0, good), (SegmentKind.DRAFT, 0, 0, good),
        (SegmentKind.TARGET, 0, 1, good), (SegmentKind.TARGET, 0, 0, good[:, :, :40]),
    ]:
        with pytest.raises(BadChunk):
            handle.write_pages(kind, layer, first, data)
    assert pool.tensor.view(torch.uint8).eq(0).all()
    handle.abort("test")
    assert pool.completions.read(0).state == SlotState.FAILED
    assert pool.completions.read(0).belongs_to("r", receiver._get("r").destination.binding)
    assert key_of("r") != key_of("s")
    assert CompletionRecord.unpack(bytes(128)) is None


def test_confirm_refuses_forged_and_stale_destinations(decode):
    """ShmWriter.confirm passes only a destination the decode side reserved: the same request under a
    guessed lease id, the real lease id over other pages (another request's) or another transport, and
    a lease released meanwhile are each refused, and confirm writes nothing into the pool."""
    pool, receiver, allocator, reserve, failed = decode
    writer = ShmWriter(LAYOUT)
    victim, attacker = reserve("victim", 20), reserve("attacker", 20)
    writer.confirm(victim)
    writer.confirm(attacker)
    before = bytes(pool.data_view)
    forged = [
        dataclasses.replace(victim, lease_id="0" * 32),                        # guessed lease id
        dataclasses.replace(attacker, page_ids=victim.page_ids),                # own lease, victim's pages
        dataclasses.replace(attacker, completion_slot=victim.completion_slot,  # own lease id, victim's slot
                            completion_sequence=victim.completion_sequence, page_ids=victim.page_ids),
        dataclasses.replace(victim, num_tokens=17),                             # other token count, same pages
        dataclasses.replace(victim, completion_sequence=victim.completion_sequence + 1),  # a later sequence
        dataclasses.replace(victim, completion_sequence=0),                     # below any reservation
        dataclasses.replace(victim, completion_sequence=2**64),                 # beyond the slot's u64
    ]
    for destination in forged:
        with pytest.raises(UnknownTransfer, match="not reserved for this lease"):
            writer.confirm(destination)
    receiver.cancel("victim")  # released: the slot is no longer the victim's
    with pytest.raises(UnknownTransfer):
        writer.confirm(victim)
    assert bytes(pool.data_view) == before
    writer.close()

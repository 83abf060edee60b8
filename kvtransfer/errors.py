"""Every failure the KV handoff can report; each names the gRPC status it maps to (without importing grpc)."""
from __future__ import annotations


class KVTransferError(Exception):
    """Base class. `grpc_status` is the grpc.StatusCode name rpc.status reports for it; a subclass names its
    own as a class keyword: `class Name(KVTransferError, status="NOT_FOUND")`."""

    grpc_status = "INTERNAL"

    def __init_subclass__(cls, status: str | None = None, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if status is not None:
            cls.grpc_status = status


class LayoutMismatch(KVTransferError, ValueError, status="FAILED_PRECONDITION"):
    """The two ends disagree on the page geometry or dtype; refused before any byte moves."""


class UnknownTransfer(KVTransferError, KeyError, status="NOT_FOUND"):
    """No transfer is expected for this request id / lease id (never reserved, cancelled or already admitted)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "unknown transfer"


class LeaseExpired(KVTransferError, status="NOT_FOUND"):
    """The lease's deadline passed: the decode worker has freed (or will free) its pages."""


class BadChunk(KVTransferError, ValueError, status="INVALID_ARGUMENT"):
    """A chunk or write names pages outside the lease, a bad layer, offset, size or sequence number."""


class ChecksumMismatch(KVTransferError, status="DATA_LOSS"):
    """Bytes arrived corrupted (a chunk's checksum, or the completion record's checksum over the pages)."""


class IncompleteTransfer(KVTransferError, status="DATA_LOSS"):
    """A short write: some pages of some layer never arrived, or the byte / token count is off."""


class TransferAborted(KVTransferError, status="ABORTED"):
    """The writer gave up, or the request failed on another rank / stream."""


class TransferTimeout(KVTransferError, TimeoutError, status="DEADLINE_EXCEEDED"):
    """The completion record did not appear in time."""


class OutOfSlots(KVTransferError, status="RESOURCE_EXHAUSTED"):
    """Every completion slot of the shm pool is held by an in-flight request."""


class SegmentError(KVTransferError, OSError, status="FAILED_PRECONDITION"):
    """A shared-memory segment is missing, malformed, not ours or has the wrong permissions."""


class TransportUnavailable(KVTransferError, RuntimeError, status="UNIMPLEMENTED"):
    """An optional transport (mooncake, GPU IPC) cannot run here; the message says what is missing."""

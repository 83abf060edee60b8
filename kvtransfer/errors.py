"""Every failure the KV handoff can report; each names the gRPC status it maps to (without importing grpc)."""
from __future__ import annotations


class KVTransferError(Exception):
    """Base class. `grpc_status` is the grpc.StatusCode name rpc.status reports for it."""

    grpc_status = "INTERNAL"


class LayoutMismatch(KVTransferError, ValueError):
    """The two ends disagree on the page geometry or dtype; refused before any byte moves."""

    grpc_status = "FAILED_PRECONDITION"


class UnknownTransfer(KVTransferError, KeyError):
    """No transfer is expected for this request id / lease id (never reserved, cancelled or already admitted)."""

    grpc_status = "NOT_FOUND"

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "unknown transfer"


class LeaseExpired(KVTransferError):
    """The lease's deadline passed: the decode worker has freed (or will free) its pages."""

    grpc_status = "NOT_FOUND"


class BadChunk(KVTransferError, ValueError):
    """A chunk or write names pages outside the lease, a bad layer, offset, size or sequence number."""

    grpc_status = "INVALID_ARGUMENT"


class ChecksumMismatch(KVTransferError):
    """Bytes arrived corrupted (a chunk's checksum, or the completion record's checksum over the pages)."""

    grpc_status = "DATA_LOSS"


class IncompleteTransfer(KVTransferError):
    """A short write: some pages of some layer never arrived, or the byte / token count is off."""

    grpc_status = "DATA_LOSS"


class TransferAborted(KVTransferError):
    """The writer gave up, or the request failed on another rank / stream."""

    grpc_status = "ABORTED"


class TransferTimeout(KVTransferError, TimeoutError):
    """The completion record did not appear in time."""

    grpc_status = "DEADLINE_EXCEEDED"


class OutOfSlots(KVTransferError):
    """Every completion slot of the shm pool is held by an in-flight request."""

    grpc_status = "RESOURCE_EXHAUSTED"


class SegmentError(KVTransferError, OSError):
    """A shared-memory segment is missing, malformed, not ours or has the wrong permissions."""

    grpc_status = "FAILED_PRECONDITION"


class TransportUnavailable(KVTransferError, RuntimeError):
    """An optional transport (mooncake, GPU IPC) cannot run here; the message says what is missing."""

    grpc_status = "UNIMPLEMENTED"

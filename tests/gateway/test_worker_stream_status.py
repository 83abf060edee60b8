"""gateway/worker_stream.ended_status: what the requests pending on a stream that is over fail with. A stream that
broke under its requests (the peer died: gRPC core reports INTERNAL, or UNKNOWN / CANCELLED / no status) fails them
UNAVAILABLE, the code migration and the prefill retry act on; a worker that refused the stream itself keeps its
code; a closing gateway cancels them."""
from __future__ import annotations

import grpc
import pytest

from gateway.worker_stream import ended_status, rpc_error


@pytest.mark.parametrize("code", [grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED,
                                  grpc.StatusCode.OK])
def test_a_broken_stream_fails_its_requests_unavailable(code):
    status, details = ended_status("decode stream to w", rpc_error(code, "Internal error from Core"), closing=False)
    assert status == grpc.StatusCode.UNAVAILABLE and "decode stream to w broke" in details
    assert ended_status("decode stream to w", None, closing=False)[0] == grpc.StatusCode.UNAVAILABLE


def test_a_refused_stream_keeps_the_workers_code_and_closing_cancels():
    refused = rpc_error(grpc.StatusCode.UNAUTHENTICATED, "missing token")
    assert ended_status("prefill stream to w", refused, closing=False)[0] == grpc.StatusCode.UNAUTHENTICATED
    assert ended_status("prefill stream to w", refused, closing=True)[0] == grpc.StatusCode.CANCELLED

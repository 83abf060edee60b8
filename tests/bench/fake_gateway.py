"""A fake pdserve.v1.GatewayService for bench tests: streams known tokens on a known schedule, in-process, port 0."""
from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc

from rpc.v1 import gateway_pb2, gateway_pb2_grpc


def fake_answer_token(prompt_len: int, index: int, vocab_size: int) -> int:
    """The fake's answer token `index` to a prompt of prompt_len tokens (never 0, the fake's EOS)."""
    return 1 + (prompt_len + index) % (vocab_size - 1)


@dataclass(frozen=True)
class FakeTiming:
    """first_token_s before the first chunk, then one chunk of tokens_per_chunk every chunk_gap_s.
    cache_page_size > 0: a stand-in prefix cache (FakeGateway.cached_tokens); 0: none (every usage reports 0)."""

    first_token_s: float = 0.02
    chunk_gap_s: float = 0.01
    tokens_per_chunk: int = 2
    vocab_size: int = 64
    max_context: int = 4096
    eos_token_id: int = 0
    cache_page_size: int = 0


class FakeGateway(gateway_pb2_grpc.GatewayServiceServicer):
    """Token ids must be in the vocabulary; a text prompt "fail" gets an in-stream Error.
    Every accepted request emits exactly max_tokens tokens (ignore_eos or not)."""

    def __init__(self, timing: FakeTiming) -> None:
        self.timing = timing
        self.requests: list[gateway_pb2.GenerateRequest] = []
        self._seen: list[tuple[int, ...]] = []  # every finished prompt + answer (what a prefix cache would hold)
        self._lock = threading.Lock()

    def cached_tokens(self, ids: list[int]) -> int:
        """The longest common prefix with a finished prompt + answer, in whole pages, at most all but the last
        prompt token (as the engine's cache: engine/cache/prefix_cache.py)."""
        page = self.timing.cache_page_size
        if not page:
            return 0
        with self._lock:
            seen = list(self._seen)
        best = 0
        for tokens in seen:
            common = next((i for i, (a, b) in enumerate(zip(tokens, ids)) if a != b), min(len(tokens), len(ids)))
            best = max(best, common)
        return min(best, len(ids) - 1) // page * page

    def GetModelInfo(self, request, context):
        t = self.timing
        return gateway_pb2.GetModelInfoResponse(model="fake-model", vocab_size=t.vocab_size, max_context=t.max_context,
                                     eos_token_ids=[t.eos_token_id], default_max_tokens=16, has_tokenizer=True)

    def Generate(self, request, context):
        t = self.timing
        self.requests.append(request)
        ids = list(request.token_ids.ids)
        if any(not 0 <= token < t.vocab_size for token in ids) or not request.HasField("max_tokens"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "token_ids: out of vocabulary or no max_tokens")
        if request.text == "fail":
            yield gateway_pb2.GenerateResponse(error=gateway_pb2.Error(code=grpc.StatusCode.INTERNAL.value[0],
                                                                       message="injected failure"))
            return
        cached = self.cached_tokens(ids)
        time.sleep(t.first_token_s)
        sent = steps = 0
        answer: list[int] = []
        while sent < request.max_tokens:
            if sent:
                time.sleep(t.chunk_gap_s)
            count = min(t.tokens_per_chunk, request.max_tokens - sent)
            tokens = [fake_answer_token(len(ids), sent + i, t.vocab_size) for i in range(count)]
            answer += tokens
            yield gateway_pb2.GenerateResponse(chunk=gateway_pb2.Chunk(token_ids=tokens))
            sent += count
            steps += 1
        with self._lock:
            self._seen.append(tuple(ids + answer))
        prompt_tokens = len(ids) or len(request.text.split())
        yield gateway_pb2.GenerateResponse(complete=gateway_pb2.Complete(
            finish_reason=gateway_pb2.Complete.FINISH_REASON_LENGTH,
            usage=gateway_pb2.Usage(prompt_tokens=prompt_tokens, completion_tokens=sent, cached_tokens=cached),
            ttft_ms=t.first_token_s * 1000,
            acceptance=gateway_pb2.AcceptanceStats(mean_accepted_tokens=sent / steps, verify_steps=steps),
        ))

    def Abort(self, request, context):
        return gateway_pb2.AbortResponse(found=False)


class RunningFake:
    """Context manager: a sync gRPC server on 127.0.0.1:0 with enough threads for `workers` streams."""

    def __init__(self, timing: FakeTiming = FakeTiming(), workers: int = 16) -> None:
        self.servicer = FakeGateway(timing)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers))
        gateway_pb2_grpc.add_GatewayServiceServicer_to_server(self.servicer, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> RunningFake:
        self.server.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.stop(grace=None).wait()

"""Conversions between engine objects and the messages that carry them between processes. Duck-typed, so
floor 0 needs no engine import: the workers build SamplingParams(**sampling_fields(message))."""
from __future__ import annotations

from typing import Any

from rpc.v1 import gateway_pb2, logprobs_pb2
from rpc.internal.v1 import worker_pb2

# Tokens per Decode / Generate message, at most (GenerateRequest.stream_interval, DecodeRequest.stream_interval).
MAX_STREAM_INTERVAL = 1024


def sampling_to_proto(params: Any) -> worker_pb2.WorkerSampling:
    message = worker_pb2.WorkerSampling(
        max_new_tokens=params.max_new_tokens, temperature=params.temperature, top_k=params.top_k,
        top_p=params.top_p, min_p=params.min_p, stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos, logprobs=params.logprobs,
    )
    if params.seed is not None:
        message.seed = params.seed
    if params.speculative is not None:
        message.speculative = params.speculative
    if params.block_size is not None:
        message.block_size = params.block_size
    return message


def sampling_fields(message: worker_pb2.WorkerSampling) -> dict[str, Any]:
    """engine.sampling_params.SamplingParams keyword arguments (unset optional fields become None)."""
    return dict(
        max_new_tokens=message.max_new_tokens, temperature=message.temperature, top_k=message.top_k,
        top_p=message.top_p, min_p=message.min_p, seed=message.seed if message.HasField("seed") else None,
        stop_token_ids=tuple(message.stop_token_ids), ignore_eos=message.ignore_eos, logprobs=message.logprobs,
        speculative=message.speculative if message.HasField("speculative") else None,
        block_size=message.block_size if message.HasField("block_size") else None,
    )


def logprob_to_proto(logprob: Any) -> logprobs_pb2.TokenLogprob:
    """logprob: engine.sequence.TokenLogprob (token_id, logprob, top_ids, top_logprobs)."""
    return logprobs_pb2.TokenLogprob(
        token_id=logprob.token_id, logprob=logprob.logprob,
        top=[logprobs_pb2.TopLogprob(token_id=t, logprob=v) for t, v in zip(logprob.top_ids, logprob.top_logprobs)],
    )


def finish_reason_name(value: int) -> str:
    """A Complete.FinishReason value's short name: "STOP", "LENGTH", "ABORT" (or "UNSPECIFIED")."""
    return gateway_pb2.Complete.FinishReason.Name(value).removeprefix("FINISH_REASON_")

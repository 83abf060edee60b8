"""Conversions between engine objects and the messages that carry them between processes. Duck-typed, so
floor 0 needs no engine import: the workers build SamplingParams(**sampling_fields(message))."""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Protocol, TypeVar, Union

import grpc
from google.protobuf.message import Message

from rpc.v1 import gateway_pb2, logprobs_pb2
from rpc.internal.v1 import worker_pb2
from rpc.processes import node_id
from rpc.status import unary

# Tokens per Decode / Generate message, at most (GenerateRequest.stream_interval, DecodeRequest.stream_interval).
MAX_STREAM_INTERVAL = 1024
M = TypeVar("M", bound=Message)
FieldValue = Union[int, float, bool, str, tuple[int, ...], None]  # a scalar field (or a repeated int field)

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


class Sampling(Protocol):
    """What sampling_to_proto reads of an engine.sampling_params.SamplingParams."""

    max_new_tokens: int
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    logprobs: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int | None
    speculative: bool | None
    block_size: int | None


class Logprob(Protocol):
    """An engine.runtime.sequence.TokenLogprob."""

    token_id: int
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


class _RoleConfig(Protocol):
    engine: object  # an engine.engine_config.EngineConfig


class _LoadService(Protocol):
    """A worker service as its Get*Load RPC reads it."""

    config: _RoleConfig
    load: DataclassInstance


def set_given(message: Message, source: object, names: Iterable[str]) -> None:
    """message.<name> = source.<name> (source[name] for a mapping) for each name whose value is not None, so
    that an optional field stays unset (HasField false) where the source leaves it open."""
    for name in names:
        value = source[name] if isinstance(source, Mapping) else getattr(source, name)
        if value is not None:
            setattr(message, name, value)


# WorkerSampling.distribution's scalar fields (and its logit_bias map)
_DISTRIBUTION = ("temperature", "top_k", "top_p", "min_p", "seed", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "min_tokens")
_OPTIONAL = ("speculative", "block_size", "prompt_logprobs")  # WorkerSampling's own optional fields


def sampling_to_proto(params: Sampling) -> worker_pb2.WorkerSampling:
    """params: engine.sampling_params.SamplingParams."""
    message = worker_pb2.WorkerSampling(max_new_tokens=params.max_new_tokens, stop_token_ids=list(params.stop_token_ids),
                                        ignore_eos=params.ignore_eos, logprobs=params.logprobs)
    set_given(message.distribution, params, _DISTRIBUTION)
    message.distribution.logit_bias.update(dict(params.logit_bias))
    set_given(message, params, _OPTIONAL)
    if params.structured_output is not None:
        message.structured_output.CopyFrom(structured_to_proto(*params.structured_output))
    return message


def structured_to_proto(kind: str, text: str) -> gateway_pb2.StructuredOutput:
    """(kind, text) as engine.sampling_params.SamplingParams.structured_output holds it -> the message."""
    if kind == "json_object":
        return gateway_pb2.StructuredOutput(json_object=True)
    if kind == "choice":
        return gateway_pb2.StructuredOutput(choice=gateway_pb2.StructuredOutput.Choices(options=json.loads(text)))
    return gateway_pb2.StructuredOutput(**{kind: text})


def structured_from_proto(message: gateway_pb2.StructuredOutput) -> tuple[str, str] | None:
    """The message -> (kind, text); None when no kind is set (json_object false counts as unset)."""
    kind = message.WhichOneof("kind")
    if kind is None or (kind == "json_object" and not message.json_object):
        return None
    if kind == "json_object":
        return kind, ""
    if kind == "choice":
        return kind, json.dumps(list(message.choice.options))
    return kind, getattr(message, kind)


def present_fields(message: Message, names: Iterable[str]) -> dict[str, FieldValue]:
    """{name: value} of the named optional fields that are set (set_given's way back)."""
    return {name: getattr(message, name) for name in names if message.HasField(name)}


def sampling_fields(message: worker_pb2.WorkerSampling) -> dict[str, FieldValue]:
    """engine.sampling_params.SamplingParams keyword arguments; an unset optional field is left out (the
    engine's default: seed None, speculative None, ...)."""
    return dict(max_new_tokens=message.max_new_tokens, stop_token_ids=tuple(message.stop_token_ids),
                ignore_eos=message.ignore_eos, logprobs=message.logprobs,
                logit_bias=tuple(sorted(message.distribution.logit_bias.items())),
                structured_output=structured_from_proto(message.structured_output),
                **present_fields(message.distribution, _DISTRIBUTION), **present_fields(message, _OPTIONAL))


def load_to_proto(message_cls: type[M], load: DataclassInstance, **placement: str) -> M:
    """A Get*LoadResponse from a worker's load dataclass (its fields have the message's names, but for
    tp_size, which goes into the WorkerPlacement with this node's id and the `placement` fields)."""
    fields = dataclasses.asdict(load)
    where = worker_pb2.WorkerPlacement(node_id=node_id(), tp_size=fields.pop("tp_size"), **placement)
    return message_cls(**fields, placement=where)


def load_method(message_cls: type[M], *placement: str) -> Callable[..., Awaitable[M]]:
    """A worker servicer's Get*Load RPC (servicers keep their service as self._service): the service's load
    snapshot as a message_cls, with the named fields of its engine config (service.config.engine) in the
    placement."""

    @unary
    async def get_load(self: object, request: Message, context: grpc.aio.ServicerContext) -> M:
        service: _LoadService = getattr(self, "_service")
        engine = service.config.engine
        return load_to_proto(message_cls, service.load, **{name: getattr(engine, name) for name in placement})

    return get_load


def logprob_to_proto(logprob: Logprob) -> logprobs_pb2.TokenLogprob:
    """logprob: engine.runtime.sequence.TokenLogprob (token_id, logprob, top_ids, top_logprobs)."""
    return logprobs_pb2.TokenLogprob(
        token_id=logprob.token_id, logprob=logprob.logprob,
        top=[logprobs_pb2.TopLogprob(token_id=t, logprob=v) for t, v in zip(logprob.top_ids, logprob.top_logprobs)],
    )


def finish_reason_name(value: int) -> str:
    """A Complete.FinishReason value's short name: "STOP", "LENGTH", "ABORT" (or "UNSPECIFIED")."""
    return gateway_pb2.Complete.FinishReason.Name(value).removeprefix("FINISH_REASON_")

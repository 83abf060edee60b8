"""gRPC Gateway servicer: protobuf <-> GatewayService / RequestRun events, nothing else.

Generate is registered with a raw-bytes deserializer (gateway.wire) so that a request setting both
members of the input oneof can be rejected."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc

from gateway.orchestrator import ErrorEvent, FinishEvent, TokensEvent
from gateway.service import GatewayService
from gateway.wire import WireGenerateRequest, parse_generate_request_bytes
from rpc.logging_setup import REQUEST_ID_KEY
from rpc.status import InvalidArgument, abort, status_for, streaming, unary
from rpc.v1 import gateway_pb2

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name
FINISH_REASONS = {"stop": gateway_pb2.Complete.FINISH_REASON_STOP, "length": gateway_pb2.Complete.FINISH_REASON_LENGTH,
                  "abort": gateway_pb2.Complete.FINISH_REASON_ABORT}


def complete_message(event: FinishEvent) -> gateway_pb2.Complete:
    mean = event.decode_tokens / event.decode_steps if event.decode_steps else 0.0
    return gateway_pb2.Complete(
        finish_reason=FINISH_REASONS.get(event.reason, gateway_pb2.Complete.FINISH_REASON_UNSPECIFIED),
        usage=gateway_pb2.Usage(prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens,
                                cached_tokens=event.cached_tokens),
        ttft_ms=event.ttft_ms, stop=event.stop,
        acceptance=gateway_pb2.AcceptanceStats(mean_accepted_tokens=mean, verify_steps=event.decode_steps),
    )


def coalesce(first: TokensEvent, events: asyncio.Queue) -> tuple[TokensEvent, FinishEvent | ErrorEvent | None]:
    """`first` merged with the TokensEvents already queued behind it (the stream fell behind: what piled up
    goes as one message, as the HTTP front does), and the final event if one was queued after them."""
    tokens, text, logprobs = list(first.token_ids), [first.text], list(first.logprobs)
    while not events.empty():
        event = events.get_nowait()
        if not isinstance(event, TokensEvent):
            return TokensEvent(tokens, "".join(text), logprobs), event
        tokens += event.token_ids
        text.append(event.text)
        logprobs += event.logprobs
    if len(text) == 1:
        return first, None
    return TokensEvent(tokens, "".join(text), logprobs), None


class GatewayServicer:
    def __init__(self, service: GatewayService) -> None:
        self._service = service

    @streaming
    async def Generate(self, wire: WireGenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        arrival = time.perf_counter()
        left = context.time_remaining()
        deadline = None if left is None else time.monotonic() + left
        outcome = ["error", grpc.StatusCode.CANCELLED.name]  # (final status, code) for the metrics
        if not wire.message.request_id:  # x-request-id metadata names the request when the message does not
            wire.message.request_id = next((value for key, value in context.invocation_metadata() or ()
                                            if key == REQUEST_ID_KEY), "")
        try:
            run = await self._service.submit(wire.message, wire.both_inputs, arrival, deadline)
        except Exception as error:
            self._service.metrics.count("grpc", "error", status_for(error)[0].name)
            raise
        context.add_done_callback(lambda _: run.cancel())  # client gone: abort on every worker
        request_id = run.job.request_id
        held: TokensEvent | FinishEvent | ErrorEvent | None = None
        first = True  # the prefill's token goes alone: it is the client's time to first token
        try:
            while True:
                event, held = (held, None) if held is not None else (await run.events.get(), None)
                if isinstance(event, TokensEvent):
                    if not first:
                        event, held = coalesce(event, run.events)
                    first = False
                    yield gateway_pb2.GenerateResponse(request_id=request_id, chunk=gateway_pb2.Chunk(
                        token_ids=event.token_ids, text=event.text, logprobs=event.logprobs,
                        prompt_logprobs=event.prompt_logprobs))
                elif isinstance(event, FinishEvent):
                    outcome = [event.reason, grpc.StatusCode.OK.name]
                    yield gateway_pb2.GenerateResponse(request_id=request_id, complete=complete_message(event))
                    return
                elif isinstance(event, ErrorEvent):
                    status = event.status
                    outcome = ["error", status.code.name]
                    yield gateway_pb2.GenerateResponse(request_id=request_id, error=gateway_pb2.Error(
                        code=status.code.value[0], message=status.details))
                    await abort(context, status)
        finally:
            if outcome[1] == grpc.StatusCode.CANCELLED.name:
                outcome[0] = "abort"
            self._service.metrics.count("grpc", *outcome)
            run.cancel()

    @unary
    async def Abort(self, request: gateway_pb2.AbortRequest, context: grpc.aio.ServicerContext) -> gateway_pb2.AbortResponse:
        if not request.request_id:
            raise InvalidArgument("request_id", "is empty")
        return gateway_pb2.AbortResponse(found=self._service.abort(request.request_id))

    @unary
    async def GetModelInfo(self, request: gateway_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> gateway_pb2.GetModelInfoResponse:
        return self._service.model_info()


def add_gateway_to_server(servicer: GatewayServicer, server: grpc.aio.Server) -> None:
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=parse_generate_request_bytes,
            response_serializer=gateway_pb2.GenerateResponse.SerializeToString),
        "Abort": grpc.unary_unary_rpc_method_handler(
            servicer.Abort, request_deserializer=gateway_pb2.AbortRequest.FromString,
            response_serializer=gateway_pb2.AbortResponse.SerializeToString),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetModelInfo, request_deserializer=gateway_pb2.GetModelInfoRequest.FromString,
            response_serializer=gateway_pb2.GetModelInfoResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))

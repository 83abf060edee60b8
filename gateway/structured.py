"""A request's structured output (GenerateRequest.structured_output), checked at the gateway before any work:
a grammar llguidance cannot compile is an INVALID_ARGUMENT naming the problem."""
from __future__ import annotations

import functools

from engine.sampling.grammar_compiler import GrammarCompiler, GrammarError
from gateway.model_info import ModelFacts
from gateway.tokenizer import TextTokenizer
from rpc.convert import structured_from_proto
from rpc.status import InvalidArgument
from rpc.v1 import gateway_pb2


@functools.lru_cache(maxsize=4)
def _compiler(tokenizer: TextTokenizer, vocab_size: int, eos_ids: tuple[int, ...]) -> GrammarCompiler:
    return GrammarCompiler(tokenizer.to_json(), vocab_size, eos_ids)


def check_structured_output(request: gateway_pb2.GenerateRequest, facts: ModelFacts,
                            tokenizer: TextTokenizer | None) -> tuple[str, str] | None:
    """The request's (kind, text) for SamplingParams.structured_output, compiled once to check it; None: unset."""
    spec = structured_from_proto(request.structured_output) if request.HasField("structured_output") else None
    if spec is None:
        return None
    if tokenizer is None:
        raise InvalidArgument("structured_output", "needs the model's tokenizer.json; this model has none")
    try:
        _compiler(tokenizer, facts.vocab_size, tuple(facts.eos_token_ids)).check(*spec)
    except GrammarError as error:
        raise InvalidArgument("structured_output", str(error)) from None
    return spec

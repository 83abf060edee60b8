"""decode_worker.streams.TokenStreams: outputs reach only open streams, piled-up outputs are merged into one
update without the prefill token, and a failure ends a stream with its error after what it already held."""
from __future__ import annotations

import pytest

from decode_worker.streams import EngineStepFailed, TokenStreams
from engine.engine_types import StepOutput


def _output(request_id: str, tokens: list[int], finished: bool = False) -> StepOutput:
    return StepOutput(request_id=request_id, new_token_ids=tokens, finished=finished,
                      finish_reason="length" if finished else None, logprobs=[], num_prompt_tokens=3,
                      num_generated=len(tokens))


async def test_piled_up_outputs_merge_and_the_stream_ends_finished():
    """Three outputs dispatched before the reader looks come back as one update: the first token (prefill's)
    dropped, the rest in order, finished; an output for a request with no open stream goes nowhere."""
    streams = TokenStreams()
    streams.open("a")
    streams.dispatch([_output("a", [7]), _output("nobody", [1])])
    streams.dispatch([_output("a", [8, 9])])
    streams.dispatch([_output("a", [10], finished=True)])
    updates = [update async for update in streams.read("a")]
    assert [(u.token_ids, u.finished, u.steps) for u in updates] == [([8, 9, 10], True, 3)]
    streams.dispatch([_output("a", [11])])  # closed once read to the end: dropped, no error


async def test_failure_ends_only_the_named_stream():
    """fail() raises its error in the named stream's reader; another open stream keeps its outputs."""
    streams = TokenStreams()
    streams.open("a")
    streams.open("b")
    streams.fail(["a"], EngineStepFailed("engine step failed: RuntimeError: boom"))
    streams.dispatch([_output("b", [4]), _output("b", [5], finished=True)])
    with pytest.raises(EngineStepFailed, match="boom"):
        async for _ in streams.read("a"):
            pass
    assert [u.token_ids async for u in streams.read("b")] == [[5]]  # 4 is prefill's token, re-emitted

"""The embedded default model (models/pdserve-tiny, target + trained draft) served end to end: real text,
identical to the in-process engine, and speculative decoding accepting draft tokens."""
from __future__ import annotations

import pytest

from engine.paths import DSV3_MODEL_DIR
from engine.sampling_params import SamplingParams
from gateway.client import build_request, generate
from gateway.tokenizer import TextTokenizer
from tests.services.conftest import launch
from tests.services.helpers import gateway_stub

DEFAULT_MODEL = DSV3_MODEL_DIR  # the K3 default through the services: the K3 state handoff's tests
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not (DEFAULT_MODEL / "config.json").is_file() or not (DEFAULT_MODEL / "draft" / "config.json").is_file(),
    reason="models/pdserve-tiny (with draft/) is not built in this checkout")]
PROMPT = "def fibonacci(n):\n"
MAX_TOKENS = 48


async def test_default_model_through_the_gateway(tmp_path):
    """Greedy text for a Python prompt equals the in-process engine's tokens, decodes cleanly (no U+FFFD),
    and the draft's tokens are accepted (more than one token per decode step on average)."""
    from engine import LLM

    tokenizer = TextTokenizer.from_model_dir(DEFAULT_MODEL)
    with LLM(str(DEFAULT_MODEL), attention_backend="torch", num_threads=1) as llm:
        expected = llm.generate([tokenizer.encode(PROMPT)], SamplingParams(max_new_tokens=MAX_TOKENS, temperature=0.0))[0]
    cluster = launch(DEFAULT_MODEL, tmp_path)
    try:
        async with gateway_stub(cluster.gateway_address) as stub:
            result = await generate(stub, build_request(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0), timeout=300)
    finally:
        cluster.stop()
    assert result.token_ids == expected
    assert result.text == tokenizer.decode(expected) and result.text.strip() and "\ufffd" not in result.text
    assert result.complete.acceptance.mean_accepted_tokens > 1.0

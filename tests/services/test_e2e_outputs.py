"""Through the gateway (real processes on loopback) outputs are exactly the in-process engine's."""
from __future__ import annotations

import asyncio

import pytest

from gateway.client import build_request, generate
from gateway.tokenizer import TextTokenizer
from tests.services.conftest import MAX_TOKENS, PROMPTS
from tests.services.helpers import gateway_stub, greedy, greedy_through_gateway, token_prompts


@pytest.mark.parametrize("speculative", [True, False], ids=["spec", "nospec"])
async def test_greedy_outputs_match_in_process(cluster, reference, speculative):
    """16 prompts of 1..2048 tokens, sent concurrently, come back token-identical to LLM.generate,
    each finishing with LENGTH and usage that counts its prompt and output; the decode steps reported times
    the tokens per step are the tokens decode made (one step per token without speculation)."""
    results = await greedy_through_gateway(cluster.gateway_address, PROMPTS, MAX_TOKENS, speculative)
    assert [r.token_ids for r in results] == reference[speculative]
    for prompt, result in zip(PROMPTS, results):
        assert result.error is None and result.finish_reason == "LENGTH"
        assert (result.complete.usage.prompt_tokens, result.complete.usage.completion_tokens) == (len(prompt), MAX_TOKENS)
        assert result.complete.ttft_ms > 0
        steps, mean = result.complete.acceptance.verify_steps, result.complete.acceptance.mean_accepted_tokens
        assert steps * mean == pytest.approx(MAX_TOKENS - 1)  # the decode worker made all but the first token
        assert (1 <= steps <= MAX_TOKENS - 1) if speculative else (steps, mean) == (MAX_TOKENS - 1, 1.0)


def test_decode_worker_forks_its_engine_process(cluster):
    """On the CPU the decode worker starts its engine process by fork (one thread at that point), so the
    engine process does not import torch and the engine modules a second time; the log says which."""
    log = (cluster.log_dir / "decode-0.log").read_text()
    assert "decode engine process" in log and "(fork) ready" in log, log[-2000:]


async def test_64_concurrent_streams_equal_their_solo_results(cluster, llm):
    """64 streaming requests in flight at once each produce what the same prompt produces alone."""
    prompts = token_prompts(tuple(3 + (i * 37) % 250 for i in range(64)), seed=1)
    solo = [llm.generate([prompt], greedy(12))[0] for prompt in prompts]
    results = await greedy_through_gateway(cluster.gateway_address, prompts, 12, speculative=True)
    mismatched = [i for i, (result, expected) in enumerate(zip(results, solo)) if result.token_ids != expected]
    assert not mismatched, f"requests {mismatched} differ from their solo greedy results"
    assert all(len(result.deltas) >= 2 for result in results)  # streamed, not one final message


def _split_multibyte(tokenizer: TextTokenizer, ids: list[int]) -> bool:
    """Whether some non-ASCII character of decode(ids) needs more than one of the ids."""
    text = tokenizer.decode(ids)
    for end in range(1, len(ids)):
        partial = tokenizer.decode(ids[:end])
        if partial.endswith("\ufffd") and not text.startswith(partial):
            return True
    return False


async def test_streamed_text_deltas_concatenate_to_the_final_text(cluster, llm, service_model):
    """Text deltas of a text prompt's stream join to decode(output ids) exactly, including a multi-byte
    character split over tokens (never emitted half: that would leave a U+FFFD in the joined text)."""
    tokenizer = TextTokenizer.from_model_dir(service_model)
    candidates = ["日本語のテキスト", "naïve café", "emoji 🙂🚀", "def main(argv):", "∑ ≠ ∞ math", "import os, sys"]
    chosen = None
    for text in candidates:
        ids = llm.generate([tokenizer.encode(text)], greedy(48))[0]
        if _split_multibyte(tokenizer, ids):
            chosen = text
            break
    assert chosen is not None, "no candidate prompt produced a split multi-byte character"
    async with gateway_stub(cluster.gateway_address) as stub:
        result = await generate(stub, build_request(chosen, max_tokens=48, temperature=0.0, ignore_eos=True), timeout=120)
    assert result.token_ids == ids
    assert result.text == tokenizer.decode(ids)
    assert any(not delta for delta in result.deltas[:-1])  # some chunk's bytes were held back


async def test_stop_string_truncates_and_finishes_with_stop(cluster, llm, service_model):
    """A stop string taken from the middle of the known output ends the text right before it (STOP),
    and the reported stop is that string."""
    tokenizer = TextTokenizer.from_model_dir(service_model)
    prompt = tokenizer.encode("import os, sys")
    ids = llm.generate([prompt], greedy(40))[0]
    full = tokenizer.decode(ids)
    clean = [i for i in range(len(full) // 3, len(full) - 3) if "\ufffd" not in full[i:i + 3]]
    assert clean, f"no clean 3-character span in {full!r}"
    stop = full[clean[0]:clean[0] + 3]
    async with gateway_stub(cluster.gateway_address) as stub:
        result = await generate(stub, build_request("import os, sys", max_tokens=40, temperature=0.0,
                                                    ignore_eos=True, stop=[stop]), timeout=120)
    assert result.finish_reason == "STOP" and result.complete.stop == stop
    assert result.text == full[: full.index(stop)]
    assert len(result.token_ids) <= len(ids) and result.token_ids == ids[: len(result.token_ids)]


@pytest.mark.parametrize("speculative", [True, False], ids=["spec", "nospec"])
async def test_stream_interval_batches_chunks_without_changing_outputs(cluster, reference, speculative):
    """With stream_interval 5 the tokens are the in-process greedy ones; the first chunk is the first
    token alone (sent at prefill), every later chunk but the last carries at least 5 tokens, and fewer
    chunks arrive than without it."""
    prompts, expected = PROMPTS[:4], reference[speculative][:4]
    async with gateway_stub(cluster.gateway_address) as stub:
        results = await asyncio.gather(*(
            generate(stub, build_request(prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                         speculative=None if speculative else False, stream_interval=5), timeout=300)
            for prompt in prompts))
    assert [r.token_ids for r in results] == expected
    for result in results:
        assert result.error is None and result.finish_reason == "LENGTH"
        sizes = [size for size in result.chunk_sizes if size]
        assert sizes[0] == 1 and all(size >= 5 for size in sizes[1:-1]), sizes
        assert len(sizes) <= 1 + -(-(MAX_TOKENS - 1) // 5)

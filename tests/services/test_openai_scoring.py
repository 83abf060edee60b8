"""Prompt scoring on the shared deployment (1 prefill + 1 decode + gateway): /v1/completions with echo +
logprobs (+ max_tokens 0), vLLM's prompt_logprobs, the gRPC prompt_logprobs field, and EleutherAI's lm-eval
(model type local-completions) running a multiple-choice task from a local jsonl file: its accuracy comes
back and every loglikelihood equals the engine's own log_softmax(llm.logits) to 1e-4."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
import torch

from gateway.client import build_request
from tests.services.helpers import gateway_stub

pytestmark = pytest.mark.slow
PROMPT = [5, 9, 7, 5, 9, 7, 5, 11, 12, 40, 41]


def _post(address: str, body: dict) -> dict:
    async def run() -> dict:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://{address}/v1/models") as response:
                body["model"] = (await response.json())["data"][0]["id"]
            async with http.post(f"http://{address}/v1/completions", json=body) as response:
                assert response.status == 200, await response.text()
                return await response.json()

    return asyncio.run(run())


def _reference(llm, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(llm.logits(ids).float(), dim=-1)


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_logprobs_score_the_prompt(cluster, llm, max_tokens):
    """lm-eval's request shape (token-id prompt in a batch of one, echo, logprobs 1, temperature 0): the answer
    lists every prompt token, the first with a null logprob and null alternatives, the others with the
    engine's log_softmax value (1e-4) and its argmax as the alternative; then the generated token
    (max_tokens 1) or nothing (max_tokens 0: completion_tokens 0)."""
    body = _post(cluster.http_address, {"prompt": [PROMPT], "echo": True, "logprobs": 1, "max_tokens": max_tokens,
                                        "temperature": 0})
    choice = body["choices"][0]
    block = choice["logprobs"]
    reference = _reference(llm, PROMPT)
    assert len(block["tokens"]) == len(PROMPT) + max_tokens
    assert block["token_logprobs"][0] is None and block["top_logprobs"][0] is None
    for position in range(1, len(PROMPT)):
        expected = float(reference[position - 1, PROMPT[position]])
        assert abs(block["token_logprobs"][position] - expected) < 1e-4
        (top_value,) = block["top_logprobs"][position].values()
        assert abs(top_value - float(reference[position - 1].max())) < 1e-4
    assert body["usage"]["completion_tokens"] == max_tokens and body["usage"]["prompt_tokens"] == len(PROMPT)
    if max_tokens == 1:
        assert abs(block["token_logprobs"][-1] - float(reference[-1].max())) < 1e-4


def test_vllm_prompt_logprobs_field(cluster, llm):
    """prompt_logprobs 2 (vLLM's extension, no echo): choice.prompt_logprobs is null then, per prompt token, the
    token and the 2 most likely alternatives with ranks 1 and 2, values equal to the engine's."""
    body = _post(cluster.http_address, {"prompt": PROMPT, "prompt_logprobs": 2, "max_tokens": 2, "temperature": 0})
    entries = body["choices"][0]["prompt_logprobs"]
    reference = _reference(llm, PROMPT)
    assert entries[0] is None and len(entries) == len(PROMPT)
    for position in range(1, len(PROMPT)):
        entry = entries[position]
        assert abs(entry[str(PROMPT[position])]["logprob"] - float(reference[position - 1, PROMPT[position]])) < 1e-4
        values, ids = reference[position - 1].topk(2)
        for rank, (value, token) in enumerate(zip(values.tolist(), ids.tolist()), start=1):
            assert entry[str(token)]["rank"] == rank and abs(entry[str(token)]["logprob"] - value) < 1e-4
    assert body["choices"][0]["logprobs"] is None and body["usage"]["completion_tokens"] == 2


def test_grpc_prompt_logprobs(cluster, llm):
    """GenerateRequest.prompt_logprobs: the first Chunk carries one entry per prompt token after the first, with
    the engine's values; later chunks carry none."""
    async def run():
        async with gateway_stub(cluster.gateway_address) as stub:
            request = build_request(PROMPT, max_tokens=3, temperature=0.0, ignore_eos=True)
            request.prompt_logprobs = 1
            return [message async for message in stub.Generate(request, timeout=120)]

    messages = asyncio.run(run())
    chunks = [m.chunk for m in messages if m.WhichOneof("kind") == "chunk"]
    reference = _reference(llm, PROMPT)
    scored = list(chunks[0].prompt_logprobs)
    assert [item.token_id for item in scored] == PROMPT[1:]
    for position, item in enumerate(scored):
        assert abs(item.logprob - float(reference[position, PROMPT[position + 1]])) < 1e-4
        assert item.top[0].token_id == int(reference[position].argmax())
    assert all(not chunk.prompt_logprobs for chunk in chunks[1:])


QUESTIONS = [  # lm-eval puts its target_delimiter " " between question and choice
    ("def main(argv):\n    return", ["0", "argv", "None"], 0),
    ("import os\nimport", ["sys", "os", "zzz"], 0),
    ("for i in range(10):\n    print", ["(i)", "[x]", "9"], 0),
    ("class Foo:\n    def __init__(self,", ["x):", "9", "]"], 0),
    ("if __name__ ==", ["'__main__':", "3", "[]"], 0),
    ("    return self", [".name", "9", "((("], 0),
]


def _write_task(root: Path) -> Path:
    """A multiple-choice lm-eval task over a local jsonl file (no dataset download)."""
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "pdserve_mc.yaml").write_text(
        "task: pdserve_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\n"
        "metric_list:\n  - metric: acc\n")
    return tasks


def _encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split (TemplateLM._encode_pair, causal): trailing spaces move to the continuation, the whole
    text is encoded and the context's tokens cut off."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    head = len(tokenizer(context, add_special_tokens=False).input_ids)
    return whole[:head], whole[head:]


def test_lm_eval_multiple_choice(cluster, llm, service_model, tmp_path):
    """`lm-eval run --model local-completions` against /v1/completions: the task finishes with an accuracy in
    [0, 1] for all questions, and each choice's loglikelihood equals the sum of the engine's log_softmax over the
    continuation tokens (1e-4)."""
    from transformers import AutoTokenizer

    tasks = _write_task(tmp_path)
    out = tmp_path / "out"
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "TOKENIZERS_PARALLELISM": "false"}
    model_args = (f"model={service_model.name},base_url=http://{cluster.http_address}/v1/completions,"
                  f"tokenizer={service_model},tokenizer_backend=huggingface,num_concurrent=1,max_retries=1")
    run = subprocess.run(
        [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args", model_args,
         "--tasks", "pdserve_mc", "--include_path", str(tasks), "--output_path", str(out), "--log_samples"],
        env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    accuracy = results["results"]["pdserve_mc"]["acc,none"]
    assert 0.0 <= accuracy <= 1.0
    samples = [json.loads(line) for line in next(out.rglob("samples_pdserve_mc_*.jsonl")).read_text().splitlines()]
    assert len(samples) == len(QUESTIONS)
    tokenizer = AutoTokenizer.from_pretrained(str(service_model))
    correct = 0
    for sample in samples:
        lls = []
        ordered = sorted(sample["arguments"].items(), key=lambda item: int(item[0].rsplit("_", 1)[1]))  # gen_args_i
        pairs = [(args["arg_0"], args["arg_1"]) for _, args in ordered]
        for (context, continuation), resp in zip(pairs, sample["resps"]):
            head, tail = _encode_pair(tokenizer, context, continuation)
            reference = _reference(llm, head + tail)
            expected = sum(float(reference[len(head) + i - 1, token]) for i, token in enumerate(tail))
            assert abs(float(resp[0][0]) - expected) < 1e-4, (context, continuation)
            lls.append(expected)
        correct += int(max(range(len(lls)), key=lls.__getitem__) == int(sample["target"]))
    assert accuracy == pytest.approx(correct / len(QUESTIONS))
    print(f"lm-eval accuracy on {len(QUESTIONS)} questions: {accuracy:.3f}")

"""Engine vs transformers on one device, for scripts/gpu_check.py: fp32 tiny configs (logits within
1e-4, greedy continuations identical) and the default model in bf16 (greedy identical)."""
from __future__ import annotations

from pathlib import Path

import torch

PROMPT_LEN, NEW_TOKENS = 37, 16


def _prompt(vocab: int, seed: int, length: int = PROMPT_LEN) -> list[int]:
    return torch.randint(2, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_greedy(model, prompt: list[int], new_tokens: int, device: torch.device) -> list[int]:
    from transformers import GenerationConfig

    ids = torch.tensor([prompt], device=device)
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, len(prompt):].tolist()


def _compare(model_dir: Path, device: str, dtype: str, prompts: list[list[int]], check_logits: bool) -> dict:
    from transformers import DeepseekV3ForCausalLM

    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    torch_device = torch.device(device)
    reference = DeepseekV3ForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype),
                                                      attn_implementation="eager").to(torch_device).eval()
    result: dict = {"model": model_dir.name, "dtype": dtype}
    with LLM(str(model_dir), device=device, dtype=dtype, max_running=len(prompts)) as llm:
        if check_logits:
            engine_logits = llm.logits(prompts[0]).float().cpu()
            with torch.inference_mode():
                expected = reference(torch.tensor([prompts[0]], device=torch_device)).logits[0].float().cpu()
            result["max_abs_diff"] = float((engine_logits - expected).abs().max())
        params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        engine_tokens = llm.generate(prompts, params)
    hf_tokens = [_hf_greedy(reference, prompt, NEW_TOKENS, torch_device) for prompt in prompts]
    result["greedy_identical"] = engine_tokens == hf_tokens
    if not result["greedy_identical"]:
        result["first_mismatch"] = next(
            (i, j) for i, (a, b) in enumerate(zip(engine_tokens, hf_tokens)) for j in range(len(a)) if a[j] != b[j])
    return result


def fp32_tiny_parity(device: str, variants: tuple[str, ...] | None = None, work_dir: str = ".") -> list[dict]:
    """Every tiny variant (tests/engine/tiny_models.py) in fp32 on `device`."""
    from tests.engine.tiny_models import VARIANTS, make_tiny_checkpoint

    results = []
    for variant in variants or VARIANTS:
        path = make_tiny_checkpoint(Path(work_dir) / "tiny", variant)
        vocab = 320
        prompts = [_prompt(vocab, seed) for seed in range(3)]
        results.append({"variant": variant, **_compare(path, device, "float32", prompts, check_logits=True)})
    return results


def bf16_default_model_greedy(device: str) -> dict:
    """The embedded model (its draft on: greedy speculative decoding stays exact) in bf16."""
    from engine.paths import DSV3_MODEL_DIR as DEFAULT_MODEL_DIR

    prompts = [_prompt(4096, seed, length=24) for seed in range(4)]
    return _compare(Path(DEFAULT_MODEL_DIR), device, "bfloat16", prompts, check_logits=False)

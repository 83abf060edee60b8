"""The draft in a dtype of its own (EngineConfig.draft_dtype): a bf16 draft beside an fp32 target proposes as
the fp32 one does, and the target's verification keeps every output exact."""
from __future__ import annotations

import pytest
import torch

from benchmarks.prompts import held_out_prompts
from engine import LLM, SamplingParams
from engine.engine_config import EngineConfig
from engine.paths import MODELS_DIR

MODELS = ("pdserve-tiny", "pdserve-k3-tiny")  # a DFlash draft and a DSpark draft (with its Markov head)


def test_draft_dtype_config():
    """auto is the target's dtype; an explicit value wins; an unknown one is refused."""
    model = str(MODELS_DIR / "pdserve-tiny")
    assert EngineConfig(model_dir=model, device="cpu").draft_dtype_name == "float32"
    assert EngineConfig(model_dir=model, device="cpu", dtype="bfloat16").draft_dtype_name == "bfloat16"
    assert EngineConfig(model_dir=model, device="cpu", draft_dtype="bfloat16").draft_dtype_name == "bfloat16"
    with pytest.raises(ValueError, match="draft_dtype must be 'auto' or one of"):
        EngineConfig(model_dir=model, device="cpu", draft_dtype="int8")


@pytest.mark.slow  # two engines per model x 4 prompts x 48 tokens, spec on and off
@pytest.mark.parametrize("model", MODELS)
def test_bf16_draft_beside_fp32_target(model):
    """Same greedy outputs as plain decoding with either draft dtype; the bf16 draft's weights, LM head copy
    and proposals are bf16-made, and it still gets drafts accepted at about the fp32 draft's rate."""
    model_dir = MODELS_DIR / model
    prompts = [p.token_ids for p in held_out_prompts(model_dir, 4, 48, 4096)[0]]
    plain = SamplingParams(max_new_tokens=48, temperature=0.0, ignore_eos=True, speculative=False)
    spec = SamplingParams(max_new_tokens=48, temperature=0.0, ignore_eos=True)
    accepted = {}
    for draft_dtype in ("float32", "bfloat16"):
        with LLM(str(model_dir), device="cpu", dtype="float32", draft_dtype=draft_dtype, num_threads=1) as llm:
            runner = llm.engine.runner
            weights = {p.dtype for p in runner.draft.parameters()}
            assert weights == {getattr(torch, draft_dtype)}
            assert (runner._draft_head is None) == (draft_dtype == "float32")
            if runner._draft_head is not None:
                assert runner._draft_head.weight.dtype == torch.bfloat16
                assert torch.equal(runner._draft_head.weight, runner.model.lm_head.weight.to(torch.bfloat16))
            reference = [llm.generate([p], plain)[0] for p in prompts]
            assert [llm.generate([p], spec)[0] for p in prompts] == reference
            stats = llm.acceptance_stats
            assert stats.num_verify_steps > 0
            accepted[draft_dtype] = stats.num_accepted_drafts / stats.num_verify_steps
    assert accepted["float32"] > 1.0  # the trained drafts do propose well on held-out text
    assert accepted["bfloat16"] > 0.8 * accepted["float32"]

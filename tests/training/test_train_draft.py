"""training/train_draft.py: the distillation data (train-split prompts of varied length, continued by the
target) and the warm start from a saved draft."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import DeepseekV3ForCausalLM

from engine import LLM
from engine.models.dflash import DFlashConfig, DFlashDraft, save_draft
from training.block_draft import DistillText
from training.target_shape import TargetShape, build_config
from training.train_draft import (
    DRAFT_SCHEDULE, DraftTraining, build_dataset, engine_continuations, greedy_continuations, train_draft, warm_draft,
)

SHAPE = TargetShape(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                    num_hidden_layers=3, num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16,
                    qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=4,
                    train_length=32, max_position_embeddings=256)
DRAFT = DFlashConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=32,
                     target_layer_ids=(0, 1), target_hidden_size=32, block_size=4, mask_token_id=3)


def tiny_target() -> DeepseekV3ForCausalLM:
    torch.manual_seed(0)
    return DeepseekV3ForCausalLM(build_config(SHAPE, 0, 1, 2)).eval()


def test_varied_prompts_are_train_stream_windows_continued_greedily() -> None:
    """Each row starts with a window of the given (training) stream of its batch's prompt length; the rest is
    the target's greedy continuation up to the common total length; hidden states cover every position."""
    target = tiny_target()
    stream = torch.arange(4, 60).repeat(4)
    text = DistillText(num_sequences=6, prompt_length=9, generated_length=5, generate_batch=2, min_prompt_length=3)
    tokens, captured, lengths = build_dataset(target, stream, DraftTraining(text=text), DRAFT.target_layer_ids, 0)
    assert tokens.shape == (6, 14) and captured.shape == (6, 14, 64) and captured.dtype == torch.bfloat16
    assert lengths.tolist()[::2] == lengths.tolist()[1::2] and all(3 <= n <= 9 for n in lengths.tolist())
    for row, length in zip(tokens, lengths.tolist()):
        prompt = row[:length]
        start = int(prompt[0]) - 4
        assert torch.equal(prompt, stream[start : start + length])  # consecutive stream tokens
        expected = greedy_continuations(target, prompt[None], 14 - length)[0]
        assert torch.equal(row, expected)


def test_warm_start_loads_the_saved_weights(tmp_path: Path) -> None:
    """warm_draft returns the saved draft's weights in training mode and freezes the target; a draft of another
    shape is refused with a ValueError naming --draft-init."""
    torch.manual_seed(1)
    saved = DFlashDraft(DRAFT)
    save_draft(saved, tmp_path / "draft", dtype=torch.float32)
    target = tiny_target()
    draft = warm_draft(tmp_path / "draft", DRAFT, target)
    assert draft.training and not any(p.requires_grad for p in target.parameters())
    for name, tensor in saved.state_dict().items():
        assert torch.equal(draft.state_dict()[name], tensor), name
    other = DFlashConfig(**{**DRAFT.__dict__, "intermediate_size": 48})
    with pytest.raises(ValueError, match="--draft-init"):
        warm_draft(tmp_path / "draft", other, target)


def test_time_budget_stops_the_update_loop() -> None:
    """DraftTraining.minutes bounds the update loop: a spent budget makes no update (the draft is returned as
    it was built), an ample one runs exactly cfg.steps; a non-positive budget is refused naming the field."""
    target = tiny_target()
    text = DistillText(num_sequences=2, prompt_length=4, generated_length=8, generate_batch=2)
    cfg = DraftTraining(text=text, steps=3, anchors_per_sequence=2, schedule=DRAFT_SCHEDULE.smoke())
    data = build_dataset(target, torch.arange(4, 60), cfg, DRAFT.target_layer_ids, 0)
    fresh, updates = train_draft(target, DRAFT, data, replace(cfg, minutes=1e-9), 0)
    assert updates == 0
    again, _ = train_draft(target, DRAFT, data, replace(cfg, minutes=1e-9), 0)
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name
    trained, updates = train_draft(target, DRAFT, data, replace(cfg, minutes=10.0), 0)
    assert updates == 3 and not torch.equal(trained.state_dict()["fc.weight"], fresh.state_dict()["fc.weight"])
    with pytest.raises(ValueError, match="minutes"):
        replace(cfg, minutes=0.0)


@pytest.mark.slow
def test_engine_continuations_match_the_transformers_loop() -> None:
    """--engine-distill's text: the serving engine's greedy continuations of the embedded model equal the
    transformers greedy loop's for random prompts of two lengths (the draft learns what it is verified on)."""
    model = Path(__file__).resolve().parents[2] / "models" / "pdserve-tiny"
    target = DeepseekV3ForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    prompts = torch.randint(4, 4096, (3, 12), generator=torch.Generator().manual_seed(0))
    with LLM(str(model), draft_model="", num_threads=1, max_running=4) as llm:
        for length in (5, 12):
            got = engine_continuations(llm)(prompts[:, :length], 10)
            assert torch.equal(got, greedy_continuations(target, prompts[:, :length], 10))

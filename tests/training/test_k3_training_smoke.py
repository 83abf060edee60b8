"""training/train_k3_default_model.py runs end to end on toy shapes, resumes a partial target run, and writes
a K3 checkpoint + DSpark draft that the serving engine loads and speculates with."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from training.train_k3_default_model import main

pytestmark = pytest.mark.slow  # trains (a few toy steps) and runs the engine


def test_tiny_run_resumes_and_writes_a_servable_model(tmp_path: Path) -> None:
    """A 2-step target run leaves a loadable checkpoint; a second run resumes it to step 3 and goes on to
    the draft and the engine-measured metrics; LLM() serves the result with its DSpark draft."""
    out, work = tmp_path / "k3", tmp_path / "work"
    common = ["--tiny", "--out", str(out), "--work-dir", str(work)]
    assert main([*common, "--phase", "target", "--target-steps", "2"]) == 0
    assert json.loads((out / "training_metrics.json").read_text())["target_steps"] == 2
    assert main([*common, "--target-steps", "3"]) == 0
    metrics = json.loads((out / "training_metrics.json").read_text())
    assert metrics["target_steps"] == 3  # resumed at 2, not restarted
    for key in ("held_out_loss", "unigram_entropy", "loss_ratio", "acceptance_length", "total_megabytes"):
        assert metrics[key] > 0, key
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "kimi_k3" and config["text_config"]["quantization_config"]["format"] == "mxfp4-pack-quantized"
    assert (out / "README.md").read_text().startswith("# pdserve-k3-tiny")
    with LLM(str(out), device="cpu", num_threads=1, spec_block_size=8) as llm:
        assert llm.engine.has_draft
        outputs = llm.generate([[5, 6, 7, 8]], SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True))
        assert len(outputs[0]) == 6 and llm.acceptance_stats.num_verify_steps > 0


def test_draft_phase_continues_a_given_draft(tmp_path: Path) -> None:
    """--draft-init: the draft phase starts from that draft's weights (one step later they are still close to
    them), where a fresh draft phase starts from new random ones (far from them)."""
    import shutil

    from safetensors.torch import load_file

    out = tmp_path / "k3"
    common = ["--tiny", "--out", str(out), "--work-dir", str(tmp_path / "work")]
    assert main([*common, "--target-steps", "2", "--draft-steps", "2"]) == 0
    shutil.copytree(out / "draft", tmp_path / "init")
    before = load_file(str(tmp_path / "init" / "model.safetensors"))

    def drift() -> float:
        after = load_file(str(out / "draft" / "model.safetensors"))
        return max(float((after[name].float() - t.float()).abs().max()) for name, t in before.items())

    first = json.loads((out / "training_metrics.json").read_text())
    assert main([*common, "--phase", "draft", "--draft-steps", "1", "--draft-init", str(tmp_path / "init")]) == 0
    continued = drift()
    metrics = json.loads((out / "training_metrics.json").read_text())
    assert [r["draft_steps"] for r in metrics["draft_previous_rounds"]] == [first["draft_steps"]] == [2]
    assert metrics["draft_steps"] == 1
    assert main([*common, "--phase", "eval"]) == 0
    card = (out / "README.md").read_text()
    assert "2 steps in" in card and ", then 1 steps in" in card and "--draft-init" in card
    assert main([*common, "--phase", "draft", "--draft-steps", "1", "--seed", "5"]) == 0
    fresh = drift()
    assert continued < 0.05 < fresh, (continued, fresh)

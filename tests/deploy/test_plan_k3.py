"""`pdserve plan` for Kimi K3: only the 24 MLA layers cache latents (27,648 B per token per rank in bf16),
and every request also holds its KDA state (69 layers: 56,171,520 B = 53.6 MiB per rank at TP8)."""
from __future__ import annotations

import json

import pytest

from pdserve.cli import main
from pdserve.plan.hybrid import KIMI_K3_ATTENTION, HybridAttention


def plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["plan", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_k3_state_bytes_per_request_at_tp8() -> None:
    """69 x (3 x 4608 x 2 B conv + 12 x 128 x 128 x 4 B recurrent) = 56,171,520 B per rank at TP8."""
    assert KIMI_K3_ATTENTION.state_bytes_per_request(8) == 56_171_520
    assert KIMI_K3_ATTENTION.state_bytes_per_request(1) == 8 * 56_171_520
    with pytest.raises(ValueError, match="KDA heads"):
        KIMI_K3_ATTENTION.state_bytes_per_request(7)


def test_k3_plan_uses_24_mla_layers_and_counts_state(capsys: pytest.CaptureFixture[str]) -> None:
    """The K3 preset's KV per token is 24 x 576 x 2 B, and sequences = budget // (context KV + state)."""
    plan = plan_json(capsys, "--model", "kimi-k3", "--gpu", "MI355X", "--gpus", "8", "--context-len", "131072")
    kv = plan["kv"]
    assert kv["bytes_per_token"] == 27_648 and kv["mla_layers"] == 24
    assert kv["state_bytes_per_request"] == 56_171_520
    per_sequence = 27_648 * 131_072 + 56_171_520
    assert kv["sequences_per_replica"] == kv["budget_bytes_per_gpu"] // per_sequence


def test_deepseek_has_no_state(capsys: pytest.CaptureFixture[str]) -> None:
    """A pure-MLA model caches every layer and holds no per-request state."""
    kv = plan_json(capsys, "--model", "deepseek-v3")["kv"]
    assert kv["state_bytes_per_request"] == 0 and kv["mla_layers"] == 61


def test_hybrid_from_config_json_fields() -> None:
    """linear_attn_config's 1-indexed lists give the MLA / KDA layer counts; absent means pure MLA."""
    hybrid = HybridAttention.from_hf({"linear_attn_config": {"kda_layers": [1, 2, 3], "full_attn_layers": [4],
                                                             "num_heads": 8, "head_dim": 16, "short_conv_kernel_size": 4}})
    assert (hybrid.mla_layers, hybrid.kda_layers, hybrid.conv_width) == (1, 3, 3)
    assert hybrid.state_bytes_per_request(2) == 3 * (3 * 3 * 4 * 16 * 2 + 4 * 16 * 16 * 4)
    assert HybridAttention.from_hf({"hidden_size": 8}) is None

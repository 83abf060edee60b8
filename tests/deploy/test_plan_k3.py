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
    """The K3 preset's KV per token is 24 x 576 x 2 B, and sequences = (budget - the prefix cache's state
    checkpoints) // (context KV + state); with --no-prefix-cache the whole budget."""
    plan = plan_json(capsys, "--model", "kimi-k3", "--gpu", "MI355X", "--gpus", "8", "--context-len", "131072")
    kv = plan["kv"]
    assert kv["bytes_per_token"] == 27_648 and kv["mla_layers"] == 24
    assert kv["state_bytes_per_request"] == 56_171_520
    per_sequence = 27_648 * 131_072 + 56_171_520
    assert kv["checkpoint_bytes_per_gpu"] > 0
    assert kv["sequences_per_replica"] == (kv["budget_bytes_per_gpu"] - kv["checkpoint_bytes_per_gpu"]) // per_sequence
    plan = plan_json(capsys, "--model", "kimi-k3", "--gpu", "MI355X", "--gpus", "8", "--context-len", "131072",
                     "--no-prefix-cache")
    kv = plan["kv"]
    assert kv["checkpoint_bytes_per_gpu"] == 0
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


def _k3_parameters_by_hand() -> tuple[int, int]:
    """(non-expert parameters, routed-expert parameters) of Kimi K3 from K3_SPEC section 2's tensor list."""
    hidden, vocab, proj, heads = 7168, 163840, 96 * 128, 96
    kda = (5 * proj * hidden + 3 * proj * 4 + 128 * hidden + proj * 128 + proj + heads + heads * hidden + 128)
    mla = (1536 * hidden + 1536 + heads * 192 * 1536 + 576 * hidden + 512 + heads * 256 * 512
           + proj * hidden + hidden * proj)
    per_layer = 6 * hidden  # 4 RMSNorms + 2 AttnRes score vectors
    moe = 896 * hidden + 896 + 2 * 3584 * hidden + 3584 + 3 * 6144 * hidden
    non_expert = (2 * vocab * hidden + 3 * hidden + 69 * kda + 24 * mla + 93 * per_layer + 3 * 33792 * hidden
                  + 92 * moe)
    return non_expert, 92 * 896 * 3 * 3072 * 3584


def test_k3_preset_is_k3s_real_config() -> None:
    """The preset is K3's published config.json parsed by the engine's K3 parser: 93 layers (69 KDA + 24 gated
    MLA), 96 heads of both kinds, 896 routed experts top-16 through a 3584-wide latent, MXFP4 routed experts
    (4.25 bits), the rest bf16; its hybrid geometry is KIMI_K3_ATTENTION."""
    from engine.model_configs.kimi_linear import KimiLinearConfig
    from pdserve.plan.model_source import load_model

    model = load_model("kimi-k3")
    config = model.config
    assert isinstance(config, KimiLinearConfig) and config.model_type == "kimi_k3"
    assert (config.num_hidden_layers, config.num_kda_layers, config.num_mla_layers) == (93, 69, 24)
    assert (config.num_attention_heads, config.linear_attn.num_heads, config.linear_attn.head_dim) == (96, 96, 128)
    assert (config.n_routed_experts, config.num_experts_per_tok, config.routed_expert_hidden_size) == (896, 16, 3584)
    assert config.mla_use_output_gate and config.hidden_act == "situ" and config.attn_res_block_size == 12
    assert model.quantization.experts.name == "mxfp4" and model.quantization.experts.bits_per_weight == 4.25
    assert model.quantization.linear.name == "bf16"
    assert model.hybrid == KIMI_K3_ATTENTION


def test_k3_parameter_count_from_the_engines_tensor_list() -> None:
    """count_parameters (the engine's expected K3 tensors, MXFP4 bytes holding two weights) equals the count by
    hand from K3_SPEC's tensor list: ~2.78T, 98% of it routed experts."""
    from pdserve.plan.model_source import load_model
    from pdserve.plan.params import count_parameters

    params = count_parameters(load_model("kimi-k3").config)
    non_expert, experts = _k3_parameters_by_hand()
    assert params.routed_experts == experts
    assert params.total == non_expert + experts
    assert params.total == pytest.approx(2.8e12, rel=0.01)
    assert params.latent_projections == 92 * 2 * 3584 * 7168


def test_k3_capacity_facts_of_the_seed(capsys: pytest.CaptureFixture[str]) -> None:
    """The seed's facts from the real config: ~1.56 TB of weights (experts 17,547,264 B each in MXFP4, the rest
    bf16), 27,648 B of latent per token over 24 MLA layers, 53.6 MiB of KDA state per request per rank at TP8,
    and on 8x MI355X it fits with one shared weight copy but not with a copy per worker (nor split 4 + 4)."""
    plan = plan_json(capsys, "--model", "kimi-k3", "--gpu", "MI355X", "--gpus", "8")
    non_expert, _ = _k3_parameters_by_hand()
    weights = plan["weights"]
    assert weights["total_bytes"] == 2 * non_expert + 92 * 896 * 17_547_264
    assert weights["total_bytes"] == pytest.approx(1.56e12, rel=0.005)
    assert weights["expert_bits_per_weight"] == 4.25
    assert plan["model"]["params_total"] == pytest.approx(2.8e12, rel=0.01)
    assert (plan["model"]["routed_experts"], plan["model"]["experts_per_token"]) == (896, 16)
    assert (plan["model"]["kda_layers"], plan["model"]["latent_moe_width"]) == (69, 3584)
    kv = plan["kv"]
    assert (kv["bytes_per_token"], kv["mla_layers"], kv["state_bytes_per_request"]) == (27_648, 24, 56_171_520)
    sharing = plan["sharing"]
    assert plan["fits"] and sharing["fits_shared"]
    assert not sharing["fits_per_worker"] and not sharing["fits_split"]
    assert plan["scale"]["min_gpus"] == 8


@pytest.mark.slow
def test_k3_config_json_file_plans_like_the_preset(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    """K3's config.json on disk (nested text_config, compressed-tensors MXFP4) gives the preset's figures."""
    from pdserve.plan.kimi_k3_config import KIMI_K3_CONFIG

    (tmp_path / "config.json").write_text(json.dumps(KIMI_K3_CONFIG))
    from_file = plan_json(capsys, "--model", str(tmp_path), "--gpu", "MI355X")
    preset = plan_json(capsys, "--model", "kimi-k3", "--gpu", "MI355X")
    for section in ("weights", "kv", "sharing"):
        assert from_file[section] == preset[section]
    assert from_file["model"]["params_total"] == preset["model"]["params_total"]

"""`pdserve plan` through the real CLI: the seed deployment's figures, JSON fields, and one-line errors."""
from __future__ import annotations

import json

import pytest

from pdserve.cli import main

GB = 10**9

# DeepSeek-V3's config.json as published on the model hub (the fields that shape the weights).
DEEPSEEK_V3_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1, "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8,
    "topk_group": 4, "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3,
    "norm_topk_prob": True, "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
}


def plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["plan", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("gpu, fits", [("MI355X", True), ("B300", True), ("B200", False)])
def test_k3_fits_one_node_of_288gb_gpus_but_not_b200(capsys, gpu, fits):
    """Kimi K3 (~1.56 TB of weights) fits on 8x MI355X and 8x B300 (288 GB) but not on 8x B200 (192 GB),
    which needs two nodes."""
    plan = plan_json(capsys, "--model", "kimi-k3", "--gpu", gpu, "--gpus", "8")
    assert plan["weights"]["fit_per_gpu"] is fits
    assert plan["fits"] is fits
    assert plan["scale"]["one_node_suffices"] is fits
    assert (plan["kv"]["concurrent_sequences"] > 0) is fits
    assert plan["scale"]["min_nodes"] == (1 if fits else 2)
    assert plan["weights"]["total_bytes"] > 8 * 192 * GB  # more than a B200 node holds, reserve or not


def test_k3_preset_matches_the_seed_sizes(capsys):
    """The K3 preset has ~2.8T parameters, 96 heads, a 512+64 latent, and ~1.56 TB of weights
    at ~4.5 bits per weight overall (MXFP4 experts at 4.25 bits: a UE8M0 scale per 32 weights; the rest bf16)."""
    plan = plan_json(capsys, "--model", "kimi-k3")
    assert plan["model"]["params_total"] == pytest.approx(2.8e12, rel=0.03)
    assert plan["model"]["attention_heads"] == 96
    assert (plan["model"]["kv_lora_rank"], plan["model"]["rope_dim"]) == (512, 64)
    assert plan["weights"]["total_bytes"] == pytest.approx(1.56e12, rel=0.03)
    assert plan["weights"]["bits_per_weight"] == pytest.approx(4.5, abs=0.1)
    assert plan["weights"]["expert_bits_per_weight"] == 4.25


def test_96_heads_at_tp8_are_12_per_rank_padded_to_16(capsys):
    """96 heads / TP8 = 12 per rank; AITER's MLA decode wants 16, and the fp8 persistent prefill has no 12
    either, so both pad to 16; bf16 flash attention runs 12 natively."""
    plan = plan_json(capsys, "--model", "kimi-k3", "--tp-size", "8")
    heads = plan["heads"]
    assert (heads["heads_per_rank"], heads["padded_heads"], heads["padding_applies"]) == (12, 16, True)
    assert heads["padding_overhead"] == pytest.approx(16 / 12 - 1)
    runs = {kernel["name"]: kernel["runs_heads"] for kernel in heads["kernels"]}
    assert runs["aiter.mla_prefill_ps_fwd"] == 16
    assert runs["aiter.mla_prefill_fwd"] == 16
    assert runs["aiter.flash_attn_varlen_func"] == 12


def test_deepseek_v3_at_tp8_needs_no_padding(capsys):
    """128 heads / TP8 = 16 per rank: every kernel runs natively."""
    heads = plan_json(capsys, "--model", "deepseek-v3", "--tp-size", "8")["heads"]
    assert (heads["heads_per_rank"], heads["padded_heads"], heads["padding_applies"]) == (16, 16, False)
    assert not any(kernel["padded"] for kernel in heads["kernels"])


@pytest.mark.slow
def test_48_heads_per_rank_pad_to_64_from_the_engines_table(capsys):
    """96 heads / TP2 = 48 per rank: mla_decode_fwd has no 48-head kernel (8, 16, 32, 64, 128), so the plan
    pads to 64, as the engine's AITER backend does; the fp8 persistent prefill runs 48 natively; each kernel
    row names the dtypes it takes (no fp32 on AITER)."""
    from engine.attention.head_table import MLA_DECODE

    heads = plan_json(capsys, "--model", "kimi-k3", "--tp-size", "2")["heads"]
    assert (heads["heads_per_rank"], heads["padded_heads"]) == (48, 64) == (48, MLA_DECODE.padded(48))
    runs = {kernel["name"]: kernel["runs_heads"] for kernel in heads["kernels"]}
    assert runs["aiter.mla_prefill_ps_fwd"] == 48
    dtypes = {kernel["name"]: kernel["dtypes"] for kernel in heads["kernels"]}
    assert "float32" not in dtypes["aiter.mla_decode_fwd"] and "bfloat16" in dtypes["aiter.mla_decode_fwd"]
    assert main(["plan", "--model", "kimi-k3", "--tp-size", "2"]) == 0
    table = capsys.readouterr().out
    assert "padded to 64" in table and "heads {8,16,32,64,128}; bf16/fp8/fp8 (fnuz)" in table


@pytest.mark.parametrize("gpu, gpus, throughput, expected, rounded", [
    ("MI355X", 8, 952, 952 / (8 * 2.50), 48),
    ("B200", 16, 498, 498 / (16 * 4.25), 7),
    ("B300", 8, 1568, 1568 / (8 * 6.00), 33),
])
def test_tok_s_per_dollar_reproduces_the_seed(capsys, gpu, gpus, throughput, expected, rounded):
    """tok/s per $ = tok/s / (GPUs x $/GPU-hour) with the catalog's default prices."""
    plan = plan_json(capsys, "--gpu", gpu, "--gpus", str(gpus), "--throughput", str(throughput))
    assert plan["cost"]["tok_s_per_dollar"] == pytest.approx(expected)
    assert round(plan["cost"]["tok_s_per_dollar"]) == rounded
    assert plan["cost"]["price_source"] == "seed deployment"


@pytest.mark.slow
def test_gpu_price_override_changes_only_the_cost(capsys):
    """--gpu-price replaces the catalog price: the cost halves when the price halves; memory is unchanged."""
    base = plan_json(capsys, "--throughput", "952")
    cheap = plan_json(capsys, "--throughput", "952", "--gpu-price", "1.25")
    assert cheap["cost"]["tok_s_per_dollar"] == pytest.approx(2 * base["cost"]["tok_s_per_dollar"])
    assert cheap["cost"]["price_source"] == "given"
    assert cheap["kv"] == base["kv"]


def test_deepseek_v3_latent_kv_is_70272_bytes_per_token(capsys):
    """MLA KV per token = 61 layers x (512 + 64) x 2 bytes in bf16 = 70,272; fp8 halves it."""
    bf16 = plan_json(capsys, "--model", "deepseek-v3")["kv"]
    fp8 = plan_json(capsys, "--model", "deepseek-v3", "--kv-dtype", "fp8")["kv"]
    assert bf16["bytes_per_token"] == 70_272
    assert fp8["bytes_per_token"] == 70_272 // 2
    assert bf16["tokens_per_gpu"] == bf16["budget_bytes_per_gpu"] // 70_272
    assert fp8["tokens_per_gpu"] == fp8["budget_bytes_per_gpu"] // (70_272 // 2)


def test_deepseek_v3_config_json_gives_671b_parameters(capsys, tmp_path):
    """The parameter count computed from DeepSeek-V3's real config.json is its published 671B, and its
    quantization_config is read as FP8."""
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V3_CONFIG))
    plan = plan_json(capsys, "--model", str(tmp_path))
    assert plan["model"]["params_total"] == pytest.approx(671e9, rel=0.01)
    assert plan["weights"]["linear_format"].startswith("fp8")
    assert plan["weights"]["total_bytes"] == pytest.approx(671e9, rel=0.02)  # ~1 byte per weight


def test_kimi_k2_thinking_matches_its_published_checkpoint_size(capsys):
    """int4 experts (group 32, bf16 scales) + bf16 rest gives Kimi K2-Thinking's ~594 GB checkpoint;
    Kimi K2 in FP8 is ~1.03 TB."""
    thinking = plan_json(capsys, "--model", "kimi-k2-thinking")
    fp8 = plan_json(capsys, "--model", "kimi-k2")
    assert thinking["weights"]["total_bytes"] == pytest.approx(594e9, rel=0.02)
    assert fp8["weights"]["total_bytes"] == pytest.approx(1.03e12, rel=0.02)
    assert thinking["model"]["params_total"] == fp8["model"]["params_total"]


@pytest.mark.slow
def test_params_override_scales_weights_proportionally(capsys):
    """--params keeps the mix of parameter groups, so weight bytes scale with the count."""
    base = plan_json(capsys, "--model", "kimi-k3")
    doubled = plan_json(capsys, "--model", "kimi-k3", "--params", str(2 * base["model"]["params_total"]))
    assert doubled["model"]["params_computed"] == base["model"]["params_total"]
    assert doubled["weights"]["total_bytes"] == pytest.approx(2 * base["weights"]["total_bytes"], rel=1e-6)
    assert plan_json(capsys, "--params", "2.8T")["model"]["params_total"] == pytest.approx(2.8e12, rel=1e-6)


@pytest.mark.slow
def test_reserve_comes_out_of_the_kv_budget(capsys):
    """Every GB reserved is a GB less for KV; sequences = budget // (context length x KV per token + the
    per-request state of linear-attention layers, zero for pure-MLA models)."""
    base = plan_json(capsys, "--reserve-gb", "0")
    reserved = plan_json(capsys, "--reserve-gb", "10", "--context-len", "4096")
    assert base["kv"]["budget_bytes_per_gpu"] - reserved["kv"]["budget_bytes_per_gpu"] == 10 * GB
    kv = reserved["kv"]
    pages_and_slots = kv["budget_bytes_per_gpu"] - kv["checkpoint_bytes_per_gpu"]  # (K3: the checkpoints' share out)
    assert kv["sequences_per_replica"] == pages_and_slots // (kv["bytes_per_token"] * 4096 + kv["state_bytes_per_request"])


def test_mixed_dtypes_and_group_size(capsys):
    """--expert-dtype int4 with group 128 and bf16 scales costs 4 + 16/128 bits per expert weight."""
    plan = plan_json(capsys, "--model", "deepseek-v3", "--weight-dtype", "bf16", "--expert-dtype", "int4",
                     "--int4-group-size", "128")
    assert plan["weights"]["expert_bits_per_weight"] == 4 + 16 / 128
    assert plan["weights"]["linear_bits_per_weight"] == 16
    assert plan["weights"]["bits_per_weight"] < 5


@pytest.mark.slow
def test_replicas_multiply_sequences_not_per_gpu_tokens(capsys):
    """16 GPUs as 2 x TP8 hold the model twice: twice the sequences, the same tokens per GPU."""
    one = plan_json(capsys, "--gpus", "8", "--tp-size", "8")
    two = plan_json(capsys, "--gpus", "16", "--tp-size", "8")
    assert two["deployment"]["replicas"] == 2
    assert two["kv"]["tokens_per_gpu"] == one["kv"]["tokens_per_gpu"]
    assert two["kv"]["concurrent_sequences"] == 2 * one["kv"]["concurrent_sequences"]


@pytest.mark.slow
def test_table_output_names_the_verdicts(capsys):
    """The default output is a readable table with the padding, node and cost verdicts (96 heads / TP16 = 6
    per rank: AITER's smallest MLA decode kernel has 8 heads)."""
    assert main(["plan", "--gpu", "B200", "--throughput", "498", "--gpus", "16"]) == 0
    table = capsys.readouterr().out
    assert "padded to 8 for AITER MLA decode" in table
    assert "7.3" in table
    assert "tok/s per $" in table
    assert main(["plan", "--gpu", "B200"]) == 0
    table = capsys.readouterr().out
    assert "DOES NOT FIT" in table
    assert "needs 2 nodes" in table


def _error_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    try:
        code = main(["plan", *argv])
    except SystemExit as stop:
        code = stop.code
    captured = capsys.readouterr()
    assert code == 2
    assert captured.out == ""
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1, captured.err
    assert "Traceback" not in captured.err
    return lines[0]


@pytest.mark.parametrize("argv, words", [
    (["--gpu", "A100"], ["unknown GPU", "A100", "MI355X"]),
    (["--tp-size", "7", "--gpus", "7"], ["TP size 7", "96 attention heads"]),
    (["--model", "deepseek-v3", "--tp-size", "3", "--gpus", "3"], ["TP size 3", "128"]),
    (["--gpus", "-8"], ["GPU count", "-8"]),
    (["--reserve-gb", "-1"], ["reserve", "-1"]),
    (["--context-len", "-4096"], ["context length"]),
    (["--params", "-2.8T"], ["--params"]),
    (["--gpu-memory-gb", "-288"], ["--gpu-memory-gb"]),
    (["--gpus", "abc"], ["--gpus", "abc"]),
    (["--kv-dtype", "int8"], ["KV dtype", "int8"]),
    (["--weight-dtype", "int3"], ["weight dtype", "int3"]),
    (["--model", "no-such-model"], ["no config.json", "kimi-k3"]),
])
def test_bad_input_is_one_line_exit_2(capsys, argv, words):
    """Bad input: one line on stderr naming the problem, exit code 2, no traceback."""
    line = _error_line(capsys, argv)
    for word in words:
        assert word in line


@pytest.mark.parametrize("content, words", [
    ('{"hidden_size": 7168,', ["not valid JSON"]),
    ("[1, 2]", ["JSON object"]),
    ('{"hidden_size": 7168}', ["lacks", "kv_lora_rank"]),
    (json.dumps({**DEEPSEEK_V3_CONFIG, "hidden_size": "big"}), ["hidden_size"]),
])
def test_malformed_config_json_is_one_line_exit_2(capsys, tmp_path, content, words):
    """A broken or non-MLA config.json is reported in one line naming the file's problem."""
    path = tmp_path / "config.json"
    path.write_text(content)
    line = _error_line(capsys, ["--model", str(path)])
    for word in words:
        assert word in line


def test_k3_on_one_node_needs_the_shared_weight_copy(capsys):
    """On 8x MI355X, K3 fits only with prefill and decode mapping one shared copy: a copy per worker (two
    per GPU, or the node split 4 + 4) does not fit; the shared copy leaves the rest of each GPU for KV."""
    plan = plan_json(capsys, "--model", "kimi-k3", "--gpu", "MI355X", "--gpus", "8")
    sharing = plan["sharing"]
    assert sharing["fits_shared"] and not sharing["fits_per_worker"] and not sharing["fits_split"]
    assert sharing["per_gpu_per_worker_bytes"] == 2 * sharing["per_gpu_shared_bytes"]
    assert sharing["per_gpu_shared_bytes"] == plan["weights"]["per_gpu_bytes"]
    assert sharing["kv_budget_shared_bytes"] == plan["kv"]["budget_bytes_per_gpu"]


def test_kda_state_checkpoints_take_their_share_of_the_kv_budget(capsys):
    """K3 (KDA layers): the prefix cache's checkpoints take whole states within --checkpoint-memory-fraction of the
    KV budget, and tokens / sequences are counted in what is left; --no-prefix-cache plans none."""
    plan = plan_json(capsys, "--checkpoint-memory-fraction", "0.25")["kv"]
    state, budget = plan["state_bytes_per_request"], plan["budget_bytes_per_gpu"]
    assert plan["checkpoints_per_gpu"] == int(budget * 0.25) // state > 0
    assert plan["checkpoint_bytes_per_gpu"] == plan["checkpoints_per_gpu"] * state
    assert plan["tokens_per_gpu"] == (budget - plan["checkpoint_bytes_per_gpu"]) // plan["bytes_per_token"]
    off = plan_json(capsys, "--no-prefix-cache")["kv"]
    assert off["checkpoints_per_gpu"] == off["checkpoint_bytes_per_gpu"] == 0
    assert off["tokens_per_gpu"] == budget // off["bytes_per_token"] > plan["tokens_per_gpu"]

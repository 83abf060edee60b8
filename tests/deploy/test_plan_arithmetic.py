"""The planner's pure arithmetic: parameter groups, bits per weight, per-GPU sharding, head padding, cost."""
from __future__ import annotations

import json
import math

import pytest

from engine.model_configs.model_config import ModelConfig
from pdserve.plan.capacity import PlanRequest, kv_bytes_per_token, smallest_tp, tok_s_per_dollar, weight_bytes
from pdserve.plan.dtypes import Quantization, WeightFormat, weight_format
from pdserve.plan.gpus import lookup_gpu
from engine.attention.head_table import KERNELS, MLA_DECODE
from pdserve.plan.heads import plan_heads
from pdserve.plan.model_source import load_model, quantization_from_hf
from pdserve.plan.params import REPLICATED_GROUPS, count_parameters, weight_group

SMALL = {  # a small DeepSeek-V3-shaped config whose counts are easy to write out by hand
    "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_hidden_layers": 3, "num_attention_heads": 4, "q_lora_rank": 48, "kv_lora_rank": 16,
    "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "n_routed_experts": 4,
    "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
}


def test_parameter_groups_follow_the_layer_shapes():
    """Each group is the product of the shapes that make it (1 dense + 2 MoE layers here)."""
    params = count_parameters(ModelConfig.from_hf_dict(SMALL))
    assert params.embedding == params.lm_head == 1000 * 64
    assert params.attention_sharded == 3 * (48 * 4 * 12 + 16 * 4 * 16 + 4 * 8 * 64)
    assert params.attention_replicated == 3 * (64 * 48 + 64 * 20)
    assert params.dense_mlp == 1 * 3 * 64 * 128
    assert params.routed_experts == 2 * 4 * 3 * 64 * 32
    assert params.shared_experts == 2 * 1 * 3 * 64 * 32
    assert params.router == 2 * (4 * 64 + 4)
    assert params.norms == 3 * (2 * 64 + 48 + 16) + 64
    assert params.total == sum(params.as_dict().values())



def test_groups_partition_the_engines_weights():
    """Every tensor the engine expects falls in exactly one group, so the groups sum to all its weights; a
    tensor the planner does not know is an error, not a silent zero."""
    from engine.weights.checkpoint import expected_weight_shapes

    config = ModelConfig.from_hf_dict(SMALL)
    shapes = expected_weight_shapes(config)
    assert count_parameters(config).total == sum(math.prod(shape) for shape in shapes.values())
    assert {weight_group(name) for name in shapes} == set(count_parameters(config).as_dict()) - {"latent_projections"}
    with pytest.raises(ValueError, match="no parameter group"):
        weight_group("model.layers.0.self_attn.rotary_emb.inv_freq")


@pytest.mark.slow
def test_k3_groups_partition_the_engines_k3_tensors():
    """Every tensor of the engine's K3 list (but the MXFP4 scales) falls in a group, every group (the latent
    projections too) is used, and the groups sum to all weights with an MXFP4 byte counted as two weights."""
    from pdserve.plan.model_source import load_model
    from pdserve.plan.params import _k3_tensors, k3_weight_group

    config = load_model("kimi-k3").config
    tensors = _k3_tensors(config)
    groups = {k3_weight_group(name) for name in tensors}
    assert groups - {None} == set(count_parameters(config).as_dict())
    assert {name for name in tensors if k3_weight_group(name) is None} == {n for n in tensors if n.endswith("_scale")}
    expected = sum(math.prod(shape) * (2 if name.endswith("_packed") else 1) for name, shape in tensors.items()
                   if not name.endswith("_scale"))
    assert count_parameters(config).total == expected

def test_tied_embeddings_drop_the_lm_head():
    """tie_word_embeddings: the LM head reuses the embedding, so it adds no parameters."""
    tied = count_parameters(ModelConfig.from_hf_dict({**SMALL, "tie_word_embeddings": True}))
    untied = count_parameters(ModelConfig.from_hf_dict(SMALL))
    assert tied.lm_head == 0
    assert untied.total - tied.total == untied.lm_head


def test_scaled_breakdown_keeps_the_mix():
    """scaled_to(n) hits n (up to rounding) and keeps each group's share."""
    params = count_parameters(load_model("deepseek-v3").config)
    scaled = params.scaled_to(2 * params.total)
    assert abs(scaled.total - 2 * params.total) <= len(params.as_dict())
    assert scaled.routed_experts / scaled.total == pytest.approx(params.routed_experts / params.total)
    with pytest.raises(ValueError):
        params.scaled_to(0)


@pytest.mark.parametrize("name, group, scale, bits", [
    ("bf16", 32, "bf16", 16.0), ("int4", 32, "bf16", 4.5), ("int4", 128, "bf16", 4.125),
    ("int4", 32, "fp32", 5.0), ("fp8", 32, "bf16", 8 + 32 / (128 * 128)),
])
def test_bits_per_weight_include_group_scales(name, group, scale, bits):
    """bits per weight = value bits + scale bits / group size."""
    assert weight_format(name, group, scale).bits_per_weight == pytest.approx(bits)


def test_invalid_weight_formats_are_rejected():
    """Unknown names, non-positive groups and scales without groups raise ValueError."""
    for bad in (lambda: weight_format("int3"), lambda: weight_format("int4", 0),
                lambda: weight_format("int4", 32, "int8"), lambda: WeightFormat("x", 4, 32, 0)):
        with pytest.raises(ValueError):
            bad()


def test_replicated_groups_are_not_divided_by_tp():
    """Per GPU = split groups / TP + replicated groups (MLA down-projections, router, norms)."""
    model = load_model("deepseek-v3")
    params = count_parameters(model.config)
    bf16 = Quantization(weight_format("bf16"), weight_format("bf16"))
    total, per_gpu_1 = weight_bytes(params, bf16, 1)
    _, per_gpu_8 = weight_bytes(params, bf16, 8)
    replicated = 2 * sum(params.as_dict()[name] for name in REPLICATED_GROUPS)
    assert total == per_gpu_1 == 2 * params.total
    assert per_gpu_8 == pytest.approx((total - replicated) / 8 + replicated, abs=1)


def test_kv_bytes_per_token_is_layers_times_latent():
    """layers x (kv_lora_rank + rope dim) x dtype bytes."""
    config = ModelConfig.from_hf_dict(SMALL)
    assert kv_bytes_per_token(config, "bf16") == 3 * 20 * 2
    assert kv_bytes_per_token(config, "fp8") == 3 * 20
    with pytest.raises(ValueError):
        kv_bytes_per_token(config, "int2")


@pytest.mark.parametrize("heads, tp, per_rank, padded", [(96, 8, 12, 16), (128, 8, 16, 16), (64, 8, 8, 8),
                                                         (128, 4, 32, 32), (96, 16, 6, 8), (384, 8, 48, 64),
                                                         (96, 1, 96, 128), (24, 1, 24, 32), (256, 1, 256, None)])
def test_head_padding(heads, tp, per_rank, padded):
    """Per rank = heads / TP; AITER MLA decode has kernels for 8, 16, 32, 64, 128 heads (12 -> 16, 48 -> 64,
    96 -> 128); more than 128 per rank has no AITER kernel (None, no padding overhead)."""
    plan = plan_heads(heads, tp)
    applies = padded is not None and per_rank != padded
    assert (plan.heads_per_rank, plan.padded_heads, plan.padding_applies) == (per_rank, padded, applies)


def test_kernel_head_sets():
    """mla_prefill_fwd runs only 16 or 128 heads; the fp8 persistent prefill lacks 12; others run any count."""
    by_name = {kernel.name: kernel for kernel in KERNELS}
    assert by_name["aiter.mla_prefill_fwd"].padded(12) == 16
    assert by_name["aiter.mla_prefill_fwd"].padded(17) == 128
    assert by_name["aiter.mla_prefill_fwd"].padded(129) is None
    assert by_name["aiter.mla_prefill_ps_fwd"].padded(12) == 16
    assert by_name["aiter.mla_prefill_ps_fwd"].padded(10) == 10
    assert by_name["aiter.flash_attn_varlen_func"].padded(12) == 12
    assert MLA_DECODE.padded(24) == 32 and MLA_DECODE.padded(3) == 8 and MLA_DECODE.padded(129) is None
    with pytest.raises(ValueError):
        plan_heads(96, 7)


def test_tok_s_per_dollar_formula():
    """tok/s / (GPUs x $/GPU-hour); non-positive inputs are errors."""
    assert tok_s_per_dollar(952, 8, 2.5) == pytest.approx(47.6)
    with pytest.raises(ValueError):
        tok_s_per_dollar(952, 0, 2.5)


def test_gpu_catalog_lookup_and_custom_gpus():
    """Lookup is case-insensitive; overrides apply; an unknown name needs memory and price."""
    assert lookup_gpu("mi355x").memory_gb == 288
    assert lookup_gpu("B200", price=3.0).price_per_hour == 3.0
    assert lookup_gpu("X1", memory_gb=100, price=1.0).memory_bytes == 100 * 10**9
    with pytest.raises(ValueError, match="unknown GPU"):
        lookup_gpu("X1", memory_gb=100)


def test_smallest_fit_grows_as_memory_shrinks():
    """The fewest GPUs that hold K3 never decreases when each GPU has less memory, and is a valid TP size."""
    model = load_model("kimi-k3")
    params = count_parameters(model.config)
    previous = 0
    for memory in (288, 192, 141, 80):
        request = PlanRequest(model.config, params, model.quantization, lookup_gpu("MI355X", memory_gb=memory),
                              gpus=8, tp_size=8)
        fewest = smallest_tp(request)
        assert fewest is not None and fewest >= previous
        assert model.config.num_attention_heads % fewest == 0
        previous = fewest
    assert previous > 8


def test_quantization_is_read_from_hf_quantization_config():
    """fp8 -> fp8 everywhere; compressed-tensors 4-bit groups -> int4 routed experts, bf16 rest; none -> bf16."""
    fp8 = quantization_from_hf({"quantization_config": {"quant_method": "fp8"}})
    int4 = quantization_from_hf({"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {
        "group_0": {"weights": {"num_bits": 4, "group_size": 32, "type": "int"}}}}})
    plain = quantization_from_hf({})
    assert (fp8.linear.name, fp8.experts.name) == ("fp8", "fp8")
    assert (int4.linear.name, int4.experts.name, int4.experts.bits_per_weight) == ("bf16", "int4", 4.5)
    assert (plain.linear.name, plain.experts.name) == ("bf16", "bf16")


def test_config_folder_with_nested_text_config(tmp_path):
    """A model folder is read through its config.json; a multimodal wrapper's text_config is the model."""
    (tmp_path / "config.json").write_text(json.dumps({"text_config": SMALL,
                                                      "quantization_config": {"quant_method": "fp8"}}))
    model = load_model(str(tmp_path))
    assert model.name == tmp_path.name
    assert model.config.hidden_size == 64 and model.config.num_attention_heads == 4
    assert model.quantization.experts.name == "fp8"

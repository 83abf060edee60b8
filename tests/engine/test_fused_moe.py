"""The routed-experts paths all compute the same sum: the grouped active-experts torch path, the dense
all-experts path and the Triton fused grouped GEMM (in the interpreter on CPU; on the device with `-m gpu`)
equal the per-expert loop, including slots routed to another rank's experts; the expert alignment groups
every local assignment exactly once into blocks of one expert; the layer picks the measured path."""
from __future__ import annotations

import pytest
import torch

from engine.kernels.moe_align import align_by_expert, max_padded_rows
from engine.kernels.moe_paths import moe_function
from engine.kernels.moe_torch import moe_dense, moe_grouped, moe_loop, use_dense_moe, use_padded_experts


def _case(tokens: int, hidden: int, inter: int, experts: int, top_k: int, seed: int, foreign: bool = False,
          dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """Random experts and routing; foreign=True routes some slots to experts outside [0, experts)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=generator)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=generator) / hidden**0.5
    down = torch.randn(experts, hidden, inter, generator=generator) / inter**0.5
    weights, ids = torch.rand(tokens, experts + (3 if foreign else 0), generator=generator).topk(top_k, dim=-1)
    if foreign:
        ids = ids - 1  # id -1 and ids >= experts belong to other ranks
    tensors = (x.to(dtype), gate_up.to(dtype), down.to(dtype))
    return tuple(t.to(device) for t in tensors) + (weights.to(device), ids.to(device))


CASES = [  # tokens, hidden, inter, experts, top_k, foreign
    (1, 24, 16, 4, 2, False),
    (5, 40, 24, 6, 3, True),
    (19, 32, 20, 5, 2, False),
    (33, 48, 16, 8, 6, True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}-E{}-k{}{}".format(c[0], c[3], c[4], "-ep" if c[5] else ""))
@pytest.mark.parametrize("function", [moe_grouped, moe_dense], ids=["grouped", "dense"])
def test_torch_paths_equal_the_loop(case, function):
    """grouped and dense give the loop's output (fp32, 1e-5), foreign slots contributing nothing."""
    tokens, hidden, inter, experts, top_k, foreign = case
    args = _case(tokens, hidden, inter, experts, top_k, seed=tokens, foreign=foreign)
    torch.testing.assert_close(function(*args), moe_loop(*args), rtol=1e-5, atol=1e-5)


def test_grouped_path_pads_only_when_every_expert_is_busy_and_padding_is_cheap():
    """The padded batched form runs only when no expert is idle (it reads every expert's weights) and the
    padding is small (few rows, or at most 2x the real rows); the CASES above exercise both forms."""
    assert use_padded_experts([5, 3, 2, 1, 4, 4, 3, 4])  # a 16-token decode step, top-2 of 8
    assert not use_padded_experts([0, 0, 1, 0, 0, 0, 0, 1])  # one token: only its two experts run
    assert not use_padded_experts([200, 1, 1, 1])  # a skewed prefill chunk: padding would be ~4x
    assert use_padded_experts([40, 35, 30, 45])
    counts = []
    for tokens, hidden, inter, experts, top_k, foreign in CASES:
        ids = _case(tokens, hidden, inter, experts, top_k, seed=tokens, foreign=foreign)[4].reshape(-1)
        counts.append(torch.bincount(ids[(ids >= 0) & (ids < experts)], minlength=experts).tolist())
    assert any(use_padded_experts(c) for c in counts) and not all(use_padded_experts(c) for c in counts)


def test_no_local_assignment_gives_zero():
    """A step whose every slot routes to another rank returns zeros on every path."""
    x, gate_up, down, weights, _ = _case(3, 16, 8, 4, 2, seed=1)
    ids = torch.full((3, 2), 7)
    for function in (moe_loop, moe_grouped, moe_dense):
        assert torch.count_nonzero(function(x, gate_up, down, weights, ids)) == 0


@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_alignment_groups_each_local_assignment_once(block_m):
    """sorted_ids lists every local (token, slot) exactly once, each row block holds one expert's rows,
    padding is the sentinel, num_padded is a multiple of block_m within the static bound."""
    generator = torch.Generator().manual_seed(block_m)
    experts, tokens, top_k = 5, 13, 3
    ids = torch.randint(-2, experts + 2, (tokens, top_k), generator=generator)
    routing = align_by_expert(ids, experts, block_m)
    flat = ids.reshape(-1)
    sentinel = tokens * top_k
    num_padded = int(routing.num_padded)
    assert num_padded % block_m == 0 and num_padded <= routing.sorted_ids.numel()
    assert routing.sorted_ids.numel() == max_padded_rows(sentinel, experts, block_m)
    used = routing.sorted_ids[:num_padded].long()
    real = used[used < sentinel]
    local = ((flat >= 0) & (flat < experts)).nonzero().squeeze(1)
    assert sorted(real.tolist()) == local.tolist()
    assert bool((routing.sorted_ids[num_padded:] == sentinel).all())
    for block, expert in enumerate(routing.block_expert.tolist()):
        rows = used[block * block_m : (block + 1) * block_m] if block * block_m < num_padded else None
        if rows is None:
            assert expert == -1
            continue
        rows = rows[rows < sentinel]
        assert rows.numel() > 0 and bool((flat[rows] == expert).all())


def test_alignment_rejects_bad_block():
    """block_m < 1 is refused with a message naming it."""
    with pytest.raises(ValueError, match="block_m"):
        align_by_expert(torch.zeros(2, 2, dtype=torch.long), 4, 0)


@pytest.mark.parametrize("case", CASES[:3], ids=lambda c: "T{}-E{}-k{}{}".format(c[0], c[3], c[4], "-ep" if c[5] else ""))
def test_fused_kernel_matches_the_loop_in_the_interpreter(case):
    """The Triton grouped GEMM (gate/up + SiLU, then down x routing weight) equals the loop (fp32
    accumulate), with hidden / intermediate sizes that are not block multiples."""
    from engine.kernels.fused_moe import fused_moe

    tokens, hidden, inter, experts, top_k, foreign = case
    args = _case(tokens, hidden, inter, experts, top_k, seed=tokens, foreign=foreign)
    out = fused_moe(*args, block_m=16, block_n=16, block_k=16)
    torch.testing.assert_close(out, moe_loop(*args), rtol=1e-4, atol=1e-5)


def _fp8_experts(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[E, rows, cols] -> (e4m3 [E, rows, cols], scale_inv [E, ceil(rows/bn), ceil(cols/bk)], dequantised)."""
    from engine.kernels.fp8_quant import dequantize_fp8_block, quantize_fp8_block

    pairs = [quantize_fp8_block(expert, block) for expert in weight]
    quantised = torch.stack([q for q, _ in pairs])
    scales = torch.stack([s for _, s in pairs])
    return quantised, scales, torch.stack([dequantize_fp8_block(q, s, block) for q, s in pairs])


def test_fused_kernel_with_fp8_experts_matches_the_dequantised_loop():
    """FP8 expert weights with block scales, dequantised tile by tile inside the K loop, give the loop's
    output over the dequantised experts (hidden 40: ragged K blocks; gate and up in separate scale rows)."""
    from engine.kernels.fused_moe import fused_moe

    x, gate_up, down, weights, ids = _case(7, 40, 32, 4, 2, seed=11, foreign=True)
    block = (16, 16)
    gate_up_q, gate_up_s, gate_up_d = _fp8_experts(gate_up, block)
    down_q, down_s, down_d = _fp8_experts(down, block)
    out = fused_moe(x, gate_up_q, down_q, weights, ids, block_m=16, block_n=16, block_k=16,
                    gate_up_scale=gate_up_s, down_scale=down_s, quant_block=block)
    torch.testing.assert_close(out, moe_loop(x, gate_up_d, down_d, weights, ids), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="scale"):
        fused_moe(x, gate_up_q, down_q, weights, ids, gate_up_scale=gate_up_s[:, :1], down_scale=down_s,
                  quant_block=block)


def test_fused_kernel_rejects_mismatched_shapes():
    """Disagreeing expert shapes are a ValueError naming them, not a kernel fault."""
    from engine.kernels.fused_moe import fused_moe

    x, gate_up, down, weights, ids = _case(2, 16, 8, 4, 2, seed=0)
    with pytest.raises(ValueError, match="do not agree"):
        fused_moe(x, gate_up, down[:, :, :4], weights, ids)


def test_dense_bound_matches_the_measurements():
    """The written-down bound picks dense for the embedded model's decode steps (measured faster up to 16
    tokens) and grouped for the 85M model even at one token and for 64 experts (measured faster)."""
    assert use_dense_moe(16, 8, 192, 128) and not use_dense_moe(64, 8, 192, 128)
    assert not use_dense_moe(1, 8, 1024, 512)
    assert not use_dense_moe(1, 64, 2048, 256)


def test_unknown_path_is_refused():
    """Asking for a path that does not exist names the choices."""
    with pytest.raises(ValueError, match="grouped"):
        moe_function("sparse-ish")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA / ROCm GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_kernel_on_the_device(dtype):
    """On the GPU (compiled Triton), the fused MoE at 64 experts top-6 equals the grouped torch path."""
    from engine.kernels.fused_moe import fused_moe

    args = _case(64, 256, 128, 64, 6, seed=3, foreign=True, dtype=dtype, device="cuda")
    reference = moe_grouped(*(t.float() if t.is_floating_point() else t for t in args))
    tolerance = 1e-3 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(fused_moe(*args), reference, rtol=tolerance, atol=tolerance)


def test_layer_paths_agree_and_gpu_without_compiled_triton_stays_sync_free():
    """RoutedExperts gives the same output on every forced path (with an expert-parallel shard), picks
    dense/grouped on CPU by the bound, and on "cuda" without compiled Triton (here: the interpreter) the
    dense path, the torch path with no device-to-host sync."""
    from engine.model_configs.model_config import ModelConfig
    from engine.runtime.distributed import TPGroup
    from engine.layers.moe import RoutedExperts
    from tests.engine.tiny_models import tiny_config_kwargs

    config = ModelConfig.from_hf_dict(tiny_config_kwargs("yarn"))
    experts = RoutedExperts(config, TPGroup(rank=1, size=2), torch.float32)  # the second half of the experts
    assert experts.expert_start > 0
    generator = torch.Generator().manual_seed(0)
    for parameter in (experts.gate_up_proj, experts.down_proj):
        parameter.data.copy_(torch.randn(parameter.shape, generator=generator) / 8)
    x = torch.randn(6, config.hidden_size, generator=generator)
    weights, ids = torch.rand(6, config.n_routed_experts, generator=generator).topk(config.num_experts_per_tok, -1)
    expected = experts(x, weights, ids, path="loop")
    for path in ("grouped", "dense"):
        torch.testing.assert_close(experts(x, weights, ids, path=path), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(experts(x, weights, ids), expected, rtol=1e-5, atol=1e-5)
    assert experts.choose_path(6, torch.device("cuda")) == "dense"

"""Reading an HF checkpoint: safetensors (single or sharded index), FP8 128x128 block dequantisation,
MTP layers dropped, fused expert tensors split into the per-expert names the rest of the engine uses;
plus the list of tensors a checkpoint must contain (name -> full shape)."""
from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from engine.model_configs.model_config import ModelConfig
from engine.kernels.fp8_quant import FP8_DTYPES, dequantize_fp8_block, quantize_fp8_block

__all__ = ["FP8_DTYPES", "checkpoint_block_size", "checkpoint_files", "dequantize_fp8_block", "expected_weight_shapes",
           "format_weight_errors", "is_mtp_weight", "iter_checkpoint", "quantize_fp8_block", "stored_fp8_names"]

logger = logging.getLogger(__name__)

_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")
_FUSED_EXPERTS = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)")


def is_mtp_weight(name: str, num_hidden_layers: int) -> bool:
    """Multi-token-prediction layers are stored as layers num_hidden_layers and up; the engine skips them."""
    match = _LAYER_INDEX.match(name)
    return match is not None and int(match.group(1)) >= num_hidden_layers


def _split_fused_experts(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """transformers' in-memory layout (gate_up_proj [E, 2I, H], down_proj [E, H, I]) -> per-expert names."""
    match = _FUSED_EXPERTS.fullmatch(name)
    if match is None or tensor.dim() != 3:
        return [(name, tensor)]
    prefix, kind = match.groups()
    out = []
    for expert in range(tensor.shape[0]):
        if kind == "down_proj":
            out.append((f"{prefix}.{expert}.down_proj.weight", tensor[expert]))
        else:
            gate, up = tensor[expert].chunk(2, dim=0)
            out += [(f"{prefix}.{expert}.gate_proj.weight", gate), (f"{prefix}.{expert}.up_proj.weight", up)]
    return out


def checkpoint_files(model_dir: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (model.safetensors.index.json, else every *.safetensors)."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors files in {model_dir}")
    out: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            out.update({name: file for name in f.keys()})
    return out


def stored_fp8_names(model_dir: str | Path) -> set[str]:
    """Names of the tensors a checkpoint stores in FP8 (from the safetensors headers; nothing is read)."""
    names: set[str] = set()
    for file in sorted(set(checkpoint_files(model_dir).values())):
        with safe_open(str(file), framework="pt") as f:
            names.update(name for name in f.keys() if f.get_slice(name).get_dtype().startswith("F8"))
    return names


def checkpoint_block_size(model_dir: str | Path) -> tuple[int, int]:
    """quantization_config.weight_block_size of config.json (DeepSeek's 128x128 when absent)."""
    return _block_size(Path(model_dir))


def _block_size(model_dir: Path) -> tuple[int, int]:
    config = model_dir / "config.json"
    quant = {}
    if config.exists():
        quant = json.loads(config.read_text()).get("quantization_config") or {}
    block = quant.get("weight_block_size") or (128, 128)
    return int(block[0]), int(block[1])


def iter_checkpoint(
    model_dir: str | Path,
    num_hidden_layers: int | None = None,
    dequant_dtype: torch.dtype = torch.float32,
    skip: Callable[[str], bool] | None = None,
    keep_fp8: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, full tensor) in file order. FP8 weights come out dequantised (their
    weight_scale_inv is consumed), or with keep_fp8 as stored, each followed by its `<name>_scale_inv`
    (for engine.layers.fp8_linear on a GPU); layers >= num_hidden_layers (MTP) are dropped when it is given.
    Names for which skip(name) is true are not read: they come out as "meta" tensors of the stored
    shape (e.g. experts another rank owns), so shape checks still see them."""
    model_dir = Path(model_dir)
    files = checkpoint_files(model_dir)
    block = _block_size(model_dir)
    with ExitStack() as stack:
        handles: dict[Path, object] = {}

        def handle(name: str):  # the open safetensors file holding `name`
            file = files[name]
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(str(file), framework="pt"))
            return handles[file]

        def read(name: str) -> torch.Tensor:
            return handle(name).get_tensor(name)

        for name in sorted(files, key=lambda n: (str(files[n]), n)):
            if num_hidden_layers is not None and is_mtp_weight(name, num_hidden_layers):
                continue
            if name.endswith("_scale_inv") and name[: -len("_scale_inv")] in files:
                continue  # consumed with its weight
            if skip is not None and skip(name):
                yield name, torch.empty(handle(name).get_slice(name).get_shape(), device="meta")
                continue
            tensor = read(name)
            if tensor.dtype in FP8_DTYPES:
                scale_name = name + "_scale_inv"
                if scale_name not in files:
                    raise ValueError(f"FP8 tensor {name} has no {scale_name}")
                if keep_fp8:
                    yield name, tensor
                    yield scale_name, read(scale_name)
                    continue
                tensor = dequantize_fp8_block(tensor, read(scale_name), block, dequant_dtype)
            yield from _split_fused_experts(name, tensor)


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint for `config` must hold, by HF name, with its full (unsharded) shape."""
    c = config
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
                                          "model.norm.weight": (c.hidden_size,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for layer in range(c.num_hidden_layers):
        p = f"model.layers.{layer}."
        shapes[p + "input_layernorm.weight"] = (c.hidden_size,)
        shapes[p + "post_attention_layernorm.weight"] = (c.hidden_size,)
        a = p + "self_attn."
        q_out = c.num_attention_heads * c.qk_head_dim
        if c.q_lora_rank is None:
            shapes[a + "q_proj.weight"] = (q_out, c.hidden_size)
        else:
            shapes[a + "q_a_proj.weight"] = (c.q_lora_rank, c.hidden_size)
            shapes[a + "q_a_layernorm.weight"] = (c.q_lora_rank,)
            shapes[a + "q_b_proj.weight"] = (q_out, c.q_lora_rank)
        shapes[a + "kv_a_proj_with_mqa.weight"] = (c.kv_cache_dim, c.hidden_size)
        shapes[a + "kv_a_layernorm.weight"] = (c.kv_lora_rank,)
        shapes[a + "kv_b_proj.weight"] = (c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
        shapes[a + "o_proj.weight"] = (c.hidden_size, c.num_attention_heads * c.v_head_dim)
        m = p + "mlp."
        if not c.is_moe_layer(layer):
            shapes.update(_mlp_shapes(m, c.hidden_size, c.intermediate_size))
            continue
        shapes[m + "gate.weight"] = (c.n_routed_experts, c.hidden_size)
        if c.topk_method == "noaux_tc":
            shapes[m + "gate.e_score_correction_bias"] = (c.n_routed_experts,)
        for expert in range(c.n_routed_experts):
            shapes.update(_mlp_shapes(f"{m}experts.{expert}.", c.hidden_size, c.moe_intermediate_size))
        if c.n_shared_experts:
            shapes.update(_mlp_shapes(m + "shared_experts.", c.hidden_size, c.shared_intermediate_size))
    return shapes


def _mlp_shapes(prefix: str, hidden: int, intermediate: int) -> dict[str, tuple[int, ...]]:
    return {prefix + "gate_proj.weight": (intermediate, hidden), prefix + "up_proj.weight": (intermediate, hidden),
            prefix + "down_proj.weight": (hidden, intermediate)}


def format_weight_errors(missing: list[str], unexpected: list[str], misshaped: list[str]) -> str:
    """One message naming every offending tensor, grouped by problem."""
    parts = []
    for label, names in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped)):
        if names:
            parts.append(f"{len(names)} {label}: " + ", ".join(sorted(names)))
    return "checkpoint does not match the model config; " + "; ".join(parts)

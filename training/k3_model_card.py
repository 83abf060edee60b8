"""README.md (model card) of the K3-shaped default model, written from its metrics and configs."""
from __future__ import annotations

from pathlib import Path


def write_k3_model_card(path: Path, m: dict, samples: dict[str, str], config: dict, draft: dict) -> None:
    t = config["text_config"]
    lin = t["linear_attn_config"]
    kda = [i - 1 for i in lin["kda_layers"]]
    mla = [i - 1 for i in lin["full_attn_layers"]]
    ok_loss = m["loss_ratio"] <= m["loss_ratio_threshold"]
    ok_accept = m["acceptance_length"] >= m["acceptance_threshold"]
    rates = ", ".join(f"{r:.2f}" for r in m["acceptance_per_position"])
    lines = [
        "# pdserve-k3-tiny", "",
        "A tiny model with Kimi K3's architecture and checkpoint layout, trained from scratch on the Python standard",
        "library by `training/train_k3_default_model.py`, with a DSpark draft trained by the same script. It exists so",
        "that a fresh clone serves real (if simple) Python-like text and a real speculative speed-up with no download.",
        "", "## Architecture (config.json, `model_type: kimi_k3`)", "",
        f"- {t['num_hidden_layers']} layers, hidden {t['hidden_size']}, vocabulary {t['vocab_size']} (byte-level BPE, "
        "models/pdserve-tiny's tokenizer).",
        f"- KDA layers {kda} and gated NoPE MLA layers {mla} (3:1): {lin['num_heads']} KDA heads of {lin['head_dim']}, "
        f"short conv {lin['short_conv_kernel_size']}, full-rank output gate, safe gate lower bound "
        f"{lin['gate_lower_bound']}; MLA {t['num_attention_heads']} heads (TP=2: 12 per rank, padded to 16 by the "
        f"MLA backends), q_lora {t['q_lora_rank']}, kv_lora {t['kv_lora_rank']}, nope/rope/v "
        f"{t['qk_nope_head_dim']}/{t['qk_rope_head_dim']}/{t['v_head_dim']}, sigmoid output gate, no positions.",
        f"- Attention Residuals, blocks of {t['attn_res_block_size']} layers.",
        f"- Layer 0 dense SiTU MLP ({t['intermediate_size']}); layers 1.. LatentMoE: {t['num_experts']} routed experts "
        f"top-{t['num_experts_per_token']} (sigmoid router, selection bias) in latent width "
        f"{t['routed_expert_hidden_size']} (intermediate {t['moe_intermediate_size']}, MXFP4, trained with a "
        f"straight-through MXFP4 fake-quantiser), {t['num_shared_experts']} shared experts, SiTU (beta 4 / 25).",
        f"- Target parameters: {m['target_parameters']:,}; model.safetensors {m['target_bytes'] / 1e6:.1f} MB "
        "(bfloat16; KDA conv / dt_bias / A_log and router bias float32; experts MXFP4).",
        f"- DSpark draft (draft/): {draft['num_hidden_layers']} layers, hidden {draft['hidden_size']}, "
        f"{draft['num_attention_heads']} / {draft['num_key_value_heads']} heads of {draft['head_dim']}, taps after "
        f"layers {draft['target_layer_ids']}, gamma {draft['block_size']} (verify {m['verify_block']} tokens), vanilla "
        f"Markov head rank {draft['markov_rank']}, no confidence head; {m['draft_parameters']:,} parameters, "
        f"{m['draft_bytes'] / 1e6:.1f} MB. Target + draft: {m['total_megabytes']:.1f} MB.",
        "", "## Training data", "",
        f"The Python {m['python_version']} standard library's .py sources (training/corpus.py: no site-packages, no "
        f"test directories), {m['train_files']} training files ({m['train_tokens']:,} tokens) and {m['held_out_files']} "
        f"held-out files ({m['held_out_tokens']:,} tokens). The draft trains on {_draft_sequences(m)} from the "
        f"training split continued greedily ({m['draft_generated']} tokens) by the saved target through the engine.",
        "", "## Training", "",
        f"Warm start: {m['warm_start']}'s embedding, LM head, final norm, layer-0 MLP and norms, MLA projections and "
        "shared experts (the tensors whose shapes the two models share; training/k3_warm_start.py); everything K3 "
        "adds (KDA, gates, Attention Residuals, latent routed experts) starts fresh." if m.get("warm_start") else
        "No warm start: every tensor starts from its fresh initialisation.",
        f"Target: AdamW float32, batch {m['target_batch']} x {m['shape']['train_length']} "
        f"tokens, lr {m['target_lr']}, cosine over a {m['target_budget_minutes']:.0f}-minute wall-clock budget: "
        f"{m['target_steps']} steps in {m['target_minutes']:.1f} min (1 thread, shared machine). Draft: "
        f"{_draft_steps(m)}.",
        f"Commands: `{m['target_command']}`; draft {_draft_commands(m)}; eval `{m['eval_command']}`.",
        "", "## Results (measured on the saved, MXFP4-quantised checkpoint through the engine)", "",
        f"- Held-out loss {m['held_out_loss']:.3f} nats/token over {m['eval_windows']} windows of {m['eval_length']}; "
        f"unigram cross-entropy {m['unigram_entropy']:.3f}; ratio {m['loss_ratio']:.3f} (target <= "
        f"{m['loss_ratio_threshold']}: {'met' if ok_loss else 'NOT met'}).",
        f"- DSpark acceptance: {m['acceptance_length']:.2f} tokens per verify step (bonus included) at verify block "
        f"{m['verify_block']}, greedy, {m['accept_prompts']} held-out prompts of {m['accept_prompt_length']} tokens + "
        f"{m['accept_new_tokens']} new, {m['verify_steps']} verify steps, the engine's own spec decoding (target >= "
        f"{m['acceptance_threshold']}: {'met' if ok_accept else 'NOT met'}). Per draft position (given reached): {rates}.",
        "", "## Greedy samples", "",
    ]
    for prompt, text in samples.items():
        lines += [f"Prompt `{prompt!r}`:", "", "```python", prompt + text, "```", ""]
    path.write_text("\n".join(lines))


def _draft_rounds(m: dict) -> list[dict]:
    """The draft's training rounds, oldest first: earlier ones (--draft-init continued them) and the last."""
    return [*m.get("draft_previous_rounds", []), m]


def _draft_sequences(m: dict) -> str:
    rounds = _draft_rounds(m)
    if len(rounds) == 1:
        return f"{m['draft_sequences']} prompts"
    return " + ".join(str(r["draft_sequences"]) for r in rounds) + f" prompts ({len(rounds)} rounds, each on new ones)"


def _draft_steps(m: dict) -> str:
    return ", then ".join(f"{r['draft_steps']} steps in {r['draft_train_minutes']:.1f} min (phase total "
                          f"{r['draft_minutes']:.1f} min)" for r in _draft_rounds(m))


def _draft_commands(m: dict) -> str:
    return ", then ".join(f"`{r['draft_command']}`" for r in _draft_rounds(m))

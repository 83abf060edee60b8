"""Write the model card (README.md) from the measured metrics."""

from __future__ import annotations

from pathlib import Path


def write_model_card(path: Path, m: dict, samples: dict[str, str], c: dict, d: dict) -> None:
    """m: metrics; c: the target's config.json; d: the draft's config.json.

    The YAML front matter carries the numbers tests read (loss_ratio_threshold)."""
    rope = c["rope_parameters"]
    rerun = ("\nThe shipped draft was retrained after the full run with `--reuse-target` (the target phase is unaffected"
             " by\ndraft settings; the target weights are not rewritten); the wall time adds the full run's target phase"
             f" to the\ndraft rerun. The draft's own command ({m.get('draft_minutes', 0):.1f} min, "
             f"{m.get('draft_threads', m['threads'])} thread(s)):\n\n```\n"
             f"{m.get('draft_command', m['command'])}\n```" if m.get("draft_rerun") else "")
    sample_text = "\n".join(f"Prompt `{p!r}`:\n\n```python\n{p}{s}\n```\n" for p, s in samples.items())
    per_position = ", ".join(f"{r:.2f}" for r in m["acceptance_per_position"])
    low = m.get("draft_prompt_min", m["accept_prompt_length"])
    high = m.get("draft_prompt_max", low)
    prompts = (f"{high}-token prompts from the train split + {m['draft_generated']} greedy tokens" if low == high else
               f"{low}..{high}-token prompts (one length per generation batch) from the train split,\ncontinued "
               f"greedily to {high + m['draft_generated']} tokens")
    warm = " Warm-started from the previous draft (`--draft-init`)." if m.get("draft_init") else ""
    path.write_text(f"""---
held_out_loss: {m['held_out_loss']:.4f}
unigram_entropy: {m['unigram_entropy']:.4f}
loss_ratio: {m['loss_ratio']:.4f}
loss_ratio_threshold: {m['loss_ratio_threshold']:.2f}
acceptance_length_b8: {m['acceptance_length']:.3f}
---

# pdserve-tiny

The embedded default model of pdserve: a {m['target_parameters']:,}-parameter DeepSeek-V3-architecture
(MLA + MoE) causal LM and a {m['draft_parameters']:,}-parameter DFlash-style block-diffusion draft
(`draft/`), trained from scratch on this machine by `training/train_default_model.py`
(the target with transformers' `DeepseekV3ForCausalLM`).
It writes Python-looking text; it is a test fixture, not a useful model.

## Reproduce

```
{m['command']}
```

Seed {m['seed']}; {m['threads']} CPU threads (`torch.set_num_threads`), float32 training, weights saved in bf16.
Wall time on the 2-core development machine (shared with other jobs): {m['wall_minutes']:.1f} min in all
(target {m['target_minutes']:.1f} min, target + draft {m['train_minutes']:.1f} min, the rest evaluation).
Results depend on the Python build whose standard library is the corpus.{rerun}
All measured numbers are also in `training_metrics.json`.

## Data

The running interpreter's standard library .py sources: `{m['stdlib']}` (Python {m['python_version']}),
sorted by relative path; `site-packages` and test directories (`test`, `tests`, `idle_test`) excluded;
files that are not UTF-8 skipped ({m['skipped_files']}). Held-out split: every file whose
`int(sha1(relative posix path), 16) % 50 == 0`.

| split | files | bytes | tokens |
|---|---|---|---|
| train | {m['train_files']} | {m['train_bytes']:,} | {m['train_tokens']:,} |
| held-out | {m['held_out_files']} | {m['held_out_bytes']:,} | {m['held_out_tokens']:,} |

Each file is one document, `<|bos|> ... <|eos|>`.

## Tokenizer

Byte-level BPE (HF `tokenizers`), vocabulary {c['vocab_size']} (a multiple of 64, so it splits evenly over TP=2),
trained on the train split. Special tokens: `<|bos|>`=0, `<|eos|>`=1, `<|pad|>`=2, `<|mask|>`=3
(the draft's mask token). Any Unicode text round-trips.

## Target (`config.json`, `model.safetensors`)

`DeepseekV3ForCausalLM`: hidden {c['hidden_size']}, {c['num_hidden_layers']} layers (first {c['first_k_dense_replace']} dense,
the rest MoE), {c['num_attention_heads']} attention heads (qk_nope {c['qk_nope_head_dim']}, qk_rope {c['qk_rope_head_dim']},
v {c['v_head_dim']}), q_lora_rank {c['q_lora_rank']}, kv_lora_rank {c['kv_lora_rank']}, {c['n_routed_experts']} routed experts
(top-{c['num_experts_per_tok']}, sigmoid scores, noaux_tc with aux-loss-free bias balancing during training, n_group
{c['n_group']}) + {c['n_shared_experts']} shared expert, moe_intermediate {c['moe_intermediate_size']}, dense intermediate
{c['intermediate_size']}, untied embeddings, interleaved RoPE with yarn scaling (factor {rope['factor']:g} over the
{rope['original_max_position_embeddings']}-token training length, max_position_embeddings {c['max_position_embeddings']},
mscale {rope['mscale']:g}, mscale_all_dim {rope['mscale_all_dim']:g}).
Trained {m['target_steps']} steps x {m['target_batch']} random {rope['original_max_position_embeddings']}-token windows
({m['target_steps'] * m['target_batch'] * rope['original_max_position_embeddings']:,} tokens), AdamW (betas 0.9/0.95,
weight decay 0.05), lr {m['target_lr']:g} with {m['target_warmup']} warmup steps and cosine decay to 10%,
gradient clipping 1.0.

## Held-out loss

Slice: the held-out token stream (files in sorted order) cut into the first {m['eval_windows']}
windows of {m['eval_length']} + 1 tokens (stride {m['eval_length']}); each window's last {m['eval_length']}
tokens are predicted. Unigram entropy: cross-entropy (nats) of the same tokens under
p(v) = (count_train(v) + 1) / (N_train + {c['vocab_size']}) from the training split's token counts.
Measured on the saved bf16 weights loaded in float32.

| held-out loss (nats) | unigram entropy (nats) | ratio | threshold |
|---|---|---|---|
| {m['held_out_loss']:.4f} | {m['unigram_entropy']:.4f} | {m['loss_ratio']:.4f} | {m['loss_ratio_threshold']:.2f} |

## Draft (`draft/`)

`engine/models/dflash.py`: context = the target's hidden states after decoder layers
{list(d['target_layer_ids'])} (`output_hidden_states[L + 1]`), concatenated, projected and RMS-normalised;
keys/values in every draft layer. {d['num_layers']} layers, {d['num_heads']} query / {d['num_kv_heads']} KV heads of
{d['head_dim']}, intermediate {d['intermediate_size']}, block size {d['block_size']}, mask token {d['mask_token_id']};
the target's embedding and LM head are shared (frozen). Trained {m['draft_steps']} steps x {m['draft_batch']} sequences
on the target's own greedy continuations ({m['draft_sequences']} sequences: {prompts}), {m['draft_anchors']} anchors per
sequence, loss weights exp(-(i-1)/4) over block positions, AdamW lr {m['draft_lr']:g} with cosine decay.{warm}

Acceptance (greedy draft-then-verify with the transformers target, block size 8, bonus token counted;
{m['accept_prompts']} held-out prompts of {m['accept_prompt_length']} tokens, {m['accept_new_tokens']} new tokens each):
**{m['acceptance_length']:.2f} accepted tokens per verify step**; fraction of verify steps in which draft positions 1..{len(m["acceptance_per_position"])} were accepted: {per_position}.
{bench_line(m)}{previous_line(m.get("previous_draft"))}

## Greedy samples

{sample_text}""")


def bench_line(m: dict) -> str:
    """The acceptance at the speculative benchmarks' shape (64-token prompts, 128 new), when measured."""
    if "acceptance_length_64_128" not in m:
        return ""
    rates = ", ".join(f"{r:.2f}" for r in m["acceptance_per_position_64_128"])
    return (f"At the benchmarks' shape ({m['accept_prompts']} held-out prompts of 64 tokens, 128 new tokens each): "
            f"**{m['acceptance_length_64_128']:.2f}**; per position {rates}.\n")


def previous_line(prev: dict | None) -> str:
    """The draft this one replaced, from training_metrics.json's previous_draft."""
    if not prev:
        return ""
    rates = ", ".join(f"{r:.2f}" for r in prev["acceptance_per_position"])
    return (f"\nThe previous draft ({prev['draft_steps']} steps, {prev['draft_sequences']} sequences, lr "
            f"{prev['draft_lr']:g}) measured {prev['acceptance_length']:.2f} on the same {prev['accept_prompts']}"
            f" prompts (per position {rates}); all its figures are under `previous_draft` in training_metrics.json.\n")

"""Metrics of the default model: held-out loss vs unigram entropy, and draft acceptance length.

Definitions (also in the model card):
- held-out slice: the held-out documents' token stream ([bos] doc [eos], files in
  sorted order) cut into ``num_windows`` consecutive windows of ``length + 1``
  tokens (windows overlap by one token); the model predicts the last ``length``
  tokens of each window from the ones before (context restarts at each window).
- unigram entropy: cross-entropy in nats of the same predicted tokens under the
  unigram distribution p(v) = (count_train(v) + 1) / (N_train + V) estimated
  from the TRAINING split's token counts (bos/eos included, add-one smoothing).
- ratio = model loss / unigram entropy.
- acceptance length: greedy draft-then-verify with the transformers target; each
  verify step accepts the longest draft prefix equal to the target's argmax plus
  the target's bonus token; mean accepted tokens per verify step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from transformers import DeepseekV3ForCausalLM, DynamicCache

from engine.models.dflash import DFlashDraft


def held_out_slice(held_out_stream: torch.Tensor, length: int, num_windows: int) -> torch.Tensor:
    """[num_windows, length + 1] consecutive windows from the start of the held-out stream."""
    needed = num_windows * length + 1
    if held_out_stream.numel() < needed:
        raise ValueError(f"held-out stream has {held_out_stream.numel()} tokens, need {needed}")
    return torch.stack([held_out_stream[i * length : i * length + length + 1] for i in range(num_windows)])


def acceptance_prompts(held_out_stream: torch.Tensor, length: int, count: int) -> list[list[int]]:
    """count prompts of length tokens spread evenly over the held-out stream."""
    stride = max(1, (held_out_stream.numel() - length) // count)
    return [held_out_stream[i * stride : i * stride + length].tolist() for i in range(count)]


def unigram_counts(train_docs: Sequence[Sequence[int]], vocab_size: int) -> torch.Tensor:
    """How often each token id occurs in the training documents (float64, [vocab_size])."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for doc in train_docs:
        counts += torch.bincount(torch.tensor(doc), minlength=vocab_size).double()
    return counts


def unigram_entropy(train_docs: Sequence[Sequence[int]] | torch.Tensor, vocab_size: int, windows: torch.Tensor) -> float:
    """Cross-entropy (nats) of windows[:, 1:] under the add-one-smoothed training unigram (train_docs: the
    documents' token ids, or their unigram_counts)."""
    counts = train_docs if isinstance(train_docs, torch.Tensor) else unigram_counts(train_docs, vocab_size)
    log_probs = torch.log((counts + 1) / (counts.sum() + vocab_size))
    return -log_probs[windows[:, 1:].flatten()].mean().item()


@torch.no_grad()
def model_loss(model: DeepseekV3ForCausalLM, windows: torch.Tensor, batch_size: int = 8) -> float:
    """Mean next-token cross-entropy (nats) of windows[:, 1:] given the preceding tokens."""
    total = 0.0
    for first in range(0, windows.shape[0], batch_size):
        chunk = windows[first : first + batch_size]
        logits = model(chunk[:, :-1]).logits.float()
        total += F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum").item()
    return total / windows[:, 1:].numel()


@torch.no_grad()
def greedy_text(model: DeepseekV3ForCausalLM, prompt_ids: list[int], new_tokens: int) -> list[int]:
    """Greedy continuation (no KV cache; short prompts only)."""
    ids = list(prompt_ids)
    for _ in range(new_tokens):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids):]


@torch.no_grad()
def acceptance_length(
    target: DeepseekV3ForCausalLM, draft: DFlashDraft, prompts: Sequence[Sequence[int]], block_size: int,
    new_tokens: int,
) -> tuple[float, list[float]]:
    """Mean accepted tokens per verify step (bonus included) and per-position acceptance rates [B-1].

    The target keeps a KV cache, cropped back to the accepted tokens after each verify forward, and the draft's
    context entries are appended for the accepted positions only: each step costs a block, not the sequence."""
    layer_ids, mask_id = draft.config.target_layer_ids, draft.config.mask_token_id
    embed, lm_head = target.get_input_embeddings(), target.lm_head
    steps, accepted, reached = 0, 0, torch.zeros(block_size - 1)

    def entries(out, start: int, count: int) -> torch.Tensor:  # draft context of target positions start..+count
        captured = torch.cat([out.hidden_states[i + 1][0, :count] for i in layer_ids], dim=-1)
        return draft.context_entries(captured, start + torch.arange(count))

    for prompt in prompts:
        seq, cache = list(prompt), DynamicCache()
        out = target(torch.tensor([seq]), cache=cache, use_cache=True, output_hidden_states=True)
        context = entries(out, 0, len(seq))  # [layers, T, dim]: positions 0..n-2 (n = len(seq) below)
        seq.append(int(out.logits[0, -1].argmax()))
        while len(seq) - len(prompt) < new_tokens:
            n = len(seq)  # last accepted token at n-1; the cache and the context cover 0..n-2
            block = torch.tensor([[seq[-1]] + [mask_id] * (block_size - 1)])
            hidden = draft(embed(block), (n - 1 + torch.arange(block_size))[None], context[:, None],
                           torch.tensor([n - 1]))
            drafts = lm_head(hidden[0, 1:]).argmax(-1).tolist()
            out = target(torch.tensor([[seq[-1]] + drafts]), cache=cache, use_cache=True,
                         output_hidden_states=True)
            verified = out.logits[0].argmax(-1).tolist()  # target's token for positions n ..
            matched = 0
            while matched < block_size - 1 and drafts[matched] == verified[matched]:
                matched += 1
            reached[:matched] += 1
            seq += drafts[:matched] + [verified[matched]]
            context = torch.cat([context, entries(out, n - 1, matched + 1)], dim=1)
            if matched < block_size - 1:  # keep positions 0 .. n-1+matched (transformers: crop(-k) drops k)
                cache.crop(-(block_size - 1 - matched))
            steps += 1
            accepted += matched + 1
    return accepted / steps, (reached / steps).tolist()

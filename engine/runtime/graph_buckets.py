"""Batch-size buckets for captured decode / verify graphs, as pure functions (tested on CPU).

A graph is captured per (bucket, query length). A step of n sequences runs the graph of the smallest
bucket >= n; the n real sequences are padded with dummy ones that each write q tokens into one
reserved scratch page and read only that page, so they never touch a real sequence's cache."""
from __future__ import annotations

from engine.runtime.forward_batch import ForwardMode
from engine.runtime.step_plan import TargetPlan


def graph_buckets(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every multiple of 8 up to max_batch (max_batch itself always included)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    buckets = [b for b in (1, 2, 4) if b < max_batch]
    buckets += list(range(8, max_batch, 8))
    return tuple(buckets + [max_batch])


def bucket_for(num_seqs: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket holding num_seqs sequences, or None when it exceeds them all."""
    return next((b for b in buckets if b >= num_seqs), None)


def uniform_query_len(plan: TargetPlan) -> int | None:
    """The query length shared by every sequence of a graphable plan (decode / verify on the engine's own
    cache with every row's logits wanted), or None when the plan must run eagerly."""
    if plan.mode != ForwardMode.DECODE or plan.pool_names is not None or not plan.q_lens:
        return None
    q_len = plan.q_lens[0]
    if any(q != q_len for q in plan.q_lens) or list(plan.logit_rows) != list(range(len(plan.input_ids))):
        return None
    return q_len


def pad_target_plan(plan: TargetPlan, bucket: int, scratch_page: int, page_size: int) -> TargetPlan:
    """plan (uniform query length q) padded to `bucket` sequences. Each dummy sequence has q tokens
    (id 0, positions 0 .. q-1), a context of exactly those q tokens, and a page table of the scratch
    page alone (repeated if q > page_size: slots wrap inside that one page)."""
    q_len = uniform_query_len(plan)
    if q_len is None:
        raise ValueError("only decode / verify plans with one query length per sequence can be padded")
    pad = bucket - len(plan.q_lens)
    if pad < 0:
        raise ValueError(f"{len(plan.q_lens)} sequences do not fit bucket {bucket}")
    dummy_pages = [scratch_page] * -(-q_len // page_size)
    input_ids = list(plan.input_ids) + [0] * (pad * q_len)
    return TargetPlan(
        mode=plan.mode,
        input_ids=input_ids,
        positions=list(plan.positions) + list(range(q_len)) * pad,
        q_lens=list(plan.q_lens) + [q_len] * pad,
        kv_lens=list(plan.kv_lens) + [q_len] * pad,
        page_tables=list(plan.page_tables) + [dummy_pages] * pad,
        logit_rows=list(range(len(input_ids))),
        pool_names=None,
        write_draft_context=plan.write_draft_context,
    )


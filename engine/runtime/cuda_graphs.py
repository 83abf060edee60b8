"""Decode and verify steps captured as CUDA (HIP) graphs, one per (batch-size bucket, query length).

At start-up every graph is captured over a static packed input buffer (one int64 tensor holding input
ids, positions and the per-token / per-sequence attention metadata, see forward_batch.pack_step_inputs)
and one persistent device block table (engine/runtime/block_table.py) shared by every graph. A step copies its
padded inputs into the packed buffer with one host-to-device copy, writes only the page-table entries
that changed since the last step, and replays the graph. Steps that do not fit (prefill, mixed query
lengths, more sequences than the largest bucket, another engine's pools) run eagerly, as does everything
when the attention backend cannot be captured (it reads host-side lengths) or `--no-graphs` is given. The
draft's proposal runs eagerly (its context length changes every step). The bucket and padding logic is
engine/runtime/graph_buckets.py.

Models with linear-attention state (K3, Kimi Linear) capture plain decode steps and speculative verify steps
too: every sequence's state slot travels in the packed buffer and padding rows use one scratch slot the engine
never hands out (the runner allocates it in a local cache). A verify step of such a model leaves the slots alone
and writes the state after every position into the state pool's snapshot scratch, rows 0 .. bucket-1: its
graphs are captured only when that scratch is allocated at start-up (fixed: it never moves) and holds the
bucket; otherwise no verify graph is captured (no memory is spent on graphs that would never replay) and
verifies run eagerly. Buckets never exceed the sequences that can hold a state slot.

Tensor parallelism: every rank must replay the same graphs (each holds collectives), so which buckets
were captured is agreed across ranks after capture: a bucket that failed on any rank runs eagerly on all.

This module imports nothing from engine.runtime.model_runner: the runner is any object with the GraphedRunner
attributes (no import cycle)."""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Callable, NamedTuple, Protocol

import torch

from engine.runtime.block_table import DeviceBlockTable
from engine.runtime.devices import copy_host_values, host_to_device
from engine.runtime.distributed import TPGroup
from engine.runtime.forward_batch import ForwardBatch, ForwardMode, StepLayout, pack_step_inputs, unpack_forward_batch
from engine.runtime.graph_buckets import bucket_for, graph_buckets, pad_target_plan, uniform_query_len
from engine.runtime.step_plan import DraftPlan, TargetPlan

logger = logging.getLogger(__name__)


class GraphedRunner(Protocol):
    """What CudaGraphRunner needs of engine.runtime.model_runner.ModelRunner."""

    config: object  # RunnerConfig: page_size, num_pages
    device: torch.device
    tp: TPGroup
    cache: object

    def forward_target(self, batch: ForwardBatch, rows: torch.Tensor, cache, write_draft_context: bool) -> torch.Tensor:
        ...


class CapturedStep(NamedTuple):
    graph: torch.cuda.CUDAGraph
    packed: torch.Tensor  # the static input buffer the graph reads
    layout: StepLayout
    logits: torch.Tensor  # the static output the graph writes: [bucket * q_len, vocab]
    run: Callable[[], torch.Tensor]  # the captured step as a function: what a replay does, run eagerly


class PaddedStep(NamedTuple):
    """A plan padded to its bucket: the packed values (no block table), their layout and every row's page list."""

    values: list[int]
    layout: StepLayout
    page_tables: list[list[int]]


def pad_step(plan: TargetPlan, bucket: int, scratch_page: int, page_size: int, max_pages: int,
             scratch_slot: int | None = None) -> PaddedStep:
    """plan padded to `bucket` sequences (graph_buckets.pad_target_plan) and packed without its block table.
    scratch_slot (models with linear-attention state): the packed extra section holds the logit rows, then
    every sequence's state slot, padding rows on scratch_slot."""
    padded = pad_target_plan(plan, bucket, scratch_page, page_size)
    extra = list(padded.logit_rows)
    if scratch_slot is not None:
        extra += list(plan.state_slots or ()) + [scratch_slot] * (bucket - len(plan.q_lens))
    values, layout = pack_step_inputs(padded.input_ids, padded.positions, padded.q_lens, padded.kv_lens,
                                      padded.page_tables, page_size, extra, max_pages, include_table=False)
    return PaddedStep(values, layout, padded.page_tables)


def agree_across_ranks(keys: list[tuple[int, int]], captured: set[tuple[int, int]], tp: TPGroup,
                       device: torch.device) -> set[tuple[int, int]]:
    """The keys captured on EVERY rank (a collective: each rank passes the same sorted keys). A graph holds
    the step's all-reduces; one rank replaying it while another runs eagerly with other sizes hangs NCCL."""
    if tp.size == 1 or not keys:
        return set(captured)
    flags = host_to_device([int(key in captured) for key in keys], torch.int32, device)
    counts = tp.all_reduce(flags).tolist()  # start-up only
    return {key for key, count in zip(keys, counts) if count == tp.size}


class CudaGraphRunner:
    """Captured target steps of one runner; run_target returns None when a plan must run eagerly."""

    def __init__(self, runner: GraphedRunner, max_batch: int, query_lens: tuple[int, ...], max_pages: int,
                 scratch_state_slot: int | None = None) -> None:
        """scratch_state_slot: a model with linear-attention state; its captured steps read every sequence's
        state slot from the packed buffer, padding rows using this slot (one the engine never hands out)."""
        self.runner = runner
        self.scratch_state_slot = scratch_state_slot
        self.buckets = graph_buckets(max_batch)
        self.query_lens = tuple(sorted(set(query_lens)))
        self.max_pages = max_pages
        self.page_size = runner.config.page_size
        self.scratch_page = runner.config.num_pages - 1
        self.block_table = DeviceBlockTable(max(self.buckets), max_pages, runner.device)
        self.steps: dict[tuple[int, int], CapturedStep] = {}
        self.pool = None
        self.write_draft = False

    def capture(self, write_draft: bool) -> None:
        """Captures every (bucket, query length), largest first so smaller graphs reuse its memory pool.
        A capture that fails (an op that syncs with the host) leaves that bucket eager on every rank."""
        self.write_draft = write_draft
        device = self.runner.device
        free_before = torch.cuda.mem_get_info(device)[0]
        started = time.perf_counter()
        keys = [(bucket, q_len) for q_len in self.query_lens for bucket in sorted(self.buckets, reverse=True)
                if self._replayable(bucket, q_len)]
        for bucket, q_len in keys:
            try:
                self.steps[(bucket, q_len)] = self._capture_one(bucket, q_len, write_draft)
            except RuntimeError as error:
                logger.warning("graph capture of batch %d x %d tokens failed on rank %d (%s)",
                               bucket, q_len, self.runner.tp.rank, str(error).splitlines()[0])
        agreed = agree_across_ranks(sorted(keys), set(self.steps), self.runner.tp, device)
        dropped = sorted(set(self.steps) - agreed)
        for key in dropped:
            del self.steps[key]
        if len(self.steps) < len(keys):
            logger.error("%d of %d graph buckets run eagerly on every rank (a capture failed on some rank): %s",
                         len(keys) - len(self.steps), len(keys), sorted(set(keys) - set(self.steps)))
        torch.cuda.synchronize(device)
        used = free_before - torch.cuda.mem_get_info(device)[0]
        logger.info("captured %d CUDA graphs (buckets %s, query lengths %s) in %.2f s using %.1f MiB",
                    len(self.steps), list(self.buckets), list(self.query_lens), time.perf_counter() - started,
                    used / 2**20)

    def _snapshots(self, q_len: int) -> bool:
        """Whether steps of q_len tokens per sequence are speculative verifies keeping per-position state (a model
        with linear-attention state verifies drafts that way; its plain decode steps have one token)."""
        return self.scratch_state_slot is not None and q_len > 1

    def _replayable(self, bucket: int, q_len: int) -> bool:
        """Whether a graph of this key could ever replay. A stateful verify graph writes snapshot rows
        0 .. bucket-1 at q_len positions: only a scratch fixed at start-up and at least that large qualifies."""
        if not self._snapshots(q_len):
            return True
        state = self.runner.cache.state
        conv = state.snapshot_conv if state is not None else None
        fits = state is not None and state.fixed_snapshots and conv is not None and conv.shape[1] >= bucket \
            and conv.shape[2] >= q_len
        if not fits:
            logger.info("no verify graph for batch %d x %d tokens: the state pool's snapshot scratch is not fixed "
                        "or too small (verifies of that size run eagerly)", bucket, q_len)
        return fits

    def _capture_one(self, bucket: int, q_len: int, write_draft: bool) -> CapturedStep:
        runner = self.runner
        snapshot = self._snapshots(q_len)
        one = TargetPlan(ForwardMode.DECODE, [0] * q_len, list(range(q_len)), [q_len], [q_len],
                         [[self.scratch_page] * -(-q_len // self.page_size)], list(range(q_len)), None, write_draft,
                         state_slots=[self.scratch_state_slot] if self.scratch_state_slot is not None else None)
        padded = pad_step(one, bucket, self.scratch_page, self.page_size, self.max_pages,
                          self.scratch_state_slot)  # all rows padding
        # The captured metadata claims the longest possible contexts so kernels size their split-K for them;
        # the kernels read the real lengths from the device tensors at replay.
        layout = replace(padded.layout, kv_lens=(self.max_pages * self.page_size,) * bucket)
        self.block_table.update(padded.page_tables)
        packed = host_to_device(padded.values, torch.int64, runner.device)
        table = self.block_table.table[:bucket]

        num_rows = bucket * q_len

        def step() -> torch.Tensor:
            batch, extra = unpack_forward_batch(ForwardMode.DECODE, packed, layout, table)
            if self.scratch_state_slot is not None:  # every row's state slot, from the packed buffer
                batch = replace(batch, state_slots=extra[num_rows:], snapshot_state=snapshot)
            return runner.forward_target(batch, extra[:num_rows], runner.cache, write_draft)

        stream = torch.cuda.Stream(runner.device)
        stream.wait_stream(torch.cuda.current_stream(runner.device))
        with torch.cuda.stream(stream), torch.inference_mode():
            step()  # warm-up: triton autotuning and lazy initialisation happen outside the capture
        torch.cuda.current_stream(runner.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self.pool):
            logits = step()
        if self.pool is None:
            self.pool = graph.pool()
        return CapturedStep(graph, packed, layout, logits, step)

    def run_target(self, plan: TargetPlan) -> torch.Tensor | None:
        """Replays the graph fitting `plan` -> logits [len(plan.logit_rows), vocab], or None (run eagerly)."""
        q_len = uniform_query_len(plan)
        bucket = bucket_for(len(plan.q_lens), self.buckets) if q_len is not None else None
        captured = self.steps.get((bucket, q_len)) if bucket is not None else None
        # A graph that writes the draft context also serves a plan that skips it (the entries land in the
        # plan's own pages and nothing reads them); one that does not write it cannot serve a plan needing them.
        if captured is None or (plan.write_draft_context and not self.write_draft) or \
                any(len(p) > self.max_pages for p in plan.page_tables):
            return None
        # State: a graph keeps per-position snapshots exactly when the plan asks for them; a slot reset runs eagerly.
        if (plan.state_slots is not None) != (self.scratch_state_slot is not None) \
                or plan.snapshot_state != self._snapshots(q_len) or plan.reset_slots:
            return None
        padded = pad_step(plan, bucket, self.scratch_page, self.page_size, self.max_pages, self.scratch_state_slot)
        self.block_table.update(padded.page_tables)  # only the entries that changed
        copy_host_values(captured.packed, padded.values)  # one host-to-device copy
        captured.graph.replay()
        return captured.logits[: len(plan.logit_rows)]

    def run_draft(self, plan: DraftPlan) -> torch.Tensor | None:
        return None  # the draft runs eagerly (see the module docstring)

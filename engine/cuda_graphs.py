"""Decode and verify steps captured as CUDA (HIP) graphs, one per (batch-size bucket, query length).

At start-up every graph is captured over a static packed input buffer (one int64 tensor holding
input ids, positions and all attention metadata, see forward_batch.pack_step_inputs); a step copies
its padded inputs into that buffer with one host-to-device copy and replays the graph. Steps that do
not fit (prefill, mixed query lengths, more sequences than the largest bucket, another engine's
pools) run eagerly, as does everything when the attention backend cannot be captured (it reads
host-side lengths) or `--no-graphs` is given. The draft's proposal runs eagerly (its context length
changes every step). The bucket and padding logic is engine/graph_buckets.py."""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, NamedTuple

import torch

from engine.devices import host_to_device
from engine.forward_batch import ForwardMode, StepLayout, unpack_forward_batch
from engine.graph_buckets import bucket_for, graph_buckets, pad_target_plan, uniform_query_len
from engine.step_plan import DraftPlan, TargetPlan, pack_target_plan

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class CapturedStep(NamedTuple):
    graph: torch.cuda.CUDAGraph
    packed: torch.Tensor  # the static input buffer the graph reads
    layout: StepLayout
    logits: torch.Tensor  # the static output the graph writes: [bucket * q_len, vocab]


def _dummy_plan(bucket: int, q_len: int, scratch_page: int, page_size: int, write_draft: bool) -> TargetPlan:
    """A plan of `bucket` dummy sequences (all padding) with the shapes every replay will have."""
    empty = TargetPlan(ForwardMode.DECODE, [0] * q_len, list(range(q_len)), [q_len], [q_len],
                       [[scratch_page] * -(-q_len // page_size)], list(range(q_len)), None, write_draft)
    return pad_target_plan(empty, bucket, scratch_page, page_size)


class CudaGraphRunner:
    """Captured target steps of one ModelRunner; run_target returns None when a plan must run eagerly."""

    def __init__(self, runner: ModelRunner, max_batch: int, query_lens: tuple[int, ...], max_pages: int) -> None:
        self.runner = runner
        self.buckets = graph_buckets(max_batch)
        self.query_lens = tuple(sorted(set(query_lens)))
        self.max_pages = max_pages
        self.scratch_page = runner.config.num_pages - 1
        self.steps: dict[tuple[int, int], CapturedStep] = {}
        self.pool = None
        self.write_draft = False

    def capture(self, write_draft: bool) -> None:
        """Captures every (bucket, query length), largest first so smaller graphs reuse its memory pool.
        A bucket whose capture fails (an op that syncs with the host) is logged and left eager."""
        self.write_draft = write_draft
        free_before = torch.cuda.mem_get_info(self.runner.device)[0]
        started = time.perf_counter()
        failed = []
        for q_len in self.query_lens:
            for bucket in sorted(self.buckets, reverse=True):
                try:
                    self.steps[(bucket, q_len)] = self._capture_one(bucket, q_len, write_draft)
                except RuntimeError as error:
                    failed.append((bucket, q_len))
                    logger.warning("graph capture of batch %d x %d tokens failed (%s); it runs eagerly",
                                   bucket, q_len, str(error).splitlines()[0])
        torch.cuda.synchronize(self.runner.device)
        used = free_before - torch.cuda.mem_get_info(self.runner.device)[0]
        logger.info("captured %d CUDA graphs (buckets %s, query lengths %s) in %.2f s using %.1f MiB; %d failed",
                    len(self.steps), list(self.buckets), list(self.query_lens), time.perf_counter() - started,
                    used / 2**20, len(failed))

    def _capture_one(self, bucket: int, q_len: int, write_draft: bool) -> CapturedStep:
        runner = self.runner
        plan = _dummy_plan(bucket, q_len, self.scratch_page, runner.config.page_size, write_draft)
        values, layout = pack_target_plan(plan, runner.config.page_size, self.max_pages)
        # The captured metadata claims the longest possible contexts so kernels size their split-K for them;
        # the kernels read the real lengths from the device tensors at replay.
        layout = replace(layout, kv_lens=(self.max_pages * runner.config.page_size,) * bucket)
        packed = host_to_device(values, torch.int64, runner.device)

        def step() -> torch.Tensor:
            batch, rows = unpack_forward_batch(ForwardMode.DECODE, packed, layout)
            return runner.forward_target(batch, rows, runner.cache, write_draft)

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
        return CapturedStep(graph, packed, layout, logits)

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
        padded = pad_target_plan(plan, bucket, self.scratch_page, self.runner.config.page_size)
        values, _ = pack_target_plan(padded, self.runner.config.page_size, self.max_pages)
        captured.packed.copy_(torch.tensor(values, dtype=torch.int64).pin_memory(), non_blocking=True)  # one H2D copy
        captured.graph.replay()
        return captured.logits[: len(plan.logit_rows)]

    def run_draft(self, plan: DraftPlan) -> torch.Tensor | None:
        return None  # the draft runs eagerly (see the module docstring)


"""The engine: continuous batching, chunked prefill, speculative decoding, over a TP group of ranks."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import itertools
import logging
import threading
from typing import NamedTuple

import torch

from engine.spec import spec_decode
from engine.models.registry import load_config
from engine.model_configs.base import length_of
from engine.runtime.forward_batch import ForwardMode
from engine.cache.kv_cache import PageAllocator, PageTable
from engine.sampling.grammar import new_matcher
from engine.sampling.grammar_compiler import GrammarCompiler, compiler_for
from engine.sampling.logits_processing import first_token_scores, grammar_masks, step_scores
from engine.sampling.prompt_logprobs import logit_spans, prompt_token_logprobs
from engine.runtime.model_runner import DTYPES, RunnerConfig, cache_shape_for
from engine.runtime.prefill_jobs import run_prefill_jobs
from engine.cache.kv_events import KVEventLog
from engine.runtime.reserved_prompts import NO_HIT, ReservedHit, add_local, map_hit
from engine.cache.prefix_cache import PrefixCache, PrefixHit
from engine.cache.prefix_reuse import PrefixReuse
from engine.engine_config import EngineConfig
from engine.runtime.outputs import PrefillJob, PrefillResult, PrefixCacheStats, StepOutput
from engine.runtime.devices import host_to_device
from engine.runtime.host_fetch import fetch_to_host
from engine.sampling.ops import exponential_noise, make_generator
from engine.sampling_params import SamplingParams, speculates
from engine.runtime.scheduler import PrefillChunk, Scheduler, SchedulerConfig
from engine.runtime.sequence import KVDestination, Sequence, SeqStatus, TokenLogprob
from engine.spec.spec_policy import SpecBackoff, record_verify, should_speculate
from engine.spec.spec_verify import AcceptanceStats, VerifyResult
from engine.cache.state_pool import split_memory_budget
from engine.runtime.step_plan import (CommitStatePlan, DecodeItem, ExportPlan, PrefillItem, ReadStatePlan, TargetPlan, decode_plan,
                              mixed_plan, prefill_plan, with_state_slots)
from engine.runtime.step_results import sample_on_device, sample_tokens, token_logprobs
from engine.runtime.tp_launcher import TPLeader, default_threads

logger = logging.getLogger(__name__)


class Verified(NamedTuple):
    """A verify step's outcome, fetched to the host.

    logits: [rows, vocab] the target's logits of every fed token; sequence i owns rows offsets[i]:offsets[i+1].
    sampled: index of each sequence without drafts -> its sampled token.
    results: index of each sequence with drafts -> what verification keeps.
    snapshot_state: the forward kept per-position KDA state for a commit."""

    logits: torch.Tensor
    offsets: list[int]
    sampled: dict[int, int]
    results: dict[int, VerifyResult]
    snapshot_state: bool


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = load_config(config.model_dir)
        self.model_config.validate_tp(config.tp_size)
        draft_dir = config.resolved_draft_dir
        self.draft_config = None
        if draft_dir:
            from engine.models.draft_registry import read_any_draft_config

            self.draft_config = read_any_draft_config(draft_dir)
        dtype = DTYPES[config.torch_dtype_name]
        probe = cache_shape_for(self.model_config, self.draft_config, 1, config.page_size, dtype)
        state_probe = self.model_config.state_shape(config.tp_size, 1, dtype)
        slot_bytes = state_probe.slot_stride if state_probe is not None else 0
        use_graphs = config.use_graphs and config.resolved_device == "cuda"
        # With a draft, a verify step keeps the KDA state after each of its <= spec_block_size positions for every
        # running sequence: that scratch is part of the budget too.
        # Prefix cache on a model with KDA layers: checkpoint_memory_fraction of the budget holds state checkpoints.
        checkpoint_bytes = int(config.kv_memory_bytes * config.checkpoint_memory_fraction) \
            if config.prefix_cache and slot_bytes else 0
        num_checkpoints = checkpoint_bytes // slot_bytes if slot_bytes else 0
        split = split_memory_budget(config.kv_memory_bytes - num_checkpoints * slot_bytes, probe.bytes_per_page, slot_bytes, config.max_running,
                                    snapshot_steps=config.spec_block_size if draft_dir else 0,
                                    state_fraction=config.state_memory_fraction)
        num_pages, num_slots = split.num_pages, split.num_slots
        num_pages = max(2 if use_graphs else 1, num_pages)
        runner_config = RunnerConfig(
            model_dir=config.model_dir,
            draft_dir=draft_dir,
            dtype=config.torch_dtype_name,
            draft_dtype=config.draft_dtype_name if draft_dir else "",
            attention_backend=config.attention_backend,
            page_size=config.page_size,
            num_pages=num_pages,
            kv_pool=config.kv_pool,
            page_pools=config.page_pools,
            num_threads=config.num_threads or (default_threads(config.tp_size) if config.tp_size > 1 else None),
            device=config.resolved_device,
            gpus=config.rank_gpus,
            use_graphs=use_graphs,
            graph_max_batch=config.max_running,
            graph_query_lens=(1, min(config.spec_block_size, self.draft_config.verify_block_size)) if draft_dir else (1,),
            share_weights=config.share_weights,
            num_state_slots=num_slots,
            num_checkpoint_slots=num_checkpoints,
            snapshot_rows=split.snapshot_rows,
            snapshot_steps=split.snapshot_steps,
        )
        self.leader = TPLeader(runner_config, config.tp_size)
        self.runner = self.leader.runner
        self.device = self.runner.device
        self.cache_shape = self.runner.cache_shape
        self.state_pool = self.runner.cache.state  # the leader's pool also keeps the slot free list
        # With graphs, the last page is the scratch page padded graph rows write into (never allocated).
        # Pages and state slots share one lock (pool_lock): reservations may come from another thread.
        self.allocator = PageAllocator(num_pages - 1 if use_graphs else num_pages,
                                       lock=self.state_pool.lock if self.state_pool is not None else None)
        self.prefix_cache: PrefixCache | None = None
        self._reuse: PrefixReuse | None = None
        if config.prefix_cache:
            salt = f"{config.model_dir}|{config.torch_dtype_name}|{draft_dir}|{config.draft_dtype_name}|{config.page_size}"
            self.prefix_cache = PrefixCache(self.allocator, config.page_size, salt, num_checkpoints,
                                            needs_checkpoints=self.state_pool is not None,
                                            checkpoint_interval=config.state_checkpoint_interval)
            self._reuse = PrefixReuse(self.prefix_cache, self.leader.execute, config.page_size,
                                      self.state_pool is not None)
        self.scheduler = Scheduler(SchedulerConfig(config.max_running, config.max_batched_tokens,
                                                   config.prefill_tokens_while_decoding, config.mixed_steps),
                                   self.allocator,
                                   self.state_pool, self.prefix_cache)
        self.acceptance_stats = AcceptanceStats()
        self.spec_backoff = SpecBackoff(config.spec_min_tokens_per_step)
        self._markov = getattr(self.runner.draft, "markov_head", None)  # DSpark: Markov head used when proposing
        self.num_preemptions = 0  # running sequences preempted for lack of pages, since start
        self._seqs: dict[str, Sequence] = {}
        self._order = itertools.count()
        self.eos_ids = set(self.model_config.eos_token_id)
        logger.info("engine ready on %s (%s): %d pages (%d B), %d state slots (%d B), %d checkpoint slots (%d B), "
                    "verify scratch %d x %d (%d B), prefix cache %s, draft=%s, tp=%d", self.device,
                    config.torch_dtype_name, num_pages, num_pages * probe.bytes_per_page, num_slots,
                    num_slots * slot_bytes, num_checkpoints, num_checkpoints * slot_bytes, split.snapshot_rows,
                    split.snapshot_steps, split.snapshot_rows * split.snapshot_steps * slot_bytes,
                    "on" if config.prefix_cache else "off",
                    f"{config.draft_dtype_name}" if draft_dir else "none", config.tp_size)

    # --- properties the services read -------------------------------------------------------------
    @property
    def pool_names(self) -> tuple[str, ...]:
        return self.leader.pool_names

    @property
    def has_draft(self) -> bool:
        return self.draft_config is not None

    @property
    def num_free_pages(self) -> int:
        return self.allocator.num_free

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """A snapshot of the prefix cache's counters (all zero with prefix_cache off)."""
        return self.prefix_cache.snapshot() if self.prefix_cache is not None else PrefixCacheStats()

    @property
    def kv_events(self) -> KVEventLog | None:
        """What enters and leaves the prefix cache (engine/cache/kv_events.py); None with the prefix cache off."""
        return self.prefix_cache.events if self.prefix_cache is not None else None

    @functools.cached_property
    def _grammar_thread(self) -> concurrent.futures.ThreadPoolExecutor:
        """One helper thread: a decode step's grammar masks, computed while its forward runs."""
        return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")

    @functools.cached_property
    def grammars(self) -> GrammarCompiler:
        """Structured outputs' grammar compiler for this model's tokenizer (built on first use)."""
        return compiler_for(self.config.model_dir, self.model_config.vocab_size, tuple(sorted(self.eos_ids)))

    num_running = length_of("scheduler.running")
    num_waiting = length_of("scheduler.waiting")

    def has_work(self) -> bool:
        return bool(self._seqs)  # running, waiting, or finished with output not yet collected

    # --- validation -------------------------------------------------------------------------------
    def validate_prompt(self, prompt_ids: list[int], params: SamplingParams | None = None) -> None:
        """ValueError naming what is wrong with a prompt (and its generation length)."""
        if len(prompt_ids) == 0:
            raise ValueError("prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]!r} is out of the vocabulary [0, {vocab})")
        limit = self.model_config.max_position_embeddings
        total = len(prompt_ids) + (params.max_new_tokens if params else 0)
        if len(prompt_ids) > limit or total > limit:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens + max_new_tokens exceeds max_position_embeddings {limit}"
            )
        if params is not None:
            pages = -(-(total + self.config.spec_block_size) // self.config.page_size)
            if pages > self.allocator.num_pages:
                raise ValueError(f"request needs {pages} KV pages, the pool has {self.allocator.num_pages}")
            bad_bias = [token for token, _ in params.logit_bias if token >= vocab]
            if bad_bias:
                raise ValueError(f"logit_bias token id {bad_bias[0]} is out of the vocabulary [0, {vocab})")
            if params.block_size is not None and params.block_size > self.config.spec_block_size:
                raise ValueError(
                    f"block_size {params.block_size} exceeds the server maximum {self.config.spec_block_size}"
                )

    def _spec_block_size(self, params: SamplingParams) -> int:
        if not self.has_draft or params.speculative is False:
            return 0
        return params.block_size or min(self.config.spec_block_size, self.draft_config.verify_block_size)

    def new_sequence(self, request_id: str, prompt_ids: list[int], params: SamplingParams, pages=None) -> Sequence:
        """A registered sequence (not scheduled yet) for a request id not in use (ValueError)."""
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already running")
        generator = make_generator(params.seed, self.device)
        grammar = new_matcher(self.grammars, *params.structured_output) if params.structured_output else None
        seq = Sequence(
            request_id=request_id,
            prompt_len=len(prompt_ids),
            token_ids=list(prompt_ids),
            params=params,
            page_table=PageTable(self.allocator, self.config.page_size, pages),
            spec_block_size=self._spec_block_size(params),
            generator=generator,
            arrival_order=next(self._order),
            grammar=grammar,
        )
        self._seqs[request_id] = seq
        return seq

    # --- request entry points ---------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Full path in this engine: chunked prefill, then decoding."""
        self.validate_prompt(prompt_ids, params)
        if params.prompt_logprobs is not None:  # scored by the prefill entry point (prefill()); offline: LLM.logits
            raise ValueError("prompt_logprobs are returned by the prefill service (LLMEngine.prefill); "
                             "offline, score a prompt with LLM.logits")
        self.scheduler.add(self.new_sequence(request_id, prompt_ids, params))

    def allocate_pages(self, num_tokens: int) -> list[int]:
        return self.allocator.allocate(-(-num_tokens // self.config.page_size))

    def free_pages(self, page_ids: list[int]) -> None:
        self.allocator.free(page_ids)

    @property
    def num_free_state_slots(self) -> int:
        return self.state_pool.num_free if self.state_pool is not None else 0

    @property
    def num_state_slots(self) -> int:
        return self.state_pool.num_slots if self.state_pool is not None else 0

    @property
    def pool_lock(self) -> threading.RLock:
        """Guards the page allocator and the state pool. Safe to take from any thread: the engine thread
        holds it only while it schedules (never across a forward), so a reservation made under it waits
        at most for a scheduling decision, not for a step."""
        return self.allocator.lock

    def allocate_reservation(self, num_tokens: int) -> tuple[list[int], int | None]:
        """Pages for num_tokens and, for a model with linear attention, a state slot (zeroed): what a
        prefill handoff writes into. Raises OutOfPages / OutOfStateSlots, holding nothing. Thread-safe."""
        with self.pool_lock:
            slot = self.state_pool.alloc() if self.state_pool is not None else None
            try:
                return self.allocate_pages(num_tokens), slot
            except BaseException:
                if slot is not None:
                    self.state_pool.free(slot)
                raise

    def free_reservation(self, page_ids: list[int], state_slot: int | None) -> None:
        """Gives back what allocate_reservation handed out. Thread-safe."""
        with self.pool_lock:
            self.free_pages(page_ids)
            if state_slot is not None:
                self.state_pool.free(state_slot)

    # --- a decode worker's prefix-cache hit at Reserve (engine/runtime/reserved_prompts.py) -------------
    def match_prompt(self, prompt_ids: list[int]) -> PrefixHit:
        """The cached leading full pages of a prompt about to be reserved (all but its last token at most; with a
        draft, pages that hold its context too), one reference taken on each, and for KDA models the pinned
        checkpoint among them (PrefixCache.match, past_checkpoint). Empty without a prefix cache. Thread-safe."""
        if self.prefix_cache is None or len(prompt_ids) < 2:
            return PrefixHit([], [], None)
        return self.prefix_cache.match(prompt_ids, len(prompt_ids) - 1, self.has_draft, len(prompt_ids),
                                       past_checkpoint=True)

    def unpin_checkpoint(self, checkpoint: int) -> None:
        """Gives back the pin a hit took on a checkpoint slot. Thread-safe."""
        if self.prefix_cache is not None:
            self.prefix_cache.unpin(checkpoint)

    def add_local_prefill(self, request_id: str, prompt_ids: list[int], page_ids: list[int], params: SamplingParams,
                          state_slot: int | None = None, hit: ReservedHit = NO_HIT) -> None:
        """A reserved request prefilled here (a decode worker with no prefill hop): see reserved_prompts.add_local."""
        add_local(self, request_id, prompt_ids, page_ids, params, state_slot, hit)

    def read_state(self, slot: int) -> torch.Tensor:
        """Every rank's copy of a state slot, on the host: uint8 [tp_size, slot bytes] (StatePool.raw rows)."""
        if self.state_pool is None:
            raise ValueError("this model has no linear-attention state")
        return self.leader.execute(ReadStatePlan(slot)).cpu()

    def add_prefilled(
        self, request_id: str, prompt_ids: list[int], first_token: int, page_ids: list[int], params: SamplingParams,
        state_slot: int | None = None, hit: ReservedHit = NO_HIT,
    ) -> None:
        """A request whose prompt KV (and draft context, and for linear attention the KDA state in
        state_slot, allocated by allocate_reservation) another worker wrote - all but its first hit.cached_pages
        pages, this engine's own cached ones (match_prompt), which the sequence maps as such. On success the
        sequence owns the pages and the slot (and hit's checkpoint pin is given back); on a ValueError the caller
        still does."""
        self.validate_prompt(prompt_ids, params)
        if len(page_ids) * self.config.page_size < len(prompt_ids):
            raise ValueError(f"{len(page_ids)} pages cannot hold a prompt of {len(prompt_ids)} tokens")
        if (self.state_pool is not None) != (state_slot is not None):
            raise ValueError("a prefilled request of a model with linear attention needs its state slot "
                             "(and one without, none)")
        seq = self.new_sequence(request_id, prompt_ids, params, pages=page_ids)
        map_hit(self, seq, hit.cached_pages)
        seq.state_slot = state_slot
        seq.num_cached = len(prompt_ids)
        seq.looked_up = True  # its prompt came from elsewhere: a recompute after preemption is not a first lookup
        if self._reuse is not None:
            self._reuse.prefilled(seq)
        if hit.checkpoint is not None:  # the state came whole from prefill: the checkpoint is not needed
            self.unpin_checkpoint(hit.checkpoint)
        if seq.generator is not None and not params.greedy:
            # The prefill worker drew the first token from the same seed: skip those draws so the
            # rest of the request samples exactly as it would in one engine.
            exponential_noise((1, self.model_config.vocab_size), self.device, [seq.generator])
        self._append_tokens(seq, [first_token], [])
        if seq.status != SeqStatus.FINISHED:
            self.scheduler.add_running(seq)

    def abort(self, request_id: str) -> bool:
        seq = self._seqs.get(request_id)
        if seq is None or seq.status == SeqStatus.FINISHED:
            return False
        self.scheduler.remove(seq)
        self._finish(seq, "abort")
        return True

    # --- the step ---------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        scheduled = self.scheduler.schedule()
        preempted = list(scheduled.preempted)
        if scheduled.is_empty and scheduled.preempted:
            scheduled = self.scheduler.schedule()  # preemption freed pages: plan again
            preempted += scheduled.preempted
        self.num_preemptions += len(preempted)
        for seq in preempted:
            logger.info("preempted %s (out of KV pages); it will be recomputed", seq.request_id)
        if scheduled.prefill and scheduled.decode:
            self._run_mixed(scheduled.prefill, list(scheduled.decode))
        elif scheduled.prefill:
            self._run_prefill(scheduled.prefill)
        elif scheduled.decode:
            self._run_decode(list(scheduled.decode))
        elif self.scheduler.waiting and not self.scheduler.running:
            seq = self.scheduler.waiting[0]
            self.scheduler.remove(seq)
            logger.warning("request %s cannot fit in the KV pool; aborting it", seq.request_id)
            self._finish(seq, "abort")
        return self._collect()

    def _collect(self) -> list[StepOutput]:
        outputs = []
        for seq in list(self._seqs.values()):
            finished = seq.status == SeqStatus.FINISHED
            if seq.new_tokens or finished:
                outputs.append(
                    StepOutput(
                        request_id=seq.request_id,
                        new_token_ids=seq.new_tokens,
                        finished=finished,
                        finish_reason=seq.finish_reason,
                        logprobs=seq.new_logprobs,
                        num_prompt_tokens=seq.prompt_len,
                        num_generated=seq.num_generated,
                        num_cached_tokens=seq.num_cached_tokens,
                        prompt_logprobs=tuple(seq.prompt_logprobs) if seq.new_tokens else (),
                    )
                )
                if seq.new_tokens:
                    seq.prompt_logprobs = []  # sent with the first token
                seq.new_tokens, seq.new_logprobs = [], []
            if finished:
                del self._seqs[seq.request_id]
        return outputs

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        if self._reuse is not None:
            self._reuse.before_release(seq)
        self.scheduler.drop_cache(seq)

    def _append_tokens(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob]) -> int:
        """Appends generated tokens up to a stop condition; returns how many were kept."""
        params = seq.params
        kept = 0
        for index, token in enumerate(tokens):
            seq.token_ids.append(token)
            seq.new_tokens.append(token)
            if index < len(logprobs):
                seq.new_logprobs.append(logprobs[index])
            kept += 1
            if seq.grammar is not None:
                seq.grammar.consume(token)
            if ((not params.ignore_eos and token in self.eos_ids) or token in params.stop_token_ids
                    or (seq.grammar is not None and seq.grammar.is_stopped)):  # (a complete grammar stops too)
                self.scheduler.remove(seq)
                self._finish(seq, "stop")
                break
            if seq.num_generated >= params.max_new_tokens:
                self.scheduler.remove(seq)
                self._finish(seq, "length")
                break
        return kept

    @staticmethod
    def _logprobs_of(seq: Sequence, logits: torch.Tensor, tokens: list[int]) -> list[TokenLogprob]:
        """The logprobs a sequence asked for (none unless params.logprobs) of tokens, from their logits rows."""
        return token_logprobs(logits, tokens, seq.params.logprobs) if seq.params.logprobs else []

    # --- prefill ----------------------------------------------------------------------------------
    @staticmethod
    def _prefill_items(chunks: tuple[PrefillChunk, ...]) -> list[PrefillItem]:
        return [PrefillItem(c.seq.token_ids, c.seq.num_cached, c.num_tokens, c.seq.page_table.pages,
                            c.seq.remaining_prefill == c.num_tokens and c.seq.num_generated == 0,
                            all_logits=c.seq.params.prompt_logprobs is not None) for c in chunks]

    def _run_prefill(self, chunks: tuple[PrefillChunk, ...]) -> None:
        items = self._prefill_items(chunks)
        plan = prefill_plan(items, write_draft_context=speculates([c.seq.params for c in chunks], self.has_draft),
                            keys=[c.seq.request_id for c in chunks])
        if self._reuse is not None:
            self._reuse.restore([c.seq for c in chunks])
        self._after_prefill(chunks, items, self.leader.execute(self._with_state(plan, [c.seq for c in chunks])))

    def _run_mixed(self, chunks: tuple[PrefillChunk, ...], seqs: list[Sequence]) -> None:
        """One forward for a decode step over `seqs` (no drafts) and prefill chunks (Scheduler mixed_steps): the
        decode step's tokens are committed first, then the chunks advance as a prefill step's would."""
        items = self._prefill_items(chunks)
        everyone = seqs + [c.seq for c in chunks]
        plan = mixed_plan([DecodeItem([seq.last_token], seq.num_cached, seq.page_table.pages) for seq in seqs], items,
                          write_draft_context=speculates([seq.params for seq in everyone], self.has_draft),
                          keys=[seq.request_id for seq in everyone])
        if self._reuse is not None:
            self._reuse.restore([c.seq for c in chunks])
        logits = self.leader.execute(self._with_state(plan, everyone))
        decoded = len(seqs)
        self._commit(seqs, {}, self._sample_step(seqs, {}, logits[:decoded], plan))
        self._after_prefill(chunks, items, logits[decoded:])

    def _after_prefill(self, chunks: tuple[PrefillChunk, ...], items: list[PrefillItem], logits: torch.Tensor) -> None:
        """A prefill forward's logits (its plan's logit_rows) -> first tokens, prompt logprobs, promotions."""
        if any(item.all_logits for item in items):  # prompt scoring: every row of those chunks came back
            spans = logit_spans(items)
            for chunk, item, (row, count) in zip(chunks, items, spans):
                if item.all_logits:
                    seq = chunk.seq
                    del seq.prompt_logprobs[seq.num_cached:]  # entry i scores prompt token i + 1 (a recompute redoes them)
                    seq.prompt_logprobs.extend(prompt_token_logprobs(
                        logits[row : row + count], seq.token_ids[: seq.prompt_len], seq.num_cached,
                        seq.params.prompt_logprobs))
            last_rows = [row + count - 1 for (row, count), item in zip(spans, items) if item.needs_logits]
            logits = logits.index_select(0, host_to_device(last_rows, torch.int64, logits.device))
        sampled = [c.seq for c, item in zip(chunks, items) if item.needs_logits]
        scores = first_token_scores([s.params for s in sampled], [s.token_ids for s in sampled], logits, self.eos_ids,
                                    [s.grammar for s in sampled])
        tokens = sample_tokens([s.params for s in sampled], [s.generator for s in sampled], scores) if sampled else []
        for chunk in chunks:
            chunk.seq.num_cached += chunk.num_tokens
        if self._reuse is not None:
            self._reuse.after_prefill([c.seq for c in chunks])
        for chunk in chunks:
            if chunk.seq.export_to is not None and chunk.seq.remaining_prefill == 0:
                self._export(chunk.seq)
        row = 0
        for chunk, item in zip(chunks, items):
            seq = chunk.seq
            if seq.remaining_prefill == 0:
                self.scheduler.promote(seq)
                if item.needs_logits:
                    self._append_tokens(seq, [tokens[row]], self._logprobs_of(seq, logits[row : row + 1], [tokens[row]]))
                    row += 1
                if seq.export_to is not None and seq.status != SeqStatus.FINISHED:
                    self.scheduler.remove(seq)
                    self._finish(seq, "prefill")

    def _with_state(self, plan: TargetPlan, seqs: list[Sequence]) -> TargetPlan:
        """Adds each sequence's state slot; slots of sequences starting at token 0 are zeroed first."""
        if self.state_pool is None:
            return plan
        return with_state_slots(plan, [seq.state_slot for seq in seqs],
                                tuple(seq.state_slot for seq in seqs if seq.num_cached == 0))

    # --- decode + speculative decoding: propose, verify, commit -----------------------------------
    def _run_decode(self, seqs: list[Sequence]) -> None:
        drafts = self._propose(seqs)
        self._commit(seqs, drafts, self._verify(seqs, drafts))

    def _propose(self, seqs: list[Sequence]) -> spec_decode.Proposals:
        """Draft tokens for every speculating sequence: one draft forward per block size."""
        drafts: spec_decode.Proposals = {}
        by_block: dict[int, list[Sequence]] = {}
        for seq in seqs:
            if seq.spec_block_size >= 2 and should_speculate(self.spec_backoff, seq.spec_state):
                by_block.setdefault(seq.spec_block_size, []).append(seq)
        for block, group in by_block.items():
            drafts.update(spec_decode.propose(self.leader.execute, block, group, self._markov))
        return drafts

    def _verify(self, seqs: list[Sequence], drafts: spec_decode.Proposals) -> Verified:
        """One target forward over every sequence's [last token + drafts]: samples the plain sequences,
        verifies the drafted ones, and fetches both in the step's one device-to-host copy."""
        items = [DecodeItem([seq.last_token] + drafts.get(seq.request_id, ([], None))[0], seq.num_cached,
                            seq.page_table.pages) for seq in seqs]
        plan = decode_plan(items, write_draft_context=speculates([seq.params for seq in seqs], self.has_draft),
                           snapshot_state=bool(drafts) and self.state_pool is not None,
                           keys=[seq.request_id for seq in seqs])
        return self._sample_step(seqs, drafts, None, plan)

    def _sample_step(self, seqs: list[Sequence], drafts: spec_decode.Proposals, logits: torch.Tensor | None,
                     plan: TargetPlan) -> Verified:
        """Samples the plain sequences and verifies the drafted ones from a forward's logits over every sequence's
        fed tokens (logits None: runs `plan` for them, its grammar masks computed while it runs)."""
        offsets = list(itertools.accumulate([0] + [len(drafts.get(seq.request_id, ([], None))[0]) + 1 for seq in seqs]))
        tokens = {rid: proposal[0] for rid, proposal in drafts.items()}
        # structured outputs: the step's grammar masks are computed on a helper thread while the forward runs
        masks = self._grammar_thread.submit(grammar_masks, seqs, tokens, offsets) \
            if any(seq.grammar is not None for seq in seqs) else None
        if logits is None:
            logits = self.leader.execute(self._with_state(plan, seqs))
        plain = [i for i, seq in enumerate(seqs) if seq.request_id not in drafts]
        # what sampling and verification see: each row's penalties / bias / grammar (raw logits stay for the logprobs)
        scores = step_scores(seqs, tokens, logits, offsets, self.eos_ids, masks.result() if masks is not None else {})
        pieces = []
        if plain:
            rows = [offsets[i] for i in plain]
            plain_scores = scores if rows == list(range(scores.shape[0])) else \
                scores.index_select(0, host_to_device(rows, torch.int64, scores.device))  # no blocking upload
            pieces.append(sample_on_device([seqs[i].params for i in plain], [seqs[i].generator for i in plain],
                                           plain_scores))
        order, verdict = spec_decode.verify_on_device(seqs, drafts, scores, offsets)
        if verdict is not None:
            pieces.append(verdict)
        host = fetch_to_host(torch.cat(pieces) if len(pieces) > 1 else pieces[0])  # the step's one device-to-host copy
        return Verified(logits, offsets, dict(zip(plain, host[: len(plain)])),
                        spec_decode.verdicts(seqs, drafts, order, host[len(plain) :]), plan.snapshot_state)

    def _commit(self, seqs: list[Sequence], drafts: spec_decode.Proposals, verified: Verified) -> None:
        """Keeps what verification accepted: KDA state after the last kept position, the tokens (up to a
        stop), acceptance statistics; pages past the kept context go back."""
        logits, offsets, results = verified.logits, verified.offsets, verified.results
        starts = [seq.num_cached for seq in seqs]
        for i, token in verified.sampled.items():
            seq = seqs[i]
            seq.num_cached += 1
            self._append_tokens(seq, [token], self._logprobs_of(seq, logits[offsets[i] : offsets[i] + 1], [token]))
        if verified.snapshot_state:  # keep the KDA state after the last kept position (K3_SPEC 5.1)
            steps = [results[i].num_accepted_drafts if i in results else 0 for i in range(len(seqs))]
            self.leader.execute(CommitStatePlan([seq.state_slot for seq in seqs], steps))
        for i in sorted(results):
            seq, result = seqs[i], results[i]
            self.acceptance_stats.record(result, len(drafts[seq.request_id][0]))
            record_verify(self.spec_backoff, seq.spec_state, len(result.tokens))
            accepted = result.tokens
            lps = self._logprobs_of(seq, logits[offsets[i] : offsets[i] + len(accepted)], accepted)
            seq.num_cached += len(accepted)
            self._append_tokens(seq, accepted, lps)
            if seq.status != SeqStatus.FINISHED:
                seq.page_table.truncate(seq.num_cached + 1)
        if self._reuse is not None:
            self._reuse.after_decode([(seq, row, start) for row, (seq, start) in enumerate(zip(seqs, starts))
                                      if seq.status == SeqStatus.RUNNING], verified.snapshot_state)

    # --- prefill service entry point ---------------------------------------------------------------
    def prefill(self, jobs: list[PrefillJob], should_stop=None, before_step=None) -> list[PrefillResult | None]:
        """Prefills prompts for another engine: each runs here as a prefill-only sequence (the prefix cache serves
        it too), its KV then copied into the pages the job names (engine/runtime/prefill_jobs.py); returns each prompt's
        first token. should_stop(request_id) -> bool is asked between steps; a prompt it stops gets None.
        before_step(): called before every engine step (core lending picks the step's cores)."""
        return run_prefill_jobs(self, jobs, should_stop, before_step)

    def check_prefill_job(self, job: PrefillJob) -> None:
        """ValueError naming what is wrong with a prefill job."""
        self.validate_prompt(job.prompt_ids)
        size = self.config.page_size
        if job.cached_tokens % size or not 0 <= job.cached_tokens < len(job.prompt_ids):
            raise ValueError(f"prefill job {job.request_id}: cached_tokens {job.cached_tokens} is not a whole number "
                             f"of pages below the prompt length {len(job.prompt_ids)}")
        if len(job.page_ids) * size + job.cached_tokens < len(job.prompt_ids):
            raise ValueError(f"{len(job.page_ids)} pages cannot hold a prompt of {len(job.prompt_ids)} tokens"
                             + (f" ({job.cached_tokens} cached)" if job.cached_tokens else ""))
        if -(-len(job.prompt_ids) // self.config.page_size) > self.allocator.num_pages:
            raise ValueError(f"a prompt of {len(job.prompt_ids)} tokens needs more pages than this engine's pool "
                             f"has ({self.allocator.num_pages})")
        if (self.state_pool is not None) != (job.state_slot is not None):
            raise ValueError(f"prefill job {job.request_id}: a model with linear attention needs a state slot "
                             "(and one without, none)")

    def add_prefill_job(self, job: PrefillJob) -> None:
        self.check_prefill_job(job)
        seq = self.new_sequence(job.request_id, job.prompt_ids, job.params)
        seq.export_to = KVDestination(tuple(job.page_ids), job.pool_names, job.state_slot, job.cached_tokens)
        self.scheduler.add(seq)

    def _export(self, seq: Sequence) -> None:
        """Copies a finished prefill-only prompt's pages (those after the ones the destination holds already) and
        its state (always whole) into its destination."""
        dest = seq.export_to
        count = -(-seq.prompt_len // self.config.page_size)
        skip = dest.cached_tokens // self.config.page_size
        self.leader.execute(ExportPlan(seq.page_table.pages[skip:count], list(dest.page_ids[: count - skip]),
                                       dest.pool_names, seq.state_slot, dest.state_slot))

    def read_pages(self, page_ids: list[int]):
        """This (leader) rank's copies of pages: (target [layers, n, page_size, D], draft or None)."""
        return self.runner.read_pages(page_ids)

    # --- offline helpers --------------------------------------------------------------------------
    def full_logits(self, token_ids: list[int]) -> torch.Tensor:
        """[len, vocab] logits of every prompt position (one EXTEND pass on temporary pages)."""
        self.validate_prompt(token_ids)
        pages = self.allocate_pages(len(token_ids))
        slot = self.state_pool.alloc() if self.state_pool is not None else None
        try:
            rows = list(range(len(token_ids)))
            plan = TargetPlan(ForwardMode.EXTEND, list(token_ids), rows, [len(token_ids)], [len(token_ids)], [pages], rows)
            if slot is not None:
                plan = dataclasses.replace(plan, state_slots=[slot], reset_slots=(slot,))
            return self.leader.execute(plan)
        finally:
            self.free_pages(pages)
            if slot is not None:
                self.state_pool.free(slot)

    def close(self) -> None:
        if "_grammar_thread" in self.__dict__:
            self._grammar_thread.shutdown(wait=False)
        leader, self.leader = getattr(self, "leader", None), None
        if leader is not None:
            leader.close()

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

"""The engine: continuous batching, chunked prefill, speculative decoding, over a TP group of ranks."""
from __future__ import annotations

import itertools
import logging
from pathlib import Path

import torch

from engine import spec_decode
from engine.config import ModelConfig
from engine.forward_batch import ForwardMode
from engine.kv_cache import PageAllocator, PageTable
from engine.model_runner import DTYPES, RunnerConfig, cache_shape_for
from engine.engine_types import DEFAULT_MODEL_DIR, EngineConfig, PrefillJob, PrefillResult, StepOutput
from engine.sampling import SamplingBatch, exponential_noise, make_generator, top_logprobs
from engine.sampling_params import SamplingParams
from engine.scheduler import PrefillChunk, Scheduler, SchedulerConfig
from engine.sequence import Sequence, SeqStatus, TokenLogprob
from engine.spec_verify import AcceptanceStats
from engine.step_plan import TargetPlan
from engine.tp_launcher import TPLeader, default_threads

logger = logging.getLogger(__name__)

class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = ModelConfig.from_pretrained(config.model_dir)
        self.model_config.validate_tp(config.tp_size)
        draft_dir = config.resolved_draft_dir
        self.draft_config = None
        if draft_dir:
            import json

            from engine.models.dflash import DFlashConfig

            self.draft_config = DFlashConfig.from_dict(json.loads(Path(draft_dir, "config.json").read_text()))
        probe = cache_shape_for(self.model_config, self.draft_config, 1, config.page_size, DTYPES[config.dtype])
        num_pages = max(1, config.kv_memory_bytes // probe.bytes_per_page)
        runner_config = RunnerConfig(
            model_dir=config.model_dir,
            draft_dir=draft_dir,
            dtype=config.dtype,
            attention_backend=config.attention_backend,
            page_size=config.page_size,
            num_pages=num_pages,
            kv_pool=config.kv_pool,
            page_pools=config.page_pools,
            num_threads=config.num_threads or (default_threads(config.tp_size) if config.tp_size > 1 else None),
            share_weights=config.share_weights,
        )
        self.leader = TPLeader(runner_config, config.tp_size)
        self.runner = self.leader.runner
        self.cache_shape = self.runner.cache_shape
        self.allocator = PageAllocator(num_pages)
        self.scheduler = Scheduler(SchedulerConfig(config.max_running, config.max_batched_tokens), self.allocator)
        self.acceptance_stats = AcceptanceStats()
        self.num_preemptions = 0  # running sequences preempted for lack of pages, since start
        self._seqs: dict[str, Sequence] = {}
        self._order = itertools.count()
        self.eos_ids = set(self.model_config.eos_token_id)
        logger.info("engine ready: %d pages, draft=%s, tp=%d", num_pages, bool(draft_dir), config.tp_size)

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
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

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
            if params.block_size is not None and params.block_size > self.config.spec_block_size:
                raise ValueError(
                    f"block_size {params.block_size} exceeds the server maximum {self.config.spec_block_size}"
                )

    def _spec_block(self, params: SamplingParams) -> int:
        if not self.has_draft or params.speculative is False:
            return 0
        return params.block_size or min(self.config.spec_block_size, self.draft_config.block_size)

    def _new_sequence(self, request_id: str, prompt_ids: list[int], params: SamplingParams, pages=None) -> Sequence:
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already running")
        generator = make_generator(params.seed)
        seq = Sequence(
            request_id=request_id,
            prompt_len=len(prompt_ids),
            token_ids=list(prompt_ids),
            params=params,
            page_table=PageTable(self.allocator, self.config.page_size, pages),
            spec_block=self._spec_block(params),
            generator=generator,
            arrival_order=next(self._order),
        )
        self._seqs[request_id] = seq
        return seq

    # --- request entry points ---------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Full path in this engine: chunked prefill, then decoding."""
        self.validate_prompt(prompt_ids, params)
        self.scheduler.add(self._new_sequence(request_id, prompt_ids, params))

    def allocate_pages(self, num_tokens: int) -> list[int]:
        return self.allocator.allocate(-(-num_tokens // self.config.page_size))

    def free_pages(self, page_ids: list[int]) -> None:
        self.allocator.free(page_ids)

    def add_prefilled(
        self, request_id: str, prompt_ids: list[int], first_token: int, page_ids: list[int], params: SamplingParams
    ) -> None:
        """A request whose prompt KV (and draft context) another worker wrote into page_ids."""
        self.validate_prompt(prompt_ids, params)
        if len(page_ids) * self.config.page_size < len(prompt_ids):
            raise ValueError(f"{len(page_ids)} pages cannot hold a prompt of {len(prompt_ids)} tokens")
        seq = self._new_sequence(request_id, prompt_ids, params, pages=page_ids)
        seq.num_cached = len(prompt_ids)
        if seq.generator is not None and not params.greedy:
            # The prefill worker drew the first token from the same seed: skip those draws so the
            # rest of the request samples exactly as it would in one engine.
            exponential_noise((1, self.model_config.vocab_size), torch.device("cpu"), [seq.generator])
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
        if scheduled.prefill:
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
                    )
                )
                seq.new_tokens, seq.new_logprobs = [], []
            if finished:
                del self._seqs[seq.request_id]
        return outputs

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.page_table.release()

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
            if (not params.ignore_eos and token in self.eos_ids) or token in params.stop_token_ids:
                self.scheduler.remove(seq)
                self._finish(seq, "stop")
                break
            if seq.num_generated >= params.max_new_tokens:
                self.scheduler.remove(seq)
                self._finish(seq, "length")
                break
        return kept

    def _logprobs(self, logits: torch.Tensor, tokens: list[int], n: int) -> list[TokenLogprob]:
        """logits: [len(tokens), vocab] rows that produced tokens."""
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        values, ids = top_logprobs(logits, max(n, 1))
        return [
            TokenLogprob(t, float(log_probs[i, t]), ids[i, :n].tolist(), values[i, :n].tolist())
            for i, t in enumerate(tokens)
        ]

    # --- prefill ----------------------------------------------------------------------------------
    def _run_prefill(self, chunks: tuple[PrefillChunk, ...]) -> None:
        plan, sample_rows, completing = self._prefill_plan(
            [(c.seq.token_ids, c.seq.num_cached, c.num_tokens, c.seq.page_table.pages, c.seq.remaining_prefill == c.num_tokens and c.seq.num_generated == 0) for c in chunks],
            pool_names=None,
        )
        logits = self.leader.execute(plan)
        sampled = [c.seq for c, needs in zip(chunks, completing) if needs]
        tokens = self._sample([s.params for s in sampled], [s.generator for s in sampled], logits) if sampled else []
        row = 0
        for chunk, needs in zip(chunks, completing):
            seq = chunk.seq
            seq.num_cached += chunk.num_tokens
            if seq.remaining_prefill == 0:
                self.scheduler.promote(seq)
                if needs:
                    lps = self._logprobs(logits[row : row + 1], [tokens[row]], seq.params.logprobs) if seq.params.logprobs else []
                    self._append_tokens(seq, [tokens[row]], lps)
                    row += 1

    def _prefill_plan(self, items, pool_names):
        """items: (token_ids, num_cached, num_tokens, pages, needs_logits) per sequence."""
        input_ids, positions, q_lens, kv_lens, tables, rows, needs = [], [], [], [], [], [], []
        for token_ids, cached, count, pages, need in items:
            input_ids.extend(token_ids[cached : cached + count])
            positions.extend(range(cached, cached + count))
            q_lens.append(count)
            kv_lens.append(cached + count)
            tables.append(list(pages))
            if need:
                rows.append(len(input_ids) - 1)
            needs.append(need)
        plan = TargetPlan(
            mode=ForwardMode.EXTEND,
            input_ids=input_ids,
            positions=positions,
            q_lens=q_lens,
            kv_lens=kv_lens,
            page_tables=tables,
            logit_rows=rows,
            pool_names=pool_names,
            write_draft_context=self.has_draft,
        )
        return plan, rows, needs

    def _sample(self, params: list[SamplingParams], generators, logits: torch.Tensor) -> list[int]:
        return SamplingBatch.from_params(params, generators).sample(logits).tolist()

    # --- decode + speculative decoding -------------------------------------------------------------
    def _run_decode(self, seqs: list[Sequence]) -> None:
        drafts: dict[str, tuple[list[int], torch.Tensor | None]] = {}
        by_block: dict[int, list[Sequence]] = {}
        for seq in seqs:
            if seq.spec_block >= 2:
                by_block.setdefault(seq.spec_block, []).append(seq)
        for block, group in by_block.items():
            drafts.update(spec_decode.propose(self.leader.execute, block, group))
        input_ids, positions, q_lens, kv_lens, tables = [], [], [], [], []
        for seq in seqs:
            proposed = drafts.get(seq.request_id, ([], None))[0]
            tokens = [seq.last_token] + proposed
            input_ids.extend(tokens)
            positions.extend(range(seq.num_cached, seq.num_cached + len(tokens)))
            q_lens.append(len(tokens))
            kv_lens.append(seq.num_cached + len(tokens))
            tables.append(list(seq.page_table.pages))
        plan = TargetPlan(
            mode=ForwardMode.DECODE,
            input_ids=input_ids,
            positions=positions,
            q_lens=q_lens,
            kv_lens=kv_lens,
            page_tables=tables,
            logit_rows=list(range(len(input_ids))),
            write_draft_context=self.has_draft,
        )
        logits = self.leader.execute(plan)
        plain = [i for i, seq in enumerate(seqs) if seq.request_id not in drafts]
        offsets = list(itertools.accumulate([0] + q_lens))
        if plain:
            rows = torch.tensor([offsets[i] for i in plain])
            plain_logits = logits.index_select(0, rows)
            tokens = self._sample([seqs[i].params for i in plain], [seqs[i].generator for i in plain], plain_logits)
            for j, i in enumerate(plain):
                seq = seqs[i]
                lps = self._logprobs(plain_logits[j : j + 1], [tokens[j]], seq.params.logprobs) if seq.params.logprobs else []
                seq.num_cached += 1
                self._append_tokens(seq, [tokens[j]], lps)
        results = spec_decode.verify(seqs, drafts, logits, offsets)
        spec = sorted(results)
        for i in spec:
            seq, result = seqs[i], results[i]
            self.acceptance_stats.record(result, len(drafts[seq.request_id][0]))
            accepted = result.tokens
            seq_logits = logits[offsets[i] : offsets[i + 1]]
            lps = self._logprobs(seq_logits[: len(accepted)], accepted, seq.params.logprobs) if seq.params.logprobs else []
            seq.num_cached += len(accepted)
            self._append_tokens(seq, accepted, lps)
            if seq.status != SeqStatus.FINISHED:
                seq.page_table.truncate(seq.num_cached + 1)

    # --- prefill service entry point ---------------------------------------------------------------
    def prefill(self, jobs: list[PrefillJob], should_stop=None) -> list[PrefillResult | None]:
        """Prefills prompts into given pages (another engine's shared pools, or this one's) in chunks and
        returns each prompt's first token; the engine keeps no state for them (engine/prefill_jobs.py).
        should_stop(request_id) -> bool is asked between chunks; a prompt it stops gets None."""
        from engine.prefill_jobs import run_prefill_jobs

        return run_prefill_jobs(self, jobs, should_stop)

    def read_pages(self, page_ids: list[int]):
        """This (leader) rank's copies of pages: (target [layers, n, page_size, D], draft or None)."""
        return self.runner.read_pages(page_ids)

    # --- offline helpers --------------------------------------------------------------------------
    def full_logits(self, token_ids: list[int]) -> torch.Tensor:
        """[len, vocab] logits of every prompt position (one EXTEND pass on temporary pages)."""
        self.validate_prompt(token_ids)
        pages = self.allocate_pages(len(token_ids))
        try:
            rows = list(range(len(token_ids)))
            plan = TargetPlan(ForwardMode.EXTEND, list(token_ids), rows, [len(token_ids)], [len(token_ids)], [pages], rows)
            return self.leader.execute(plan)
        finally:
            self.free_pages(pages)

    def close(self) -> None:
        leader, self.leader = getattr(self, "leader", None), None
        if leader is not None:
            leader.close()

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

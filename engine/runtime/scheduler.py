"""Continuous batching: which sequences run in the next step, and with how many tokens each.

Policy (documented in docs/architecture.md):
- Prefill first: while sequences wait and fewer than max_running are running, the next step is a
  prefill step over waiting sequences in arrival order, each given a chunk of its prompt within the
  max_batched_tokens budget (chunked prefill; several prompts per step).
- Otherwise a decode step over every running sequence: 1 query token each, or the speculative block
  (last token + block - 1 drafts) for sequences with speculation on.
- Pages run out during decode: the most recently arrived running sequence is preempted (its pages are
  freed, it goes back to the front of the waiting queue and is later recomputed by prefill; its
  generated tokens are kept, so outputs do not change).
- Models with linear attention: a sequence takes a state slot with its first prefill chunk, in the same
  decision as the chunk's pages (no slot free: it waits, taking no page; a sequence holds both or neither),
  and gives it back whenever its cache progress is dropped (finish, abort, preemption, reclaimed partial
  prefill); a recomputed sequence starts again from a zeroed slot.
- No recompute thrash: a sequence that lost its cache (preempted, or its partial prefill reclaimed) is
  admitted again only when the free pages hold everything it and the running sequences still need to reach
  their max_new_tokens (or nothing runs). Preemption takes the newest sequence, so once readmitted it is never
  preempted again: each sequence is recomputed at most once, and a run's steps are bounded (without this,
  a sequence could be recomputed in full after every decode step of an older one).
- Prefix cache (engine/cache/prefix_cache.py): a waiting sequence holding no pages first maps the longest cached
  run of full pages of its prompt (at least one token is always computed), restoring a KDA state checkpoint
  for models with linear attention; unreferenced cached pages count as free. KDA models: prefill chunks end
  on checkpoint positions, so the state there can be kept, and at the end of a hit's branch (the matched
  pages past its checkpoint, recomputed once and checkpointed there: a branch point).
- Prefill beside running decodes (prefill_tokens_while_decoding > 0, decode workers): while sequences decode, a
  prefill step takes at most that many tokens (the waiting tokens spread evenly over the fewest such steps: 64 + 64,
  not 96 + 32, under a bound of 96) and is followed by a decode step, so a running sequence waits at most one
  bounded prefill step between two of its tokens. With mixed_steps (the default there) the bounded
  prefill chunks instead join the decode step itself, one forward for both (ForwardMode.MIXED): a running
  sequence gets a token every step, and a step's weights are read once for its decode and prefill tokens. Not
  while a running sequence may speculate (its verify rows need the DECODE form): then steps alternate as above.
- Pages and slots may also be reserved from another thread (a decode worker's Reserve): schedule()
  holds the pool lock for its whole decision, so what it counted as free is still free when it allocates.
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

from engine.cache.kv_cache import OutOfPages, PageAllocator
from engine.cache.prefix_cache import PrefixCache
from engine.runtime.sequence import Sequence, SeqStatus
from engine.cache.state_pool import StatePool


@dataclass(frozen=True)
class SchedulerConfig:
    max_running: int = 64
    max_batched_tokens: int = 2048
    prefill_tokens_while_decoding: int = 0  # > 0: bounded prefill steps alternating with decode steps
    mixed_steps: bool = False  # with prefill_tokens_while_decoding: the bounded chunks join the decode step instead

    def __post_init__(self) -> None:
        if self.max_running <= 0:
            raise ValueError(f"max_running must be positive, got {self.max_running}")
        if self.max_batched_tokens <= 0:
            raise ValueError(f"max_batched_tokens must be positive, got {self.max_batched_tokens}")
        if self.prefill_tokens_while_decoding < 0:
            raise ValueError(f"prefill_tokens_while_decoding must be >= 0, got {self.prefill_tokens_while_decoding}")


@dataclass(frozen=True)
class PrefillChunk:
    seq: Sequence
    num_tokens: int  # tokens of this chunk, starting at seq.num_cached


@dataclass(frozen=True)
class ScheduledStep:
    prefill: tuple[PrefillChunk, ...] = ()
    decode: tuple[Sequence, ...] = ()
    preempted: tuple[Sequence, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.prefill and not self.decode


def _pages_to_finish(seq: Sequence) -> int:
    """Pages `seq` still lacks to hold max_new_tokens generated tokens and a last speculative block."""
    final = seq.prompt_len + seq.params.max_new_tokens + max(1, seq.spec_block_size)
    return seq.page_table.pages_needed(final)


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: PageAllocator, state_pool: StatePool | None = None,
                 prefix_cache: PrefixCache | None = None) -> None:
        self.config = config
        self.prefix_cache = prefix_cache
        self.allocator = allocator
        self.state_pool = state_pool
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._evicted: set[Sequence] = set()  # lost their cache to make room (preempted, reclaimed) and not done
        self._prefilled_last = False  # the previous step was a prefill step (prefill_tokens_while_decoding)

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose prompt is already in the cache (prefilled by another worker)."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        self._evicted.discard(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def schedule(self) -> ScheduledStep:
        """Under the allocator's lock: what it reads of the free pages and slots stays true while it
        allocates (another thread may reserve pages between steps, never inside this decision)."""
        with self.allocator.lock:
            if self.waiting and self.running and self._mixes():
                return self._schedule_mixed()
            decode_turn = bool(self.config.prefill_tokens_while_decoding and self.running and self._prefilled_last)
            if self.waiting and len(self.running) < self.config.max_running and not decode_turn:
                chunks = self._schedule_prefill()
                if chunks:
                    self._prefilled_last = True
                    return ScheduledStep(prefill=tuple(chunks))
            self._prefilled_last = False
            return self._schedule_decode()

    def _mixes(self) -> bool:
        return (self.config.mixed_steps and self.config.prefill_tokens_while_decoding > 0
                and all(seq.spec_block_size < 2 for seq in self.running))

    def _schedule_mixed(self) -> ScheduledStep:
        """Bounded prefill chunks (pages for the running sequences' next tokens held back) and a decode step over
        every running sequence, in one step."""
        chunks = self._take_prefill_chunks() if len(self.running) < self.config.max_running else []
        decode = self._schedule_decode()
        self._prefilled_last = False
        if not decode.decode:  # every running sequence was preempted: what is left is a plain prefill step
            return ScheduledStep(prefill=tuple(chunks), preempted=decode.preempted)
        return ScheduledStep(prefill=tuple(chunks), decode=decode.decode, preempted=decode.preempted)

    def _schedule_prefill(self) -> list[PrefillChunk]:
        chunks = self._take_prefill_chunks()
        if not chunks and not self.running:
            # Partly prefilled sequences behind the head hold pages the head needs: give them back
            # (they are recomputed later) so the oldest request always makes progress.
            for seq in list(self.waiting)[1:]:
                if seq.page_table.pages:
                    self.drop_cache(seq)
            chunks = self._take_prefill_chunks()
        return chunks

    def _take_prefill_chunks(self) -> list[PrefillChunk]:
        budget = self.config.max_batched_tokens
        slots = self.config.max_running - len(self.running)
        if self.config.prefill_tokens_while_decoding and self.running:
            waiting = sum(s.remaining_prefill for s in itertools.islice(self.waiting, 0, slots))
            budget = min(budget, _even_share(self.config.prefill_tokens_while_decoding, waiting))
        # Pages the running sequences need for their next decode step stay reserved for them.
        reserve = sum(s.page_table.pages_needed(s.num_cached + max(1, s.spec_block_size)) for s in self.running)
        chunks: list[PrefillChunk] = []
        for seq in itertools.islice(self.waiting, 0, slots):
            if budget <= 0:
                break
            needs_slot = self.state_pool is not None and seq.state_slot is None
            if needs_slot and self.state_pool.num_free == 0:
                break  # no slot: no pages either (a sequence holds both or neither)
            if seq in self._evicted and self.running and not self._fits_to_the_end(seq, chunks):
                break
            table = seq.page_table
            if self.prefix_cache is not None and not table.pages and seq.num_cached == 0 and not seq.branch_pages:
                self._map_cached_prefix(seq)
            usable = self.allocator.num_free - reserve
            fits = (len(table.pages) + max(0, usable)) * table.page_size - seq.num_cached
            take = min(seq.remaining_prefill, budget, fits)
            if self.prefix_cache is not None and self.prefix_cache.needs_checkpoints:
                take = min(take, self.prefix_cache.chunk_end(seq.num_cached, seq.prefill_target) - seq.num_cached)
                if seq.branch_pages:
                    take = min(take, seq.branch_end - seq.num_cached)
            if take <= 0:
                break
            table.ensure(seq.num_cached + take)  # the pages and the slot of a chunk are taken together
            if needs_slot:
                seq.state_slot = self.state_pool.alloc()
            chunks.append(PrefillChunk(seq, take))
            budget -= take
        return chunks

    def _map_cached_prefix(self, seq: Sequence) -> None:
        """Maps the cached pages of the sequence's prefix (all but its last prefill token at most)."""
        first = not seq.looked_up
        # prompt scoring needs every prompt position's logits: such a prompt takes no hit (it still publishes)
        limit = 0 if seq.params.prompt_logprobs is not None else seq.prefill_target - 1
        hit = self.prefix_cache.match(seq.token_ids, limit, seq.spec_block_size > 0, seq.prompt_len if first else 0,
                                      branch=True)
        seq.page_table.pages, seq.page_table.cache_keys = hit.pages, hit.keys
        seq.num_cached = len(hit.pages) * seq.page_table.page_size
        seq.restore_checkpoint = hit.checkpoint
        seq.branch_pages, seq.branch_keys = hit.branch_pages, hit.branch_keys
        if first:
            seq.looked_up, seq.num_cached_tokens = True, seq.num_cached

    def _fits_to_the_end(self, seq: Sequence, chunks: list[PrefillChunk]) -> bool:
        """Whether the free pages hold what `seq` and every running sequence (and this step's other prefill
        chunks) still need to reach max_new_tokens: a sequence that lost its cache once is readmitted only then,
        so the running sequences' growth never preempts it again (no recompute thrash)."""
        others = [s for s in self.running] + [chunk.seq for chunk in chunks]
        return sum(_pages_to_finish(s) for s in [seq, *others]) <= self.allocator.num_free

    def _schedule_decode(self) -> ScheduledStep:
        preempted: list[Sequence] = []
        scheduled: list[Sequence] = []
        queue = sorted(self.running, key=lambda s: s.arrival_order)
        while queue:
            seq = queue.pop(0)
            need = seq.num_cached + max(1, seq.spec_block_size)
            while True:
                try:
                    seq.page_table.ensure(need)
                    scheduled.append(seq)
                    break
                except OutOfPages:
                    if self._reclaim_waiting_pages():
                        continue
                    victim = queue.pop() if queue else seq
                    self._preempt(victim)
                    preempted.append(victim)
                    if victim is seq:
                        break
        return ScheduledStep(decode=tuple(scheduled), preempted=tuple(preempted))

    def _reclaim_waiting_pages(self) -> bool:
        """Frees the pages of the newest partly prefilled waiting sequence (recomputed later)."""
        for seq in reversed(self.waiting):
            if seq.page_table.pages:
                self.drop_cache(seq)
                self._evicted.add(seq)
                return True
        return False

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.drop_cache(seq)
        self._evicted.add(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def drop_cache(self, seq: Sequence) -> None:
        """Frees the pages and the state slot of a sequence; it is recomputed from token 0 if it runs again."""
        seq.page_table.release()
        if seq.branch_pages:
            self.allocator.free(list(seq.branch_pages))
            seq.branch_pages, seq.branch_keys = (), ()
        seq.num_cached = 0
        self.free_state(seq)
        if seq.restore_checkpoint is not None:
            self.prefix_cache.unpin(seq.restore_checkpoint)
            seq.restore_checkpoint = None

    def free_state(self, seq: Sequence) -> None:
        if seq.state_slot is not None and self.state_pool is not None:
            self.state_pool.free(seq.state_slot)
        seq.state_slot = None

    def promote(self, seq: Sequence) -> None:
        """A waiting sequence whose prefill completed starts decoding."""
        self.waiting.remove(seq)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)


def _even_share(bound: int, total: int) -> int:
    """The tokens per step that prefill `total` waiting tokens in as few steps of at most `bound` as greedy
    chunking would, spread evenly over them: a 128-token prompt under a bound of 96 goes as 64 + 64, not 96 + 32,
    so the longest step beside the decodes (what a running sequence waits between two tokens) is as short as the
    step count allows."""
    if total <= bound:
        return bound
    steps = -(-total // bound)
    return -(-total // steps)

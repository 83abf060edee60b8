"""The engine's side of the prefix cache: after each forward it publishes the pages its sequences filled and keeps
KDA state checkpoints; before a prefill forward it restores the checkpoints the scheduler's lookups hit.

Checkpoint positions (models with KDA layers; all on page boundaries, each tied to the key of the page ending there):
- prefill: every checkpoint_interval tokens, the last page boundary of the prompt and the end of a hit's branch
  (the scheduler ends prefill chunks there, engine/runtime/scheduler.py); at a branch's end the sequence first
  swaps the pages it recomputed for the cached ones (_join_branch), so it publishes on from the cached run;
- decode: every page boundary a sequence's cache reaches or passes, from the slot when the step ends on it, or
  from the verify scratch (the state after each verify position) when a speculative step passes it; each sequence keeps only its latest decode checkpoint, so a finished request
  leaves the one nearest its end (what the next turn of a chat resumes from)."""
from __future__ import annotations

from collections.abc import Callable

from engine.cache.prefix_cache import PrefixCache
from engine.runtime.sequence import Sequence
from engine.runtime.step_plan import CheckpointStatePlan, SnapshotCheckpointPlan


class PrefixReuse:
    def __init__(self, cache: PrefixCache, execute: Callable[[object], object], page_size: int, has_state: bool) -> None:
        self.cache = cache
        self.execute = execute
        self.page_size = page_size
        self.has_state = has_state

    def restore(self, seqs: list[Sequence]) -> None:
        """Copies each hit's checkpoint into the sequence's state slot (before its first chunk runs)."""
        pending = [seq for seq in seqs if seq.restore_checkpoint is not None]
        if not pending:
            return
        self.execute(CheckpointStatePlan([(seq.restore_checkpoint, seq.state_slot) for seq in pending], save=False))
        for seq in pending:
            self.cache.unpin(seq.restore_checkpoint)
            seq.restore_checkpoint = None

    def after_prefill(self, seqs: list[Sequence]) -> None:
        """After a prefill forward (num_cached advanced): publish, then checkpoint chunks that ended on a checkpoint
        position."""
        saves = []
        for seq in seqs:
            at_branch = self._join_branch(seq)
            self._publish(seq)
            if self.has_state and (at_branch or self.cache.is_checkpoint_position(seq.num_cached, seq.prefill_target)):
                slot = self._checkpoint_slot(seq)
                if slot is not None:
                    saves.append((seq.state_slot, slot))
        if saves:
            self.execute(CheckpointStatePlan(saves, save=True))

    def after_decode(self, steps: list[tuple[Sequence, int, int]], snapshot: bool) -> None:
        """After a decode step's commit, for the sequences still running: (sequence, its row in the step, its
        num_cached before the step). A page boundary reached exactly is checkpointed from the slot; one passed
        inside a verify step's kept tokens, from the verify scratch (snapshot: the step kept per-position state)."""
        saves, from_snapshot = [], []
        for seq, row, start in steps:
            self._publish(seq)
            boundary = seq.num_cached // self.page_size * self.page_size
            if not self.has_state or boundary <= start or (boundary < seq.num_cached and not snapshot):
                continue
            previous = seq.decode_checkpoint
            slot = self._checkpoint_slot(seq)
            if slot is None:
                continue
            if boundary == seq.num_cached:
                saves.append((seq.state_slot, slot))
            else:
                from_snapshot.append((row, boundary - 1 - start, slot))
            if previous is not None:
                self.cache.drop_checkpoint(previous)
            seq.decode_checkpoint = seq.page_table.cache_keys[-1]
        if saves:
            self.execute(CheckpointStatePlan(saves, save=True))
        if from_snapshot:
            self.execute(SnapshotCheckpointPlan(from_snapshot))

    def before_release(self, seq: Sequence) -> None:
        """A finishing or aborted sequence: its full pages stay cached."""
        self._publish(seq)

    def prefilled(self, seq: Sequence) -> None:
        """A sequence whose prompt another worker wrote (verified at its claim): its full prompt pages are published
        at once, so a request sharing the prompt (the other choices of an n > 1 request, the next turn) finds them
        before this one has run a step."""
        self._publish(seq)

    def _join_branch(self, seq: Sequence) -> bool:
        """A sequence whose prefill reached its branch's end: its recomputed pages there duplicate the branch's
        cached ones; the page table takes the cached pages (their references move from the branch to the table)
        and keys, and the duplicates are freed. True when it did (the state here is then checkpointed)."""
        if not seq.branch_pages or seq.num_cached != seq.branch_end:
            return False
        table = seq.page_table
        start = len(table.cache_keys)
        stop = start + len(seq.branch_pages)
        with self.cache.allocator.lock:
            duplicates = table.pages[start:stop]
            table.pages[start:stop] = seq.branch_pages
            table.cache_keys.extend(seq.branch_keys)
            seq.branch_pages, seq.branch_keys = (), ()
            self.cache.allocator.free(duplicates)
        return True

    def _publish(self, seq: Sequence) -> None:
        if seq.branch_pages:
            return  # its pages up to the branch's end duplicate cached ones: nothing to publish before the swap
        self.cache.publish(seq.page_table, seq.token_ids, seq.num_cached, seq.spec_block_size > 0)

    def _checkpoint_slot(self, seq: Sequence) -> int | None:
        keys = seq.page_table.cache_keys
        if seq.state_slot is None or len(keys) != seq.num_cached // self.page_size or not keys:
            return None  # the page ending here is not this sequence's cached one (a duplicate): no checkpoint
        return self.cache.save_checkpoint(keys[-1])

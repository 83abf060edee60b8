"""Per-sequence recurrent state of linear-attention (KDA) layers: a pool of fixed-size slots.

A sequence owns one slot for its whole life (allocated with its first pages, freed on finish, abort
and preemption). One slot holds, for every KDA layer of this tensor-parallel rank:

  conv      [conv_width, conv_channels]  the last conv_width = kernel-1 pre-conv projections, oldest
            first (window axis first); channels are the local q | k | v blocks, each
            heads_local * head_dim wide (each block sharded over ranks independently).
  recurrent [num_heads, head_k_dim, head_v_dim]  the delta-rule state S_h, K-major: S[h, k, v], as fla's
            kernels use it (SGLang stores it V-major [H, V, K]; transpose when exchanging with it).

Pool tensors: conv [num_kda_layers, num_slots, conv_width, conv_channels] (bf16 by default in SGLang;
here conv_dtype) and recurrent [num_kda_layers, num_slots, num_heads, head_k_dim, head_v_dim] (fp32 by
default). A freshly allocated slot is zero, which is the state of an empty sequence.

Storage is slot-major: one byte buffer raw [num_slots, slot_stride], each row one slot = every layer's
conv state, padded to SLOT_ALIGN bytes, then every layer's recurrent state, padded again; conv and
recurrent are strided views of it. So one slot is one contiguous byte range, which the KV handoff moves
like a page (kvtransfer: segment kind STATE), and the buffer can live in shared memory (raw given).

Speculative verify (K3_SPEC 5.1, snapshot path): a verify forward over [last, d1..d(B-1)] does not touch
the slots; each KDA layer writes its state after every verify position into the pool's scratch
(snapshot_conv [layers, n, B, W-1, C], snapshot_recurrent [layers, n, B, H, K, V], row i = the step's
sequence i), and commit_snapshots copies position accepted (commit_len - 1) into each sequence's slot.
The scratch belongs to the step, not to a slot: abort or preemption between steps leaves nothing behind.
The engine sizes the scratch once, for max_running sequences x the largest verify step, and counts it in
its cache budget (split_memory_budget), so speculation at full batch never allocates past the budget.
"""
from __future__ import annotations

import heapq
import threading
from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine.runtime.devices import host_to_device

SLOT_ALIGN = 64  # bytes: each slot's conv and recurrent parts start at a multiple of this


def _align(nbytes: int) -> int:
    return -(-nbytes // SLOT_ALIGN) * SLOT_ALIGN


class OutOfStateSlots(RuntimeError):
    """Every state slot is owned by a running sequence (or a decode reservation; rpc.status reports the
    grpc_status name)."""

    grpc_status = "RESOURCE_EXHAUSTED"


@dataclass(frozen=True)
class StateShape:
    """Geometry of one rank's state pool (local sizes: heads and channels already divided by TP)."""

    num_kda_layers: int
    num_slots: int
    conv_width: int
    conv_channels: int
    num_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_dtype: torch.dtype = torch.float32
    ssm_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for name in ("num_kda_layers", "num_slots", "conv_width", "conv_channels", "num_heads", "head_k_dim",
                     "head_v_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"StateShape.{name} must be a positive int, got {value!r}")
        if self.conv_channels % 3:
            raise ValueError(f"StateShape.conv_channels must hold three q|k|v blocks, got {self.conv_channels}")

    @property
    def conv_numel_per_slot(self) -> int:
        return self.num_kda_layers * self.conv_width * self.conv_channels

    @property
    def recurrent_numel_per_slot(self) -> int:
        return self.num_kda_layers * self.num_heads * self.head_k_dim * self.head_v_dim

    @property
    def conv_bytes_per_slot(self) -> int:
        """Bytes of one slot's conv state (every KDA layer), padded to SLOT_ALIGN."""
        return _align(self.conv_numel_per_slot * self.conv_dtype.itemsize)

    @property
    def bytes_per_slot(self) -> int:
        """Bytes one sequence's state takes on this rank (every KDA layer, conv + recurrent)."""
        conv = self.conv_numel_per_slot * self.conv_dtype.itemsize
        return conv + self.recurrent_numel_per_slot * self.ssm_dtype.itemsize

    @property
    def slot_stride(self) -> int:
        """Bytes of one row of the pool's slot-major buffer: conv and recurrent, each padded to SLOT_ALIGN."""
        return self.conv_bytes_per_slot + _align(self.recurrent_numel_per_slot * self.ssm_dtype.itemsize)

    @property
    def pool_bytes(self) -> int:
        return self.num_slots * self.slot_stride


class StatePool:
    """The state tensors of every slot and the free list; lowest free slot is handed out first. alloc and
    free are thread-safe under `lock` (reentrant; the engine's page allocator shares it), so a decode
    worker's event loop can reserve a slot while the engine thread runs a step."""

    def __init__(self, shape: StateShape, device: torch.device | str = "cpu", raw: torch.Tensor | None = None,
                 snapshot_rows: int = 0, snapshot_steps: int = 0) -> None:
        """raw: uint8 [num_slots, slot_stride] to keep the slots in (e.g. a shared-memory view); None:
        a zeroed buffer of its own on `device`. snapshot_rows / snapshot_steps: see reserve_snapshots."""
        self.shape = s = shape
        if raw is None:
            raw = torch.zeros((s.num_slots, s.slot_stride), dtype=torch.uint8, device=device)
        if raw.dtype != torch.uint8 or tuple(raw.shape) != (s.num_slots, s.slot_stride) or raw.stride(1) != 1:
            raise ValueError(f"state buffer must be uint8 [{s.num_slots}, {s.slot_stride}] with contiguous rows, "
                             f"got {raw.dtype} {list(raw.shape)}")
        self.raw = raw
        conv_bytes = s.conv_numel_per_slot * s.conv_dtype.itemsize
        ssm_bytes = s.recurrent_numel_per_slot * s.ssm_dtype.itemsize
        conv = raw[:, :conv_bytes].view(s.conv_dtype)
        recurrent = raw[:, s.conv_bytes_per_slot : s.conv_bytes_per_slot + ssm_bytes].view(s.ssm_dtype)
        self.conv = conv.view(s.num_slots, s.num_kda_layers, s.conv_width, s.conv_channels).transpose(0, 1)
        self.recurrent = recurrent.view(
            s.num_slots, s.num_kda_layers, s.num_heads, s.head_k_dim, s.head_v_dim).transpose(0, 1)
        self._free = list(range(s.num_slots))
        self._owned: set[int] = set()
        self._withheld: set[int] = set()
        self.lock = threading.RLock()
        self.snapshot_conv: torch.Tensor | None = None
        self.snapshot_recurrent: torch.Tensor | None = None
        self.fixed_snapshots = False
        self.reserve_snapshots(snapshot_rows, snapshot_steps)

    def reserve_snapshots(self, snapshot_rows: int, snapshot_steps: int) -> None:
        """snapshot_rows x snapshot_steps > 0: the verify scratch is allocated now, at that size, and never grows
        (the engine counts it in its memory budget); 0: it is allocated by the first verify step and grows on
        demand."""
        if snapshot_rows < 0 or snapshot_steps < 0 or (snapshot_rows > 0) != (snapshot_steps > 0):
            raise ValueError(f"snapshot_rows ({snapshot_rows}) and snapshot_steps ({snapshot_steps}) must both be "
                             "positive or both 0")
        self.fixed_snapshots = snapshot_rows > 0
        if self.fixed_snapshots:
            self._allocate_snapshots(snapshot_rows, snapshot_steps)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_slots(self) -> int:
        """Slots that can be handed out (withheld ones not counted)."""
        return self.shape.num_slots - len(self._withheld)

    def withhold(self, slot: int) -> None:
        """Takes a free slot out of circulation for good (a captured graph's padding rows use it as scratch):
        alloc never hands it out and num_slots no longer counts it."""
        with self.lock:
            if slot not in self._free:
                raise ValueError(f"state slot {slot} is not free")
            self._free.remove(slot)
            heapq.heapify(self._free)
            self._withheld.add(slot)

    def alloc(self) -> int:
        """A free slot, zeroed (the state of an empty sequence). Raises OutOfStateSlots when none is free."""
        with self.lock:
            if not self._free:
                raise OutOfStateSlots(f"all {self.shape.num_slots} state slots are in use")
            slot = heapq.heappop(self._free)
            self._owned.add(slot)
        self.reset(slot)  # the slot is ours alone now: zeroing it needs no lock
        return slot

    def free(self, slot: int) -> None:
        with self.lock:
            if slot not in self._owned:
                raise ValueError(f"state slot {slot} is not allocated")
            self._owned.remove(slot)
            heapq.heappush(self._free, slot)

    def reset(self, slot: int) -> None:
        """Zeroes one slot in every layer (a sequence that recomputes from scratch)."""
        self.raw[slot].zero_()

    def _allocate_snapshots(self, num_seqs: int, steps: int) -> None:
        s = self.shape
        self.snapshot_conv = torch.zeros((s.num_kda_layers, num_seqs, steps, s.conv_width, s.conv_channels),
                                         dtype=s.conv_dtype, device=self.conv.device)
        self.snapshot_recurrent = torch.zeros((s.num_kda_layers, num_seqs, steps, s.num_heads, s.head_k_dim,
                                               s.head_v_dim), dtype=s.ssm_dtype, device=self.recurrent.device)

    def begin_snapshots(self, num_seqs: int, steps: int) -> None:
        """Scratch for one verify step of num_seqs sequences with up to `steps` positions each (reused across
        steps; its rows are only meaningful until the step's commit). A fixed scratch (snapshot_rows given)
        refuses a step larger than itself; otherwise the scratch grows on demand."""
        conv, rec = self.snapshot_conv, self.snapshot_recurrent
        if conv is not None and rec is None:
            raise RuntimeError("snapshot buffers are half allocated")
        if conv is not None and conv.shape[1] >= num_seqs and conv.shape[2] >= steps:
            return
        if self.fixed_snapshots:
            raise RuntimeError(f"a verify step of {num_seqs} sequences x {steps} positions exceeds the state pool's "
                               f"snapshot scratch ({conv.shape[1]} x {conv.shape[2]}) counted in the memory budget")
        self._allocate_snapshots(max(num_seqs, conv.shape[1] if conv is not None else 0),
                                 max(steps, conv.shape[2] if conv is not None else 0))

    def commit_snapshots(self, slots: list[int], steps: list[int]) -> None:
        """After verification: slot slots[i] takes the state after verify position steps[i] of row i
        (steps[i] = tokens kept - 1); step -1 leaves the slot as it was."""
        if len(slots) != len(steps):
            raise ValueError(f"{len(slots)} slots but {len(steps)} steps")
        rows = [(i, slot, step) for i, (slot, step) in enumerate(zip(slots, steps)) if step >= 0]
        if not rows:
            return
        if self.snapshot_conv is None or self.snapshot_recurrent is None:
            raise RuntimeError("commit_snapshots without a verify step's snapshots")
        packed = host_to_device([value for col in zip(*rows) for value in col], torch.int64, self.conv.device)
        index, slot_index, step_index = packed.view(3, len(rows)).unbind(0)  # one pinned upload, no blocking copy
        self.conv.index_copy_(1, slot_index, self.snapshot_conv[:, index, step_index])
        self.recurrent.index_copy_(1, slot_index, self.snapshot_recurrent[:, index, step_index])

    def snapshot_bytes_per_seq(self, steps: int) -> int:
        """Scratch bytes one running sequence needs in a verify step of `steps` positions."""
        return steps * self.shape.bytes_per_slot

    def read_slot(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of one slot: conv [layers, conv_width, channels], recurrent [layers, H, K, V]."""
        return self.conv[:, slot].clone(), self.recurrent[:, slot].clone()

    def write_slot(self, slot: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Overwrites one slot (e.g. with a state received from a prefill worker)."""
        self.conv[:, slot].copy_(conv)
        self.recurrent[:, slot].copy_(recurrent)


class MemorySplit(NamedTuple):
    """How a cache budget is used: latent pages, state slots, and the speculative verify scratch
    (snapshot_rows sequences x snapshot_steps positions, each position one slot's worth of bytes)."""

    num_pages: int
    num_slots: int
    snapshot_rows: int = 0
    snapshot_steps: int = 0


def split_memory_budget(budget_bytes: int, bytes_per_page: int, bytes_per_slot: int, max_running: int,
                        snapshot_steps: int = 0, state_fraction: float = 0.5) -> MemorySplit:
    """Splits a cache budget between latent pages, state slots and the verify scratch so that the three
    together never exceed it.

    Every running sequence needs a slot and, when speculation is on (snapshot_steps = the largest verify step,
    in positions), snapshot_steps slots' worth of scratch in a verify step. So slots = max_running (+1 spare for
    a sequence being set up) and scratch rows = min(max_running, slots), reduced until slots + scratch fit in
    state_fraction of the budget; the pages take the rest. bytes_per_slot 0 (no linear attention): pages only."""
    if budget_bytes <= 0 or bytes_per_page <= 0 or max_running <= 0 or bytes_per_slot < 0 or snapshot_steps < 0:
        raise ValueError("memory budget, page size and max_running must be positive")
    if not 0.0 < state_fraction < 1.0:
        raise ValueError(f"state_fraction must be in (0, 1), got {state_fraction}")
    if bytes_per_slot == 0:
        return MemorySplit(max(1, budget_bytes // bytes_per_page), 0)
    state_budget = int(budget_bytes * state_fraction)

    def state_bytes(slots: int) -> int:
        return (slots + min(max_running, slots) * snapshot_steps) * bytes_per_slot

    slots = min(max_running + 1, state_budget // bytes_per_slot)
    while slots > 0 and state_bytes(slots) > state_budget:
        slots -= 1
    if slots < 1:
        raise ValueError(f"kv_memory_bytes={budget_bytes} cannot hold one state slot of {bytes_per_slot} B "
                         f"(+ {snapshot_steps} positions of verify scratch) in {state_fraction:g} of the budget")
    pages = (budget_bytes - state_bytes(slots)) // bytes_per_page
    if pages < 1:
        raise ValueError(f"kv_memory_bytes={budget_bytes} leaves no room for a KV page after {slots} state slots")
    rows = min(max_running, slots) if snapshot_steps else 0
    return MemorySplit(pages, slots, rows, snapshot_steps if rows else 0)

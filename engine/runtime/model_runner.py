"""Runs step plans on one tensor-parallel rank: the target model, the draft model and the page caches."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from engine.runtime.devices import bind_thread_to, host_to_device, rank_device
from engine.runtime.distributed import TPGroup
from engine.runtime.host_memory import retain_freed_memory
from engine.runtime.forward_batch import ForwardMode, copy_forward_batch
from engine.cache.kv_cache import CacheShape, PagedLatentCache
from engine.layers.embedding import ParallelLMHead
from engine.cache.page_pool import PagePool, PagePoolFactory
from engine.cache.state_pool import StatePool
from engine.runtime.step_plan import (AttachPoolsPlan, CheckpointStatePlan, CommitStatePlan, DraftPlan, ExportPlan,
                              ReadStatePlan, SnapshotCheckpointPlan, TargetPlan, pack_target_plan)

logger = logging.getLogger(__name__)

KV_POOLS = ("local", "shm", "device")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RunnerConfig:
    """What every rank needs to build its runner (picklable, sent to follower processes)."""

    model_dir: str
    draft_dir: str | None
    dtype: str
    attention_backend: str
    page_size: int
    num_pages: int
    kv_pool: str  # "local" | "shm" (CPU shared memory) | "device" (device memory exported over IPC)
    pool_tag: str = "engine"
    num_threads: int | None = None
    device: str = "cpu"  # "cpu" | "cuda" (resolved; rank r runs on cuda:gpus[r])
    gpus: tuple[int, ...] = ()
    use_graphs: bool = False  # capture decode / verify steps as CUDA graphs (GPU only; page num_pages-1 is scratch)
    graph_max_batch: int = 64
    graph_query_lens: tuple[int, ...] = (1,)  # decode, plus the verify block size with a draft
    share_weights: bool = False  # map the node's one shared copy of this rank's weights (engine/weights/weight_store.py)
    page_pools: PagePoolFactory | None = None  # creates (kv_pool "shm") and attaches shared pools
    num_state_slots: int = 0  # per-sequence state slots (models with linear attention)
    num_checkpoint_slots: int = 0  # prefix cache: KDA state checkpoints kept beside the slots (engine/cache/prefix_cache.py)
    snapshot_rows: int = 0  # speculative verify scratch: sequences x positions, allocated at start (0: none)
    snapshot_steps: int = 0
    draft_dtype: str = ""  # the draft's weights and activations ("": dtype); its cache pages stay in dtype

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"RunnerConfig.device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.device == "cuda" and self.kv_pool == "shm":
            raise ValueError("kv_pool 'shm' keeps pages in CPU shared memory; a GPU cache needs kv_pool 'local' or 'device'")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.draft_dtype and self.draft_dtype not in DTYPES:
            raise ValueError(f"draft_dtype must be empty or one of {sorted(DTYPES)}, got {self.draft_dtype!r}")
        if self.kv_pool not in KV_POOLS:
            raise ValueError(f"kv_pool must be one of {KV_POOLS}, got {self.kv_pool!r}")
        if self.kv_pool != "local" and self.page_pools is None:
            raise ValueError(f"kv_pool {self.kv_pool!r} needs a page_pools factory")
        if self.page_size <= 0 or self.num_pages <= 0:
            raise ValueError("page_size and num_pages must be positive")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def draft_dtype_name(self) -> str:
        return self.draft_dtype or self.dtype


def graph_state_slot(config: RunnerConfig, has_linear_attention: bool, device_type: str) -> int | None:
    """The state slot captured graphs pad with (models with linear-attention state, graphs on a GPU, a cache this
    engine allocates: its own or its device pool), one past the engine's slots; None when no graph holds state."""
    stateful = (config.use_graphs and device_type == "cuda" and config.kv_pool in ("local", "device")
                and config.num_state_slots > 0 and has_linear_attention)
    return config.num_state_slots if stateful else None


def cache_shape_for(model_config, draft_config, num_pages: int, page_size: int, dtype: torch.dtype,
                    tp_size: int = 1, num_state_slots: int = 0) -> CacheShape:
    """One rank's cache geometry; models with linear attention add num_state_slots state slots (sharded
    over tp_size ranks), which live in the same buffer after the pages."""
    state = None
    if model_config.has_linear_attention and num_state_slots > 0:
        state = model_config.state_shape(tp_size, num_state_slots, dtype)
    return CacheShape(
        num_layers=model_config.num_cache_layers,
        num_pages=num_pages,
        page_size=page_size,
        latent_dim=model_config.kv_lora_rank,
        rope_dim=model_config.qk_rope_head_dim,
        dtype=dtype,
        draft_layers=draft_config.num_layers if draft_config is not None else 0,
        draft_dim=draft_config.draft_dim if draft_config is not None else 0,
        state=state,
    )


class ModelRunner:
    def __init__(self, config: RunnerConfig, tp: TPGroup) -> None:
        from engine.attention.registry import get_attention_backend
        from engine.models.registry import build_model, load_config, load_model

        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        retain_freed_memory()
        self.config = config
        self.tp = tp
        self.device = rank_device(config.device, config.gpus or tuple(range(tp.size)), tp.rank)
        bind_thread_to(self.device)
        dtype = config.torch_dtype
        model_config = load_config(config.model_dir)
        heads_per_rank = model_config.num_attention_heads // tp.size
        self.attention = get_attention_backend(
            config.attention_backend, num_heads=heads_per_rank, device=str(self.device), dtype=config.dtype
        )
        attention = self.attention
        self._shared_weights: list[object] = []
        self.model_config = model_config
        self.model = self._load(
            "target", config.model_dir, config.dtype,
            lambda: load_model(config.model_dir, tp, attention, dtype, device=self.device)[1],
            lambda: build_model(config.model_dir, model_config, tp, attention, dtype, self.device),
        )
        self.draft = None
        self.draft_dtype = DTYPES[config.draft_dtype_name]
        self._draft_head: ParallelLMHead | None = None  # the LM head in the draft's dtype, when it differs
        if config.draft_dir:
            from engine.models.draft_registry import build_any_draft, load_any_draft

            draft_dtype = self.draft_dtype
            self.draft = self._load(
                "draft", config.draft_dir, config.draft_dtype_name,
                lambda: load_any_draft(config.draft_dir, draft_dtype, self.device),
                lambda: build_any_draft(config.draft_dir, draft_dtype),
            )
            self.draft.eval()
            if draft_dtype != dtype:
                self._draft_head = self._cast_lm_head(draft_dtype)
        self.capture_layers: tuple[int, ...] = tuple(self.draft.config.target_layer_ids) if self.draft else ()
        # Captured steps of a model with linear-attention state pad with sequences that need a state slot of
        # their own: one more than the engine hands out (withheld from the free list below). In a shared pool
        # (kv_pool "device": a decode worker's) other processes write only slots the engine handed out.
        self.graph_state_slot = graph_state_slot(config, model_config.has_linear_attention, self.device.type)
        stateful_graphs = self.graph_state_slot is not None
        self.cache_shape = cache_shape_for(
            self.model_config, self.draft.config if self.draft else None, config.num_pages, config.page_size, dtype,
            tp.size, config.num_state_slots + (1 if stateful_graphs else 0),
        )
        self.pool: PagePool | None = None
        self._attached: dict[str, PagePool] = {}
        if config.kv_pool != "local" and config.page_pools is not None:
            self.pool = config.page_pools.create(self.cache_shape, config.num_pages, tp.rank, config.pool_tag)
            self.cache = self.pool.cache
        else:
            self.cache = PagedLatentCache(self.cache_shape, device=self.device)
        if self.graph_state_slot is not None:
            self.cache.state.withhold(self.graph_state_slot)
        if self.cache.state is not None and config.snapshot_rows:
            self.cache.state.reserve_snapshots(config.snapshot_rows, config.snapshot_steps)
        self.checkpoints: torch.Tensor | None = None  # uint8 [checkpoint slots, slot stride]: StatePool.raw rows
        self._checkpoint_view: StatePool | None = None  # conv / recurrent views of them
        if self.cache.state is not None and config.num_checkpoint_slots:
            shape = dataclasses.replace(self.cache.state.shape, num_slots=config.num_checkpoint_slots)
            self.checkpoints = torch.zeros((shape.num_slots, shape.slot_stride), dtype=torch.uint8, device=self.device)
            self._checkpoint_view = StatePool(shape, raw=self.checkpoints)
        self.graphs = self._capture_graphs() if config.use_graphs else None
        logger.info(
            "rank %d/%d ready on %s: %d pages x %d tokens (%s), %d state slots, draft=%s",
            tp.rank, tp.size, self.device, config.num_pages, config.page_size, config.kv_pool,
            config.num_state_slots, bool(self.draft),
        )

    def _capture_graphs(self):
        from engine.runtime.cuda_graphs import CudaGraphRunner

        if self.device.type != "cuda" or not torch.cuda.is_available():
            logger.info("CUDA graphs need a GPU; running eagerly on %s", self.device)
            return None
        if self.cache.state is not None and self.graph_state_slot is None:
            logger.warning("CUDA graphs of a model with linear-attention state need a cache of this engine's own "
                           "(kv_pool 'local' or 'device', got %r): decode runs eagerly", self.config.kv_pool)
            return None
        if not self.attention.graph_safe:
            logger.warning("attention backend %s reads host-side lengths: decode runs eagerly", self.attention.name)
            return None
        max_pages = min(self.config.num_pages - 1, -(-self.model_config.max_position_embeddings // self.config.page_size))
        max_batch = self.config.graph_max_batch
        if self.graph_state_slot is not None:  # no step has more sequences than the engine has state slots
            max_batch = max(1, min(max_batch, self.config.num_state_slots))
        graphs = CudaGraphRunner(self, max_batch, self.config.graph_query_lens, max_pages, self.graph_state_slot)
        graphs.capture(write_draft=self.draft is not None)
        return graphs

    def _cast_lm_head(self, dtype: torch.dtype) -> ParallelLMHead:
        """A copy of this rank's LM head shard in `dtype`, for the draft's logits (the draft shares the target's
        LM head; a draft in another dtype multiplies by a copy in its own)."""
        source = self.model.lm_head
        head = ParallelLMHead(self.model_config.vocab_size, source.weight.shape[1], self.tp, dtype)
        head.weight = torch.nn.Parameter(source.weight.detach().to(dtype), requires_grad=False)
        return head.eval()

    def _load(self, role: str, model_dir: str, dtype_name: str, load, build_empty) -> torch.nn.Module:
        """load() normally, or, with share_weights, through the node's shared weight store (the first
        worker of the node loads and publishes; the others build the model without loading and map it)."""
        if not self.config.share_weights:
            return load()
        if self.device.type == "cuda":
            return self._load_device_shared(role, model_dir, dtype_name, load, build_empty)
        from engine.weights.weight_store import WeightKey, load_shared

        key = WeightKey(model_dir, dtype_name, "cpu", self.tp.size, self.tp.rank, role)

        model, shared = load_shared(key, load, build_empty)
        self._shared_weights.append(shared)
        return model.eval().requires_grad_(False)

    def _load_device_shared(self, role: str, model_dir: str, dtype_name: str, load, build_empty) -> torch.nn.Module:
        """On a GPU: the first worker on this device loads the shard and exports IPC handles of its tensors;
        the others open them (engine/weights/device_weights.py). Without a usable IPC layer: a private copy."""
        from engine.weights.device_ipc import IpcUnavailable, ipc_for
        from engine.weights.device_weights import load_device_shared
        from engine.weights.weight_store import WeightKey

        ipc = ipc_for(self.device)
        try:
            key = WeightKey(model_dir, dtype_name, ipc.device_id(self.device), self.tp.size, self.tp.rank, role)
        except IpcUnavailable as error:  # e.g. FakeTensorMode on a CPU-only machine
            logger.info("device weight sharing unavailable (%s): loading a private copy", error)
            return load()
        model, shared = load_device_shared(key, load, build_empty, ipc, self.device)
        if shared is not None:
            self._shared_weights.append(shared)
        return model.eval().requires_grad_(False)

    @property
    def pool_name(self) -> str | None:
        return self.pool.name if self.pool is not None else None

    # --- caches -------------------------------------------------------------------------------------
    def _cache_for(self, pool_names: tuple[str, ...] | None) -> PagedLatentCache:
        if pool_names is None:
            return self.cache
        name = pool_names[self.tp.rank]
        if self.pool is not None and name == self.pool.name:
            return self.cache
        if name not in self._attached:
            if self.config.page_pools is None:
                raise ValueError(f"cannot attach page pool {name!r}: this engine was given no page_pools factory")
            self._close_orphaned_pools()
            self._attached[name] = self.config.page_pools.attach(name, self.cache_shape)
        return self._attached[name].cache

    def _close_orphaned_pools(self) -> None:
        """Closes the attached pools of processes that are gone (a decode worker that died and came back with new
        pools): otherwise their mappings, and so their memory, would stay with this process for good."""
        for name in [name for name, pool in self._attached.items() if not pool.owner_alive()]:
            logger.info("closing KV pool %s: its owner is gone", name)
            self._attached.pop(name).close()

    def detach(self, pool_names: tuple[str, ...]) -> None:
        pool = self._attached.pop(pool_names[self.tp.rank], None)
        if pool is not None:
            pool.close()

    # --- plans --------------------------------------------------------------------------------------
    def execute(self, plan) -> torch.Tensor | None:
        bind_thread_to(self.device)  # steps may run on another thread than the one that built the runner
        if isinstance(plan, TargetPlan):
            return self.run_target(plan)
        if isinstance(plan, DraftPlan):
            return self.run_draft(plan)
        if isinstance(plan, CommitStatePlan):
            self.cache.state.commit_snapshots(plan.slots, plan.steps)
            return None
        if isinstance(plan, CheckpointStatePlan):
            self.copy_checkpoints(plan)
            return None
        if isinstance(plan, SnapshotCheckpointPlan):
            self.checkpoint_snapshots(plan)
            return None
        if isinstance(plan, ExportPlan):
            self.export(plan)
            return None
        if isinstance(plan, AttachPoolsPlan):
            self._cache_for(plan.pool_names)
            return None
        if isinstance(plan, ReadStatePlan):  # a collective: every rank's slot row, gathered in rank order
            return self.tp.all_gather(self.cache.state.raw[plan.slot : plan.slot + 1].clone(), dim=0)
        raise TypeError(f"unknown plan {type(plan).__name__}")

    def copy_checkpoints(self, plan: CheckpointStatePlan) -> None:
        slots = self._cache_for(plan.pool_names).state.raw
        src, dst = (slots, self.checkpoints) if plan.save else (self.checkpoints, slots)
        sources, targets = zip(*plan.pairs)
        dst.index_copy_(0, host_to_device(list(targets), torch.int64, self.device),
                        src.index_select(0, host_to_device(list(sources), torch.int64, self.device)))

    def export(self, plan: ExportPlan) -> None:
        dst = self._cache_for(plan.pool_names)
        src_index = host_to_device(list(plan.src_pages), torch.int64, self.device)
        dst_index = host_to_device(list(plan.dst_pages), torch.int64, self.device)
        dst.kv.index_copy_(1, dst_index, self.cache.kv.index_select(1, src_index))
        if self.cache.draft is not None and dst.draft is not None:
            dst.draft.index_copy_(1, dst_index, self.cache.draft.index_select(1, src_index))
        if plan.src_slot is not None:
            dst.state.raw[plan.dst_slot].copy_(self.cache.state.raw[plan.src_slot])
        # A collective: when the leader returns, every rank's copy is in place (the prefill worker checksums the
        # destination pages next, and a follower's copy must not still be running).
        self.tp.all_reduce(torch.zeros(1, device=self.device))

    def checkpoint_snapshots(self, plan: SnapshotCheckpointPlan) -> None:
        state, view = self.cache.state, self._checkpoint_view
        rows, steps, slots = (host_to_device(list(col), torch.int64, self.device) for col in zip(*plan.rows))
        view.conv.index_copy_(1, slots, state.snapshot_conv[:, rows, steps])
        view.recurrent.index_copy_(1, slots, state.snapshot_recurrent[:, rows, steps])

    @torch.inference_mode()
    def run_target(self, plan: TargetPlan) -> torch.Tensor:
        """-> logits [len(plan.logit_rows), vocab] float32 on this rank's device (identical on every rank)."""
        if self.graphs is not None and plan.pool_names is None:
            logits = self.graphs.run_target(plan)
            if logits is not None:
                return logits
        cache = self._cache_for(plan.pool_names)
        for slot in plan.reset_slots:
            cache.state.reset(slot)
        batch, rows = copy_forward_batch(plan.mode, *pack_target_plan(plan, self.config.page_size), self.device)
        if plan.mode == ForwardMode.MIXED:
            batch = dataclasses.replace(batch, parts=batch.attn.split(plan.decode_seqs))
        if plan.state_slots is not None:
            slots = host_to_device(list(plan.state_slots), torch.int64, self.device)
            batch = dataclasses.replace(batch, state_slots=slots, snapshot_state=plan.snapshot_state,
                                        state_slots_cpu=tuple(plan.state_slots))
            if plan.snapshot_state:
                cache.state.begin_snapshots(len(plan.state_slots), max(plan.q_lens))
        return self.forward_target(batch, rows, cache, plan.write_draft_context)

    def forward_target(self, batch, rows: torch.Tensor, cache: PagedLatentCache, write_draft_context: bool) -> torch.Tensor:
        """The device part of a target step (no host lists, no syncs): what a CUDA graph captures."""
        capture = self.capture_layers if write_draft_context and self.draft is not None else ()
        out = self.model(batch, cache, capture_layers=capture)
        if capture:
            entries = self.draft.context_entries(torch.cat(out.captured, dim=-1), batch.positions)
            draft_view = cache.draft.view(cache.shape.draft_layers, -1, cache.shape.draft_dim)
            draft_view[:, batch.attn.slot_mapping] = entries.to(cache.draft.dtype)
        return self.model.compute_logits(out.hidden.index_select(0, rows))

    @torch.inference_mode()
    def run_draft(self, plan: DraftPlan) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """-> draft logits [num_seqs * (block_size - 1), vocab] float32 for block positions 1 .. B-1
        (plan.with_hidden: and the hidden states they come from, [num_seqs * (block_size - 1), hidden])."""
        assert self.draft is not None
        if self.graphs is not None and not plan.with_hidden:
            logits = self.graphs.run_draft(plan)
            if logits is not None:
                return logits
        last, starts, slots = self.draft_inputs(plan)
        full = len(set(plan.context_lens)) == 1  # no padding: the draft needs no attention mask
        return self.forward_draft(last, starts, slots, plan.block_size, plan.with_hidden, full)

    def draft_inputs(self, plan: DraftPlan, num_seqs: int | None = None, max_ctx: int | None = None):
        """(last tokens [S], context starts [S], context slots [S, max_ctx]) on the device, one H2D copy.
        num_seqs / max_ctx pad for a captured graph (padding rows: token 0 at position 0, slot 0)."""
        page_size = self.config.page_size
        count = num_seqs or len(plan.last_tokens)
        width = max_ctx or max(plan.context_lens)
        slots: list[int] = []
        for length, pages in zip(plan.context_lens, plan.page_tables):
            row: list[int] = []
            for page in pages[: -(-length // page_size)]:  # whole pages at a time, cut to the length
                row.extend(range(page * page_size, (page + 1) * page_size))
            slots += row[:length] + [0] * (width - length)
        slots += [0] * ((count - len(plan.context_lens)) * width)
        pad = count - len(plan.last_tokens)
        values = list(plan.last_tokens) + [0] * pad + list(plan.context_lens) + [0] * pad + slots
        packed = host_to_device(values, torch.int64, self.device)
        last, starts, flat = torch.split(packed, [count, count, count * width])
        return last, starts, flat.view(count, width)

    def forward_draft(self, last: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor, block: int,
                      with_hidden: bool = False, full_context: bool = False,
                      ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The device part of a draft step: last/starts [S], slots [S, max_ctx] -> logits [S * (block - 1), vocab]
        (with_hidden: and the hidden rows [S * (block - 1), hidden]). full_context: every context is max_ctx
        long (no padding rows, no mask)."""
        num_seqs, max_ctx = slots.shape
        shifted = self.draft.shifted_block  # DSpark: block-1 slots, slot k predicts position start+k+1
        width = block - 1 if shifted else block
        ids = torch.full((num_seqs, width), self.draft.config.mask_token_id, dtype=torch.int64, device=self.device)
        ids[:, 0] = last
        positions = starts[:, None] + torch.arange(width, device=self.device)[None, :]
        embeds = self.model.embed(ids.view(-1)).view(num_seqs, width, -1).to(self.draft_dtype)
        draft_cache = self.cache.draft.view(self.cache_shape.draft_layers, -1, self.cache_shape.draft_dim)
        context = draft_cache.index_select(1, slots.view(-1)).view(self.cache_shape.draft_layers, num_seqs, max_ctx, -1)
        hidden = self.draft(embeds, positions, context.to(self.draft_dtype), starts, full_context)
        hidden = (hidden if shifted else hidden[:, 1:]).reshape(num_seqs * (block - 1), -1)
        logits = self.model.compute_logits(hidden) if self._draft_head is None else self._draft_head(hidden)
        return (logits, hidden) if with_hidden else logits

    def read_pages(self, page_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Copies of this rank's pages: target [layers, n, page_size, D], draft [draft_layers, n, page_size, Dd]."""
        bind_thread_to(self.device)
        index = host_to_device(list(page_ids), torch.int64, self.device)
        target = self.cache.kv.index_select(1, index)
        draft = self.cache.draft.index_select(1, index) if self.cache.draft is not None else None
        return target, draft

    def close(self) -> None:
        for shared in self._shared_weights:
            shared.close()
        for pool in self._attached.values():
            pool.close()
        self._attached.clear()
        if self.pool is not None:
            self.pool.close()
            self.pool.unlink()
            self.pool = None

"""Runs step plans on one tensor-parallel rank: the target model, the draft model and the page caches."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.distributed import TPGroup
from engine.forward_batch import ForwardBatch, ForwardMode, build_attention_metadata
from engine.kv_cache import CacheShape, PagedLatentCache
from engine.page_pool import PagePool, PagePoolFactory
from engine.step_plan import AttachPoolsPlan, DraftPlan, TargetPlan

logger = logging.getLogger(__name__)

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
    kv_pool: str  # "local" | "shm"
    pool_tag: str = "engine"
    num_threads: int | None = None
    share_weights: bool = False  # map the node's one shared copy of this rank's weights (engine/weight_store.py)
    page_pools: PagePoolFactory | None = None  # creates (kv_pool "shm") and attaches shared pools

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.kv_pool not in ("local", "shm"):
            raise ValueError(f"kv_pool must be 'local' or 'shm', got {self.kv_pool!r}")
        if self.kv_pool == "shm" and self.page_pools is None:
            raise ValueError("kv_pool 'shm' needs a page_pools factory")
        if self.page_size <= 0 or self.num_pages <= 0:
            raise ValueError("page_size and num_pages must be positive")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def cache_shape_for(model_config, draft_config, num_pages: int, page_size: int, dtype: torch.dtype) -> CacheShape:
    return CacheShape(
        num_layers=model_config.num_hidden_layers,
        num_pages=num_pages,
        page_size=page_size,
        latent_dim=model_config.kv_lora_rank,
        rope_dim=model_config.qk_rope_head_dim,
        dtype=dtype,
        draft_layers=draft_config.num_layers if draft_config is not None else 0,
        draft_dim=draft_config.draft_dim if draft_config is not None else 0,
    )


class ModelRunner:
    def __init__(self, config: RunnerConfig, tp: TPGroup) -> None:
        from engine.attention.registry import get_attention_backend
        from engine.config import ModelConfig
        from engine.models.deepseek_v3 import DeepseekV3ForCausalLM, load_model

        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.tp = tp
        dtype = config.torch_dtype
        model_config = ModelConfig.from_pretrained(config.model_dir)
        heads_per_rank = model_config.num_attention_heads // tp.size
        attention = get_attention_backend(config.attention_backend, num_heads=heads_per_rank, device="cpu")
        self._shared_weights: list[object] = []
        self.model_config = model_config
        self.model = self._load(
            "target", config.model_dir, lambda: load_model(config.model_dir, tp, attention, dtype)[1],
            lambda: DeepseekV3ForCausalLM(model_config, tp, attention, dtype),
        )
        self.draft = None
        if config.draft_dir:
            from engine.models.dflash import DFlashDraft, load_draft, read_draft_config

            self.draft = self._load(
                "draft", config.draft_dir, lambda: load_draft(config.draft_dir, dtype=dtype),
                lambda: DFlashDraft(read_draft_config(config.draft_dir)).to(dtype),
            )
            self.draft.eval()
        self.capture_layers: tuple[int, ...] = tuple(self.draft.config.target_layer_ids) if self.draft else ()
        self.cache_shape = cache_shape_for(
            self.model_config, self.draft.config if self.draft else None, config.num_pages, config.page_size, dtype
        )
        self.pool: PagePool | None = None
        self._attached: dict[str, PagePool] = {}
        if config.kv_pool == "shm" and config.page_pools is not None:
            self.pool = config.page_pools.create(self.cache_shape, config.num_pages, tp.rank, config.pool_tag)
            self.cache = self.pool.cache
        else:
            self.cache = PagedLatentCache(self.cache_shape)
        logger.info(
            "rank %d/%d ready: %d pages x %d tokens (%s), draft=%s",
            tp.rank, tp.size, config.num_pages, config.page_size, config.kv_pool, bool(self.draft),
        )

    def _load(self, role: str, model_dir: str, load, build_empty) -> torch.nn.Module:
        """load() normally, or, with share_weights, through the node's shared weight store (the first
        worker of the node loads and publishes; the others build the model without loading and map it)."""
        if not self.config.share_weights:
            return load()
        from engine.weight_store import WeightKey, load_shared

        key = WeightKey(model_dir, self.config.dtype, "cpu", self.tp.size, self.tp.rank, role)

        model, shared = load_shared(key, load, build_empty)
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
            self._attached[name] = self.config.page_pools.attach(name, self.cache_shape)
        return self._attached[name].cache

    def detach(self, pool_names: tuple[str, ...]) -> None:
        pool = self._attached.pop(pool_names[self.tp.rank], None)
        if pool is not None:
            pool.close()

    # --- plans --------------------------------------------------------------------------------------
    def execute(self, plan) -> torch.Tensor | None:
        if isinstance(plan, TargetPlan):
            return self.run_target(plan)
        if isinstance(plan, DraftPlan):
            return self.run_draft(plan)
        if isinstance(plan, AttachPoolsPlan):
            self._cache_for(plan.pool_names)
            return None
        raise TypeError(f"unknown plan {type(plan).__name__}")

    @torch.inference_mode()
    def run_target(self, plan: TargetPlan) -> torch.Tensor:
        """-> logits [len(plan.logit_rows), vocab] float32 (identical on every rank)."""
        cache = self._cache_for(plan.pool_names)
        attn = build_attention_metadata(plan.q_lens, plan.kv_lens, plan.page_tables, self.config.page_size)
        batch = ForwardBatch(
            mode=plan.mode,
            input_ids=torch.tensor(plan.input_ids, dtype=torch.int64),
            positions=torch.tensor(plan.positions, dtype=torch.int64),
            attn=attn,
        )
        capture = self.capture_layers if plan.write_draft_context and self.draft is not None else ()
        out = self.model(batch, cache, capture_layers=capture)
        if capture:
            entries = self.draft.context_entries(torch.cat(out.captured, dim=-1), batch.positions)
            cache.draft.view(cache.shape.draft_layers, -1, cache.shape.draft_dim)[:, attn.slot_mapping] = entries.to(
                cache.draft.dtype
            )
        rows = torch.tensor(plan.logit_rows, dtype=torch.int64)
        return self.model.compute_logits(out.hidden.index_select(0, rows))

    @torch.inference_mode()
    def run_draft(self, plan: DraftPlan) -> torch.Tensor:
        """-> draft logits [num_seqs * (block_size - 1), vocab] float32 for block positions 1 .. B-1."""
        assert self.draft is not None
        num_seqs, block = len(plan.last_tokens), plan.block_size
        page_size = self.config.page_size
        mask_id = self.draft.config.mask_token_id
        ids = torch.full((num_seqs, block), mask_id, dtype=torch.int64)
        ids[:, 0] = torch.tensor(plan.last_tokens, dtype=torch.int64)
        starts = torch.tensor(plan.context_lens, dtype=torch.int64)
        positions = starts[:, None] + torch.arange(block)[None, :]
        embeds = self.model.embed(ids.view(-1)).view(num_seqs, block, -1)
        max_ctx = max(plan.context_lens)
        slots = torch.zeros((num_seqs, max_ctx), dtype=torch.int64)
        for i, (length, pages) in enumerate(zip(plan.context_lens, plan.page_tables)):
            pos = torch.arange(length)
            table = torch.tensor(pages, dtype=torch.int64)
            slots[i, :length] = table[pos // page_size] * page_size + pos % page_size
        draft_cache = self.cache.draft.view(self.cache_shape.draft_layers, -1, self.cache_shape.draft_dim)
        context = draft_cache[:, slots.view(-1)].view(self.cache_shape.draft_layers, num_seqs, max_ctx, -1)
        hidden = self.draft(embeds, positions, context.to(embeds.dtype), starts)
        return self.model.compute_logits(hidden[:, 1:].reshape(num_seqs * (block - 1), -1))

    def read_pages(self, page_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Copies of this rank's pages: target [layers, n, page_size, D], draft [draft_layers, n, page_size, Dd]."""
        index = torch.tensor(page_ids, dtype=torch.int64)
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

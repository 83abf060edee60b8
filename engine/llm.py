"""The offline Python API: LLM(model_dir).logits(...) / .generate(...), over LLMEngine."""
from __future__ import annotations

import itertools

import torch

from engine.engine_config import DEFAULT_MODEL_DIR, EngineConfig
from engine.runtime.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


class LLM:
    """llm = LLM(model_dir, tp_size=1, dtype="auto", attention_backend="auto", draft_model=None, device="auto")

    device: "auto" (a GPU when one is visible) | "cpu" | "cuda" (ROCm too); dtype "auto": bfloat16 on a
    GPU, float32 on CPU. draft_model: a draft directory; None uses the model's draft/ folder when
    present; "" disables it.
    Extra keyword arguments go to EngineConfig (page_size, kv_memory_bytes, max_running, ...)."""

    def __init__(
        self,
        model_dir: str | None = None,
        tp_size: int = 1,
        dtype: str = "auto",
        attention_backend: str = "auto",
        draft_model: str | None = None,
        device: str = "auto",
        **engine_options,
    ) -> None:
        config = EngineConfig(
            model_dir=str(model_dir or DEFAULT_MODEL_DIR),
            tp_size=tp_size,
            dtype=dtype,
            attention_backend=attention_backend,
            draft_model_dir=draft_model,
            device=device,
            **engine_options,
        )
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    @property
    def model_config(self):
        return self.engine.model_config

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """[len(token_ids), vocab] float32 logits of every position (on the engine's device)."""
        return self.engine.full_logits(list(token_ids))

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[list[int]]:
        """New tokens of each prompt (continuous batching: sequences join and leave between steps)."""
        if params is None:
            params = SamplingParams()
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError("one SamplingParams per prompt, or a single one for all")
        for prompt, p in zip(prompts, per_prompt):
            self.engine.validate_prompt(list(prompt), p)
        ids = [f"llm-{next(self._ids)}" for _ in prompts]
        outputs: dict[str, list[int]] = {rid: [] for rid in ids}
        for rid, prompt, p in zip(ids, prompts, per_prompt):
            self.engine.add_request(rid, list(prompt), p)
        while self.engine.has_work():
            for out in self.engine.step():
                if out.request_id in outputs:
                    outputs[out.request_id].extend(out.new_token_ids)
        return [outputs[rid] for rid in ids]

    @property
    def acceptance_stats(self):
        return self.engine.acceptance_stats

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        engine = self.__dict__.get("engine")
        if engine is not None:
            try:
                engine.close()
            except Exception:  # interpreter shutdown: nothing useful left to do
                pass

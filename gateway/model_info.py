"""What the gateway needs to know about the served model: context size, vocabulary, eos ids and the
sampling defaults of generation_config.json. Read from the model directory (no weights, no torch)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.models.registry import load_config


@dataclass(frozen=True)
class SamplingDefaults:
    """Defaults for request fields left unset; None = the engine's own default."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    max_new_tokens: int | None = None

    @classmethod
    def from_generation_config(cls, config: dict[str, object]) -> SamplingDefaults:
        """HF semantics: do_sample false means greedy whatever the temperature says."""
        temperature = config.get("temperature")
        if config.get("do_sample") is False:
            temperature = 0.0
        max_new = config.get("max_new_tokens")
        return cls(
            temperature=None if temperature is None else float(temperature),
            top_k=None if config.get("top_k") is None else int(config["top_k"]),
            top_p=None if config.get("top_p") is None else float(config["top_p"]),
            min_p=None if config.get("min_p") is None else float(config["min_p"]),
            max_new_tokens=None if max_new is None else int(max_new),
        )


@dataclass(frozen=True)
class ModelFacts:
    name: str
    vocab_size: int
    max_context: int
    eos_token_ids: tuple[int, ...]
    defaults: SamplingDefaults = SamplingDefaults()

    def __post_init__(self) -> None:
        if self.vocab_size <= 0 or self.max_context <= 1:
            raise ValueError(f"bad model facts: vocab {self.vocab_size}, context {self.max_context}")

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelFacts:
        path = Path(model_dir)
        config = load_config(path)  # any registered model_type (deepseek_v3, kimi_linear, kimi_k3)
        generation_path = path / "generation_config.json"
        defaults = SamplingDefaults()
        eos = config.eos_token_id
        if generation_path.exists():
            generation = json.loads(generation_path.read_text())
            defaults = SamplingDefaults.from_generation_config(generation)
            if generation.get("eos_token_id") is not None:
                value = generation["eos_token_id"]
                eos = (int(value),) if isinstance(value, int) else tuple(int(v) for v in value)
        return cls(name=path.resolve().name, vocab_size=config.vocab_size,
                   max_context=config.max_position_embeddings, eos_token_ids=tuple(eos), defaults=defaults)

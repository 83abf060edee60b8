"""The shared model runtime: `from engine import LLM, SamplingParams`."""
from __future__ import annotations

from engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    raise AttributeError(name)

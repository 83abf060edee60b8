"""Attention backends behind one interface (base.AttentionBackend), chosen by registry.get_attention_backend."""
from __future__ import annotations

from engine.attention.base import AttentionBackend, VarlenSpans
from engine.attention.head_padding import HeadPaddedBackend, next_supported_head_count
from engine.attention.registry import BACKEND_NAMES, get_attention_backend

__all__ = [
    "AttentionBackend",
    "BACKEND_NAMES",
    "HeadPaddedBackend",
    "VarlenSpans",
    "get_attention_backend",
    "next_supported_head_count",
]

"""The routed-experts implementations by name, with the Triton one imported lazily (GPU only)."""
from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch

from engine.kernels.moe_torch import moe_dense, moe_grouped, moe_loop

MoEFunction = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
MOE_PATHS = ("fused", "grouped", "dense", "loop")


@functools.cache
def fused_moe_available() -> bool:
    """Triton importable and compiling for a GPU (not the CPU interpreter)."""
    if os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes"):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def moe_function(path: str) -> MoEFunction:
    """The implementation called `path` (one of MOE_PATHS); all share moe_torch's contract."""
    if path == "fused":
        from engine.kernels.fused_moe import fused_moe

        return fused_moe
    functions = {"grouped": moe_grouped, "dense": moe_dense, "loop": moe_loop}
    if path not in functions:
        raise ValueError(f"unknown MoE path {path!r} (choose from {', '.join(MOE_PATHS)})")
    return functions[path]

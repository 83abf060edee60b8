"""The engine's one device-to-host door: every sampled id, accept length or logprob that the host
needs passes through fetch_to_host, so a step's synchronisations can be counted (and a test can
forbid every other one, tests/engine/test_fake_cuda.py)."""
from __future__ import annotations

import torch


def fetch_to_host(tensor: torch.Tensor) -> list:
    """tensor (any device) -> nested Python lists; on a GPU this waits for the step's kernels."""
    return tensor.tolist()

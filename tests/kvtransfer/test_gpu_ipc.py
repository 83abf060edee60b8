"""GPU IPC path: without a GPU every entry point raises a clear TransportUnavailable."""
from __future__ import annotations

import pytest
import torch

from kvtransfer.errors import TransportUnavailable
from kvtransfer.gpu_ipc import PoolHandle, export_pool, finish_in_place, open_pool

from .conftest import SMALL_WITH_DRAFT


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU guard")
def test_without_gpu_the_path_is_refused_clearly():
    """export, open and finish raise TransportUnavailable mentioning the missing device."""
    with pytest.raises(TransportUnavailable, match="CUDA or ROCm"):
        export_pool(torch.zeros(8, dtype=torch.bfloat16), SMALL_WITH_DRAFT, 1)
    with pytest.raises(TransportUnavailable):
        open_pool(PoolHandle(b"", SMALL_WITH_DRAFT.hash, 1, "uuid"), SMALL_WITH_DRAFT)
    with pytest.raises(TransportUnavailable):
        finish_in_place()

"""engine/kernels/cpu_linear.py: few-row float32 CPU matmuls through oneDNN with a packed weight."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import cpu_linear

pytestmark = pytest.mark.skipif(not cpu_linear.AVAILABLE, reason="this torch build has no oneDNN linear ops")


@pytest.mark.parametrize("rows", [2, 7, 8, 16])
def test_packed_path_matches_f_linear(rows):
    """Same result as F.linear to float32 rounding, for the row counts that take the packed path, with a
    leading batch shape kept."""
    torch.manual_seed(rows)
    weight = torch.randn(4096, 192) * 0.05
    x = torch.randn(1, rows, 192)
    assert cpu_linear.takes_packed_path(x, weight)
    out = cpu_linear.linear(x, weight)
    assert out.shape == (1, rows, 4096)
    torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_which_calls_take_the_packed_path():
    """One row, more than ROWS[1] rows, narrow weights, other dtypes and autograd all stay on F.linear."""
    weight = torch.randn(512, 64)
    assert not cpu_linear.takes_packed_path(torch.randn(1, 64), weight)
    assert not cpu_linear.takes_packed_path(torch.randn(cpu_linear.ROWS[1] + 1, 64), weight)
    assert not cpu_linear.takes_packed_path(torch.randn(8, 64), torch.randn(cpu_linear.MIN_OUT - 1, 64))
    assert not cpu_linear.takes_packed_path(torch.randn(8, 64, dtype=torch.bfloat16), weight.bfloat16())
    assert not cpu_linear.takes_packed_path(torch.randn(8, 64, requires_grad=True), weight)
    assert cpu_linear.takes_packed_path(torch.randn(8, 64), weight)


def test_weight_changed_or_rebound_is_packed_again():
    """An in-place change (a weight loaded after the first call) and a rebinding of the tensor's data (the
    shared weight store re-points parameters at its segment) both repack: no stale result."""
    weight = torch.nn.Parameter(torch.randn(512, 64), requires_grad=False)
    x = torch.randn(4, 64)
    first = cpu_linear.linear(x, weight)
    with torch.no_grad():
        weight.mul_(2.0)
    torch.testing.assert_close(cpu_linear.linear(x, weight), 2.0 * first, rtol=1e-5, atol=1e-5)
    weight.data = torch.randn(512, 64)
    torch.testing.assert_close(cpu_linear.linear(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_packed_copies_stay_under_the_cap(monkeypatch):
    """A weight whose packed copy would pass the process's cap stays on F.linear (same result); the copies
    held are counted, and a repacked weight's old copy is no longer."""
    monkeypatch.setattr(cpu_linear, "_packed_bytes", 0)
    monkeypatch.setattr(cpu_linear, "BUDGET_BYTES", 512 * 64 * 4)  # room for one [512, 64] float32 weight
    x = torch.randn(4, 64)
    first, second = torch.randn(512, 64), torch.randn(512, 64)
    assert cpu_linear.packed_weight(first) is not None and cpu_linear._packed_bytes == 512 * 64 * 4
    assert cpu_linear.packed_weight(second) is None
    torch.testing.assert_close(cpu_linear.linear(x, second), F.linear(x, second))
    first.mul_(1.5)  # repacked in place of its old copy: still within the cap
    assert cpu_linear.packed_weight(first) is not None and cpu_linear._packed_bytes == 512 * 64 * 4

"""engine/kernels/cpu_linear.py: few-row float32 CPU matmuls through a row-major transposed copy of small weights
or through oneDNN with a packed weight."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import cpu_linear

needs_onednn = pytest.mark.skipif(not cpu_linear.AVAILABLE, reason="this torch build has no oneDNN linear ops")


@pytest.fixture
def no_transposed_path(monkeypatch):
    """The packed path's own tests: small weights would take the transposed path first."""
    monkeypatch.setattr(cpu_linear, "TRANSPOSED_MAX_BYTES", 0)


@pytest.mark.parametrize("path, rows", [("transposed", rows) for rows in (2, 9, 16, 64)]
                         + [pytest.param("packed", rows, marks=needs_onednn) for rows in (2, 7, 8, 16)])
def test_paths_match_f_linear(path, rows, monkeypatch):
    """Same result as F.linear to float32 rounding, with a leading batch shape kept: small weights at 2-64 rows
    through torch.mm against the transposed copy; the packed path's row counts through oneDNN (the transposed
    path turned off, as it would come first for this weight)."""
    torch.manual_seed(rows)
    monkeypatch.setattr(cpu_linear, "_packed_bytes", 0)  # the process's other copies (other tests' models) aside
    weight = torch.randn(4096, 192) * 0.05
    x = torch.randn(1, rows, 192)
    if path == "packed":
        monkeypatch.setattr(cpu_linear, "TRANSPOSED_MAX_BYTES", 0)
    assert (cpu_linear.takes_transposed_path(x, weight), cpu_linear.takes_packed_path(x, weight))[path == "packed"]
    out = cpu_linear.linear(x, weight)
    assert out.shape == (1, rows, 4096)
    torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-5)
    if path == "transposed":
        copy = getattr(weight, cpu_linear._TRANSPOSED_ATTR)[2]
        assert copy.shape == (192, 4096) and copy.is_contiguous()


def test_which_calls_take_the_transposed_path():
    """One row (a GEMV), more than 64 rows, weights over 4 MiB, other dtypes and autograd do not."""
    weight = torch.randn(512, 64)
    assert cpu_linear.takes_transposed_path(torch.randn(2, 64), weight)
    assert not cpu_linear.takes_transposed_path(torch.randn(1, 64), weight)
    assert not cpu_linear.takes_transposed_path(torch.randn(cpu_linear.TRANSPOSED_ROWS[1] + 1, 64), weight)
    big = torch.randn(cpu_linear.TRANSPOSED_MAX_BYTES // (4 * 64) + 1, 64)
    assert not cpu_linear.takes_transposed_path(torch.randn(8, 64), big)
    assert not cpu_linear.takes_transposed_path(torch.randn(8, 64, dtype=torch.bfloat16), weight.bfloat16())
    assert not cpu_linear.takes_transposed_path(torch.randn(8, 64, requires_grad=True), weight)


@pytest.mark.parametrize("path", ["transposed", pytest.param("packed", marks=needs_onednn)])
def test_copies_follow_the_weight(path, monkeypatch):
    """An in-place change (a weight loaded after the first call) and a rebinding of the tensor's data (the
    shared weight store re-points parameters at its segment) both remake the held copy: no stale result."""
    if path == "packed":
        monkeypatch.setattr(cpu_linear, "TRANSPOSED_MAX_BYTES", 0)
    weight = torch.nn.Parameter(torch.randn(512, 64), requires_grad=False)
    x = torch.randn(4, 64)
    assert (cpu_linear.takes_transposed_path(x, weight), cpu_linear.takes_packed_path(x, weight))[path == "packed"]
    first = cpu_linear.linear(x, weight)
    with torch.no_grad():
        weight.mul_(2.0)
    torch.testing.assert_close(cpu_linear.linear(x, weight), 2.0 * first, rtol=1e-5, atol=1e-5)
    weight.data = torch.randn(512, 64)
    torch.testing.assert_close(cpu_linear.linear(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_transposed_copies_count_against_the_cap(monkeypatch):
    """A transposed copy that would pass the process's cap is not made; the call goes on to the other paths
    with the same result."""
    monkeypatch.setattr(cpu_linear, "_packed_bytes", 0)
    monkeypatch.setattr(cpu_linear, "BUDGET_BYTES", 256 * 64 * 4)  # room for one [256, 64] float32 weight
    first, second = torch.randn(256, 64), torch.randn(256, 64)
    assert cpu_linear.transposed_weight(first) is not None and cpu_linear._packed_bytes == 256 * 64 * 4
    assert cpu_linear.transposed_weight(second) is None
    x = torch.randn(4, 64)
    torch.testing.assert_close(cpu_linear.linear(x, second), F.linear(x, second), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_which_calls_take_the_packed_path():
    """One row, more than ROWS[1] rows, narrow weights, other dtypes and autograd all stay on F.linear."""
    weight = torch.randn(512, 64)
    assert not cpu_linear.takes_packed_path(torch.randn(1, 64), weight)
    assert not cpu_linear.takes_packed_path(torch.randn(cpu_linear.ROWS[1] + 1, 64), weight)
    assert not cpu_linear.takes_packed_path(torch.randn(8, 64), torch.randn(cpu_linear.MIN_OUT - 1, 64))
    assert not cpu_linear.takes_packed_path(torch.randn(8, 64, dtype=torch.bfloat16), weight.bfloat16())
    assert not cpu_linear.takes_packed_path(torch.randn(8, 64, requires_grad=True), weight)
    assert cpu_linear.takes_packed_path(torch.randn(8, 64), weight)


@needs_onednn
def test_packed_copies_stay_under_the_cap(monkeypatch, no_transposed_path):
    """A weight whose packed copy would pass the process's cap stays on F.linear (same result); the copies
    held are counted, and a repacked weight's old copy is no longer. (Transposed copies share the cap.)"""
    monkeypatch.setattr(cpu_linear, "_packed_bytes", 0)
    monkeypatch.setattr(cpu_linear, "BUDGET_BYTES", 512 * 64 * 4)  # room for one [512, 64] float32 weight
    x = torch.randn(4, 64)
    first, second = torch.randn(512, 64), torch.randn(512, 64)
    assert cpu_linear.packed_weight(first) is not None and cpu_linear._packed_bytes == 512 * 64 * 4
    assert cpu_linear.packed_weight(second) is None
    torch.testing.assert_close(cpu_linear.linear(x, second), F.linear(x, second))
    first.mul_(1.5)  # repacked in place of its old copy: still within the cap
    assert cpu_linear.packed_weight(first) is not None and cpu_linear._packed_bytes == 512 * 64 * 4


def test_a_collected_weight_gives_its_copy_back_to_the_cap(monkeypatch):
    """Copies count against the cap while their weight lives: a collected weight's bytes leave the count (a
    process that builds many models, as the test suite does, would otherwise fill the cap with dead copies)."""
    import gc

    monkeypatch.setattr(cpu_linear, "_packed_bytes", 0)
    weight = torch.randn(256, 64)
    assert cpu_linear.transposed_weight(weight) is not None and cpu_linear._packed_bytes == 256 * 64 * 4
    weight.mul_(2.0)  # remade: the old copy's bytes are replaced, not added
    assert cpu_linear.transposed_weight(weight) is not None and cpu_linear._packed_bytes == 256 * 64 * 4
    del weight
    gc.collect()
    assert cpu_linear._packed_bytes == 0

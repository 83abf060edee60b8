"""The per-sequence state pool: geometry, zeroed allocation, free-list accounting."""
from __future__ import annotations

import pytest
import torch

from engine.state_pool import OutOfStateSlots, StatePool, StateShape


def _shape(**overrides) -> StateShape:
    values = dict(num_kda_layers=2, num_slots=3, conv_width=3, conv_channels=24, num_heads=2, head_k_dim=4,
                  head_v_dim=4, conv_dtype=torch.bfloat16, ssm_dtype=torch.float32)
    values.update(overrides)
    return StateShape(**values)


def test_tensor_shapes_and_bytes_per_slot():
    """Pool tensors follow the agreed layout; bytes_per_slot counts conv and recurrent of every layer."""
    pool = StatePool(_shape())
    assert pool.conv.shape == (2, 3, 3, 24) and pool.conv.dtype == torch.bfloat16
    assert pool.recurrent.shape == (2, 3, 2, 4, 4) and pool.recurrent.dtype == torch.float32
    assert pool.shape.bytes_per_slot == 2 * 3 * 24 * 2 + 2 * 2 * 4 * 4 * 4


def test_k3_tp8_bytes_per_slot_matches_spec():
    """K3 at TP8 (69 KDA layers, 12 heads, 128x128, bf16 conv, fp32 SSM) takes 56,171,520 B per request."""
    shape = StateShape(num_kda_layers=69, num_slots=1, conv_width=3, conv_channels=3 * 12 * 128, num_heads=12,
                       head_k_dim=128, head_v_dim=128, conv_dtype=torch.bfloat16, ssm_dtype=torch.float32)
    assert shape.bytes_per_slot == 56_171_520


def test_alloc_zeroes_and_free_returns_slot():
    """A slot comes back zeroed even after a previous owner wrote into it; num_free tracks alloc/free."""
    pool = StatePool(_shape())
    slot = pool.alloc()
    assert pool.num_free == 2
    pool.conv[:, slot] = 1.0
    pool.recurrent[:, slot] = 2.0
    pool.free(slot)
    assert pool.num_free == 3
    again = pool.alloc()
    assert again == slot
    assert pool.conv[:, again].abs().sum() == 0 and pool.recurrent[:, again].abs().sum() == 0


def test_exhaustion_and_double_free_raise():
    """Allocating past the pool raises OutOfStateSlots; freeing a slot twice raises ValueError."""
    pool = StatePool(_shape(num_slots=1))
    slot = pool.alloc()
    with pytest.raises(OutOfStateSlots):
        pool.alloc()
    pool.free(slot)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(slot)


@pytest.mark.parametrize("field,value", [("num_heads", 0), ("conv_channels", 25), ("num_slots", -1)])
def test_bad_shape_names_field(field, value):
    """A bad geometry is a ValueError naming the field."""
    with pytest.raises(ValueError, match=field):
        _shape(**{field: value})


def test_slot_round_trip():
    """write_slot then read_slot returns the same tensors."""
    pool = StatePool(_shape())
    slot = pool.alloc()
    conv = torch.randn(2, 3, 24).to(torch.bfloat16)
    recurrent = torch.randn(2, 2, 4, 4)
    pool.write_slot(slot, conv, recurrent)
    got_conv, got_rec = pool.read_slot(slot)
    assert torch.equal(got_conv, conv) and torch.equal(got_rec, recurrent)

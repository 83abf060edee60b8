"""The node's shared weight store: one copy mapped by every worker, nothing left behind in /dev/shm."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from engine.weights import weight_store
from engine.weights.weight_store import PREFIX, SHM_DIR, WeightKey, load_shared, remove_stale_segments


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 32, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("scale", torch.empty(8), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.proj(self.embed(ids)) * self.scale)


def _loaded() -> Tiny:
    torch.manual_seed(0)
    model = Tiny()
    model.scale.copy_(torch.linspace(0.5, 1.5, 8))
    return model.eval().requires_grad_(False)


def _empty() -> Tiny:
    with torch.device("meta"):
        return Tiny()


@pytest.fixture
def key(tmp_path) -> WeightKey:
    (tmp_path / "config.json").write_text("{}")
    yield WeightKey(str(tmp_path), "float32", "cpu", 1, 0)
    weight_store._unlink(WeightKey(str(tmp_path), "float32", "cpu", 1, 0).segment_name)


def _segment_exists(key: WeightKey) -> bool:
    return os.path.exists(os.path.join(SHM_DIR, key.segment_name))


def test_second_loader_maps_the_first_ones_bytes(key):
    """The first load publishes; a second load of the same key builds without loading and maps the same memory:
    outputs are identical and the parameters of both point into one mapping."""
    reference = _loaded()
    first, shared_first = load_shared(key, _loaded, _empty)
    loads = []
    second, shared_second = load_shared(key, lambda: loads.append(1) or _loaded(), _empty)
    assert loads == [], "the second worker must not read the checkpoint"
    assert shared_first.owner and not shared_second.owner
    ids = torch.tensor([1, 5, 7])
    assert torch.equal(first(ids), reference(ids)) and torch.equal(second(ids), reference(ids))
    assert second.head.weight.data_ptr() == second.embed.weight.data_ptr(), "tied weights stay tied"
    base = shared_first._bytes.data_ptr()
    assert base <= first.proj.weight.data_ptr() < base + shared_first._bytes.numel()
    shared_second.close()
    assert _segment_exists(key), "a mapper that is not the owner leaves the name while the owner lives"
    shared_first.close()
    assert not _segment_exists(key)
    assert torch.equal(second(ids), reference(ids)), "the mapping outlives the name"


@pytest.mark.slow  # a child interpreter that loads weights (torch): ~2 s of CPU
def test_a_segment_whose_loader_died_is_reclaimed(key):
    """A segment left LOADING by a dead process is removed and loaded again by the next worker."""
    child = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        from engine.weights import weight_store
        fd = weight_store._claim({key.segment_name!r})
        print(fd is not None)
    """)], capture_output=True, text=True, check=True)
    assert child.stdout.strip() == "True" and _segment_exists(key)
    model, shared = load_shared(key, _loaded, _empty, timeout_s=60)
    assert shared.owner
    assert torch.equal(model.scale, _loaded().scale)
    shared.close()


@pytest.mark.slow  # a child interpreter that loads weights (torch): ~2 s of CPU
def test_stale_segments_are_removed_and_live_ones_kept(key):
    """remove_stale_segments drops segments of dead owners only."""
    model, shared = load_shared(key, _loaded, _empty)
    assert key.segment_name not in remove_stale_segments()
    # The dead owner's segment under a prefix of this test's own: a deployment starting beside it (another xdist
    # worker, another suite) runs remove_stale_segments() over PREFIX and must not win the race for it.
    prefix = f"pdserve-test-w-{os.getpid()}-"
    assert not prefix.startswith(PREFIX)
    child = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import os
        from engine.weights import weight_store
        fd = weight_store._claim("{prefix}stale")
        weight_store._write_header(fd, weight_store.READY)
    """)], capture_output=True, text=True)
    assert child.returncode == 0, child.stderr
    assert remove_stale_segments(prefix=prefix) == [f"{prefix}stale"]
    assert _segment_exists(key)
    shared.close()


def test_a_model_that_does_not_match_the_segment_is_refused(key):
    """Binding a segment to a model with other tensor names is a ValueError naming them."""
    load_shared(key, _loaded, _empty)
    with pytest.raises(ValueError, match="does not match"):
        load_shared(key, _loaded, lambda: nn.Linear(2, 2, device="meta"))


def _inode(key: WeightKey) -> int:
    return os.stat(os.path.join(SHM_DIR, key.segment_name)).st_ino


def test_a_late_exit_leaves_a_newer_segment_under_the_same_name_alone(key):
    """A key's name is reused: after an owner's name was removed (a stale-segment sweep, another deployment of the
    same checkpoint) and the next loader published a new segment under it, the old owner's exit must not remove
    the new one (its loader and mappers would find the name gone, or a third loader's half-written segment)."""
    old_model, old = load_shared(key, _loaded, _empty)
    weight_store._unlink(key.segment_name)
    new_model, new = load_shared(key, _loaded, _empty)
    assert new.owner and _inode(key) == os.fstat(new._fd).st_ino
    old.close()
    assert _segment_exists(key) and _inode(key) == os.fstat(new._fd).st_ino, "the older owner removed the newer name"
    mapper_model, mapper = load_shared(key, _loaded, _empty)
    assert not mapper.owner and torch.equal(mapper_model.proj.weight, new_model.proj.weight)
    mapper.close()
    new.close()
    assert not _segment_exists(key)
    assert torch.equal(old_model.proj.weight, new_model.proj.weight), "mappings outlive their names"


def test_a_claim_taken_over_mid_load_is_given_up_without_removing_the_new_claim(key):
    """A loader that fails after its name was taken over (the name swept and claimed again meanwhile) removes
    nothing: the name is the other loader's now."""
    claims = []

    def load_then_fail() -> Tiny:
        weight_store._unlink(key.segment_name)
        claims.append(weight_store._claim(key.segment_name))  # another worker's claim
        raise RuntimeError("checkpoint unreadable")

    with pytest.raises(RuntimeError, match="unreadable"):
        load_shared(key, load_then_fail, _empty)
    assert claims[0] is not None
    try:
        assert _segment_exists(key) and _inode(key) == os.fstat(claims[0]).st_ino, \
            "the failed loader removed the other worker's claim"
    finally:
        os.close(claims[0])

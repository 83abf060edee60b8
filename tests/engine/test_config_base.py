"""engine.model_configs.base's property helpers: alias (one value under a second name) and length_of (a count read
from the collection it counts)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.model_configs.base import alias, length_of


class _Holder:
    rank = alias("header.rank")
    num_running = length_of("scheduler.running")

    def __init__(self) -> None:
        self.header = SimpleNamespace(rank=3)
        self.scheduler = SimpleNamespace(running=["a", "b"])


def test_alias_and_length_of_follow_the_member_they_read():
    """Both read the dotted member at access time (no copy taken at construction) and cannot be assigned."""
    holder = _Holder()
    assert (holder.rank, holder.num_running) == (3, 2)
    holder.header.rank, holder.scheduler.running = 5, []
    assert (holder.rank, holder.num_running) == (5, 0)
    with pytest.raises(AttributeError):
        holder.num_running = 1
    assert _Holder.num_running.__doc__ == "len(scheduler.running)."

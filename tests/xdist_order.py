"""The order pytest-xdist hands out work in (`-n 2 --dist loadscope --no-loadscope-reorder`, scripts/test.sh).

loadscope keeps a module's tests (a class's, for tests in a class) on one worker, so module-scoped fixtures
are built once. The scheduler hands out these scopes in collection order; in an xdist worker this plugin
moves the scopes that hold a `slow` test to the front (a stable sort: tests keep their order inside a scope,
and every worker computes the same order, as xdist requires). The long tests then start first and the many
short ones fill in at the end, instead of one long test running alone on one worker while the other idles.
Without xdist the collection order is left alone.

(`--dist loadgroup` with xdist_group marks would also keep the session cluster in one worker, but
pytest-xdist 3.8 writes the group into Item._nodeid, which pytest 9.2 no longer reads, so the marks are
ignored: the session `cluster` fixture is started once per worker that runs a cluster module.)"""
from __future__ import annotations

import os

import pytest


def scope_of(nodeid: str) -> str:
    """The work unit of `--dist loadscope` (xdist's own rule): the node id up to its last `::`."""
    return nodeid.rsplit("::", 1)[0]


@pytest.hookimpl(trylast=True)  # after tests/conftest.py marked the cluster tests slow
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return
    slow = {scope_of(item.nodeid) for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: scope_of(item.nodeid) not in slow)

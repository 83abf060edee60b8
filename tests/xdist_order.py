"""The order pytest-xdist hands out work in (`-n 2 --dist loadscope --no-loadscope-reorder`, scripts/test.sh).

loadscope keeps a module's tests (a class's, for tests in a class) on one worker, so module-scoped fixtures
are built once. The scheduler hands out these scopes in collection order, each to the worker that asks next;
in an xdist worker this plugin moves the scopes that hold a `slow` test to the front, longest first by the
wall seconds recorded in tests/scope_costs.json (a slow scope it does not list counts as DEFAULT_COST_S),
then the rest in collection order (a stable sort: tests keep their order inside a scope, and every worker
computes the same order, as xdist requires). Longest-first keeps one long scope from starting last and
running alone on one worker while the other idles. Without xdist the collection order is left alone.

Refresh the table after adding or changing slow tests: `bash scripts/test.sh --write-scope-costs
tests/scope_costs.json` on an idle machine (tests/cpu_durations.py writes it).

(`--dist loadgroup` with xdist_group marks would also keep the session cluster in one worker, but
pytest-xdist 3.8 writes the group into Item._nodeid, which pytest 9.2 no longer reads, so the marks are
ignored: the session `cluster` fixture is started once per worker that runs a cluster module.)"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

COSTS_FILE = Path(__file__).with_name("scope_costs.json")
DEFAULT_COST_S = 10.0


def scope_of(nodeid: str) -> str:
    """The work unit of `--dist loadscope` (xdist's own rule): the node id up to its last `::`."""
    return nodeid.rsplit("::", 1)[0]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--scope-costs", type=Path, default=COSTS_FILE, metavar="PATH",
                     help="JSON {scope: wall seconds}: the order slow scopes are handed out in (longest first)")


def load_costs(path: Path) -> dict[str, float]:
    return {str(scope): float(cost) for scope, cost in json.loads(path.read_text()).items()} if path.is_file() else {}


@pytest.hookimpl(trylast=True)  # after tests/conftest.py marked the cluster tests slow
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return
    costs = load_costs(config.getoption("scope_costs"))
    slow = {scope_of(item.nodeid) for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: (0, -costs.get(scope, DEFAULT_COST_S)) if (scope := scope_of(item.nodeid)) in slow
               else (1, 0.0))

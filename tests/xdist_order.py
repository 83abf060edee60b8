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

The modules that share the session `cluster` deployment (tests/services/conftest.py) form ONE work unit
(SESSION_CLUSTER_SCOPE, by a loadscope scheduler that knows it), so that deployment and the in-process `llm`
are started once per run instead of once in each worker (~13 CPU seconds). (`--dist loadgroup` with
xdist_group marks would do the same, but pytest-xdist 3.8 writes the group into Item._nodeid, which pytest
9.2 no longer reads, so the marks are ignored.) tests/test_xdist_plugins.py checks that the list below names
exactly the modules whose tests or fixtures take `cluster`."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

COSTS_FILE = Path(__file__).with_name("scope_costs.json")
DEFAULT_COST_S = 10.0


SESSION_CLUSTER_SCOPE = "tests/services[session cluster]"
SESSION_CLUSTER_MODULES = frozenset(f"tests/services/test_{name}.py" for name in (
    "auth", "client_examples", "e2e_api", "e2e_decode_stream", "e2e_errors", "e2e_outputs", "e2e_standing_lease",
    "gateway_loop", "kv_isolation", "metrics_http", "openai_http", "openai_sampling", "openai_scoring",
    "openai_structured", "soak_short"))


def scope_of(nodeid: str) -> str:
    """The work unit of `--dist loadscope`: xdist's own rule (the node id up to its last `::`), except that
    the session-cluster modules are one unit."""
    if nodeid.split("::", 1)[0] in SESSION_CLUSTER_MODULES:
        return SESSION_CLUSTER_SCOPE
    return nodeid.rsplit("::", 1)[0]


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: only called when it runs the session
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`--dist loadscope` with the session-cluster modules as one work unit (None: xdist's own scheduler)."""
    if config.getoption("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling  # here: the plugin also loads where xdist is absent

    class ClusterAwareScopes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

    return ClusterAwareScopes(config, log)


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

"""`--cpu-durations=N`: the N tests that used the most CPU (this process and the children it waited for),
beside their wall time.

On a shared, loaded machine wall time measures the neighbours as much as the test; CPU seconds are what
the test costs on an idle machine (where wall time is about CPU time / cores used). Process clusters
started by session fixtures are reaped at session end, so their CPU shows up in the teardown of the last
test that used them, and their per-test cost only as wall time.

Under pytest-xdist each worker measures its own tests and sends the figures to the controller on the
teardown report (user_properties), so the summary covers every worker. `--write-scope-costs PATH` also
writes the wall seconds of every xdist work unit (tests/xdist_order.py's scopes) that took >= 1 s as JSON,
the table tests/xdist_order.py hands the slow scopes out by."""
from __future__ import annotations

import json
import os
import resource
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.xdist_order import scope_of

_PROPERTY = "cpu_durations"
_START = pytest.StashKey[tuple[float, float]]()


@dataclass
class Usage:
    """CPU and wall seconds spent by one test (setup + call + teardown)."""

    nodeid: str
    cpu_s: float = 0.0
    wall_s: float = 0.0


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


_USAGE: dict[str, Usage] = {}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cpu-durations", type=int, default=None, metavar="N",
                     help="list the N tests that used the most CPU seconds (0: all)")
    parser.addoption("--write-scope-costs", default=None, metavar="PATH",
                     help="write {xdist scope: wall seconds} of the scopes taking >= 1 s as JSON to PATH")


@pytest.hookimpl(tryfirst=True)  # before the fixtures are set up
def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.config.getoption("cpu_durations") is not None or item.config.getoption("write_scope_costs"):
        item.stash[_START] = (_cpu_seconds(), time.monotonic())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    start = item.stash.get(_START, None)
    if call.when == "teardown" and start is not None:
        cpu, wall = start
        outcome.get_result().user_properties.append((_PROPERTY, (_cpu_seconds() - cpu, time.monotonic() - wall)))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    for name, value in report.user_properties if report.when == "teardown" else ():
        if name == _PROPERTY:
            usage = _USAGE.setdefault(report.nodeid, Usage(report.nodeid))
            usage.cpu_s += value[0]
            usage.wall_s += value[1]


def scope_costs(usages: list[Usage], min_s: float = 1.0) -> dict[str, float]:
    """Wall seconds per xdist scope, the scopes of >= min_s, longest first."""
    costs: dict[str, float] = {}
    for usage in usages:
        costs[scope_of(usage.nodeid)] = costs.get(scope_of(usage.nodeid), 0.0) + usage.wall_s
    return {scope: round(cost, 1) for scope, cost in sorted(costs.items(), key=lambda kv: -kv[1]) if cost >= min_s}


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    path = config.getoption("write_scope_costs")
    if path and _USAGE and "PYTEST_XDIST_WORKER" not in os.environ:  # the controller has every worker's figures
        with open(path, "w") as out:
            json.dump(scope_costs(list(_USAGE.values())), out, indent=0)
            out.write("\n")
        terminalreporter.write_line(f"wrote the scopes' wall seconds to {path}")
    count = config.getoption("cpu_durations")
    if count is None or not _USAGE:
        return
    ranked = sorted(_USAGE.values(), key=lambda usage: usage.cpu_s, reverse=True)
    total_cpu = sum(usage.cpu_s for usage in ranked)
    total_wall = sum(usage.wall_s for usage in ranked)
    terminalreporter.write_sep("=", f"CPU seconds per test (pid {os.getpid()}, load {os.getloadavg()[0]:.2f})")
    terminalreporter.write_line(f"total: {total_cpu:.1f} CPU s, {total_wall:.1f} wall s over {len(ranked)} tests")
    for usage in ranked[:count] if count else ranked:
        terminalreporter.write_line(f"{usage.cpu_s:8.2f} cpu {usage.wall_s:8.2f} wall  {usage.nodeid}")

"""`pdserve up` on a CPU node gives prefill and decode workers disjoint cores (pdserve/cpu_split.py): the split,
the flags that override or disable it, bad CPU lists named, and a worker's --cpus pinning every thread of its
process (checked in a child process, so this test process keeps its own mask)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pdserve.commands import up
from tests.services.helpers import up_args, up_specs
from pdserve.cpu_split import format_cpu_list, parse_cpu_list, split_cpus


@pytest.mark.parametrize(("text", "cpus"), [("0", (0,)), ("0-3,6", (0, 1, 2, 3, 6)), ("3,1,1", (1, 3)),
                                            (" 2 - 3 ", (2, 3))])
def test_cpu_lists_parse(text: str, cpus: tuple[int, ...]) -> None:
    assert parse_cpu_list(text) == cpus
    assert parse_cpu_list(format_cpu_list(cpus)) == cpus


@pytest.mark.parametrize("text", ["", "a", "1,,2", "3-1", "-1", "1-x", "0-"])
def test_bad_cpu_lists_are_named(text: str) -> None:
    with pytest.raises(ValueError, match="bad CPU list"):
        parse_cpu_list(text)


def test_split_gives_decode_the_upper_half_rounded_up() -> None:
    assert split_cpus((0, 1)) == ((0,), (1,))
    assert split_cpus((5, 1, 3)) == ((1,), (3, 5))
    assert split_cpus(tuple(range(8))) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert split_cpus((0,)) is None


def test_up_pins_halves_by_default(monkeypatch) -> None:
    """Default on the CPU: --cpus for each role from this process's cores; the halves never overlap."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert up.cpu_pinning(up_args()) == (("--cpus", "0,1"), ("--cpus", "2,3"))


def test_up_split_overrides_and_off(monkeypatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert up.cpu_pinning(up_args(cpu_split=False)) == ((), ())
    assert up.cpu_pinning(up_args(decode_cpus="1-3")) == (("--cpus", "0,1"), ("--cpus", "1-3"))
    assert up.cpu_pinning(up_args(cpu_split=False, prefill_cpus="0")) == (("--cpus", "0"), ())
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert up.cpu_pinning(up_args()) == ((), ())  # one core: nothing to split


def test_up_split_is_not_for_gpus_and_bad_lists_fail_early() -> None:
    assert up.cpu_pinning(up_args(device="cuda")) == ((), ())
    with pytest.raises(ValueError, match="not --device cuda"):
        up.cpu_pinning(up_args(device="cuda", decode_cpus="1"))
    with pytest.raises(ValueError, match="bad CPU list"):
        up.cpu_pinning(up_args(prefill_cpus="0-"))


CHILD = """
import argparse, json, os, threading
from pdserve.commands.common import add_engine_arguments, pin_worker
started = threading.Event(); done = threading.Event()
worker = threading.Thread(target=lambda: (started.set(), done.wait()), daemon=True)
worker.start(); started.wait()  # a thread that exists before the pinning
parser = argparse.ArgumentParser(); add_engine_arguments(parser, 64)
args = parser.parse_args(["--cpus", os.environ["CPUS"]])
pin_worker(args)
masks = {task: sorted(os.sched_getaffinity(int(task))) for task in os.listdir("/proc/self/task")}
late = []
thread = threading.Thread(target=lambda: late.append(sorted(os.sched_getaffinity(0)))); thread.start(); thread.join()
done.set(); worker.join()
print(json.dumps({"masks": masks, "late": late[0], "threads": args.num_threads}))
"""


def _child(cpus: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "CPUS": cpus})


def test_worker_cpus_pin_every_thread_and_set_threads() -> None:
    """--cpus N: every thread of the worker process (one started before the pinning too, and one started after)
    runs on N only, and the torch thread count defaults to the number of pinned cores."""
    cpu = max(os.sched_getaffinity(0))
    result = _child(str(cpu))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(report["masks"]) >= 2
    assert all(mask == [cpu] for mask in report["masks"].values())
    assert report["late"] == [cpu]
    assert report["threads"] == 1


def test_worker_cpus_outside_the_mask_are_named() -> None:
    missing = max(os.sched_getaffinity(0)) + 64
    result = _child(str(missing))
    assert result.returncode != 0
    assert f"CPU(s) {missing} not available" in result.stderr


def test_up_lends_prefill_cores_to_one_decode_worker(monkeypatch) -> None:
    """Core lending (rpc/core_board.py) is on by default with the split: the decode workers may borrow the
    prefill workers' CPUs (several decode workers too: each gets its share in threads). Off with
    --no-core-lending, without the split, and with decode TP > 1 (followers are other processes)."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    specs = up_specs(monkeypatch, [[], ["--no-core-lending"], ["--no-cpu-split"], ["--num-decode", "2"],
                                   ["--decode-tp", "2"]])
    assert [spec.lend_cpus for spec in specs] == ["0,1", None, None, "0,1", None]
    assert specs[0].decode_args[-2:] == ("--cpus", "2,3")


def test_decode_worker_lending_settings_are_checked(tmp_path) -> None:
    from decode_worker.config import DecodeWorkerConfig

    with pytest.raises(ValueError, match="both --core-board and --borrow-cpus"):
        DecodeWorkerConfig.build(core_board=str(tmp_path / "board"), device="cpu")
    with pytest.raises(ValueError, match="TP 1"):
        DecodeWorkerConfig.build(core_board=str(tmp_path / "board"), borrow_cpus=(0,), device="cpu", tp_size=2)


def test_halves_by_name_are_ups_halves_and_nothing_below_two_cpus() -> None:
    """--cpus / --borrow-cpus prefill-half / decode-half (workers started without up: the compose profile)."""
    from pdserve.cpu_split import resolve_cpus

    assert resolve_cpus("prefill-half", (0, 1, 2, 3)) == (0, 1) and resolve_cpus("decode-half", (3, 2, 1, 0)) == (2, 3)
    assert resolve_cpus("decode-half", (4, 7, 5)) == split_cpus((4, 5, 7))[1] == (5, 7)
    assert resolve_cpus("0-1", (0,)) == (0, 1), "a list is a list: pin_process names CPUs outside the mask"
    assert resolve_cpus("prefill-half", (0,)) == resolve_cpus("decode-half", (0,)) == ()
    with pytest.raises(ValueError, match="bad CPU list"):
        resolve_cpus("upper-half", (0, 1))


def test_a_worker_given_halves_and_a_board_path_lends_like_up(monkeypatch, tmp_path) -> None:
    """board_for: the board is created at the path (zeroed, whole) by the first worker and reused by the next; with
    fewer than 2 CPUs a half leaves nothing to lend, so the worker runs without the board."""
    from pdserve.commands.common import board_for, borrow_cpus
    from rpc.core_board import BOARD_BYTES, CoreBoard

    path = str(tmp_path / "pdserve-cores")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert borrow_cpus("prefill-half") == (0, 1)
    assert board_for(path, "prefill-half", (0, 1)) == path
    with open(path, "rb") as board:
        assert board.read() == bytes(BOARD_BYTES)
    CoreBoard(path).set_busy(0, True)
    assert board_for(path, "decode-half", (2, 3)) == path
    assert CoreBoard(path).prefill_busy(), "the second worker reused the first one's board"
    assert sorted(os.listdir(tmp_path)) == ["pdserve-cores"], "no temporary board left behind"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert borrow_cpus("decode-half") == ()
    assert board_for(str(tmp_path / "other"), "decode-half", ()) is None
    assert not (tmp_path / "other").exists()
    assert board_for(path, None, ()) == path  # an explicit empty list is the config's to refuse, as before

"""benchmarks/machine_load.py: the CPU of processes outside a benchmark's own tree, apart from its own."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time

from benchmarks.machine_load import OtherLoad, own_cpu_seconds

SPIN = "import time\nstart = time.process_time()\nwhile time.process_time() - start < {seconds}: pass\n"


def test_a_descendants_cpu_counts_as_own_even_once_it_was_reaped():
    """A child that ran and was waited for is the benchmark's own CPU (children_user/system of its parent)."""
    before = own_cpu_seconds()
    subprocess.run([sys.executable, "-c", SPIN.format(seconds=0.4)], check=True)
    assert own_cpu_seconds() - before >= 0.35


def test_a_process_outside_the_tree_counts_as_other_load(tmp_path):
    """A process that is not a descendant (double-forked: its parent exits, it is re-parented) shows up in
    other_seconds() with at least most of the CPU it reports spending."""
    done = tmp_path / "done"
    script = textwrap.dedent(f"""
        import os, time
        if os.fork():
            os._exit(0)  # the intermediate parent exits: the spinner is nobody's child in our tree
        start = time.process_time()
        while time.process_time() - start < 0.5:
            pass
        with open({str(done)!r} + ".tmp", "w") as out:
            out.write(str(time.process_time()))
        os.rename({str(done)!r} + ".tmp", {str(done)!r})
    """)
    others = OtherLoad()
    subprocess.run([sys.executable, "-c", script], check=True)
    deadline = time.monotonic() + 120
    while not done.exists():  # poll for the file the spinner writes when it has finished
        assert time.monotonic() < deadline, "the outside process never finished"
        time.sleep(0.01)
    spent = float(done.read_text())
    assert spent >= 0.5
    assert others.other_seconds() >= 0.7 * spent

"""Host cost of one TP step plan's page tables: whole (pickled, unpickled by a follower) vs as deltas
(engine/runtime/page_table_sync.py: encode, pickle, unpickle, rebuild on the follower), per plain decode step.

Default: batch 64 x 10,240 pages (163,840 positions in 16-token pages, issue 35 item 3's DeepSeek-V3 figure), 4
sequences crossing a page boundary per step. Bytes are exact; times are host CPU on this machine (median of
--repeats interleaved rounds of --steps steps each, with spread, load and CPU flags). The gloo transfer itself is
not measured: it moves the bytes shown, to each follower.

    .venv/bin/python -m benchmarks.bench_tp_page_deltas [--batch 64] [--pages 10240] [--repeats 5]"""
from __future__ import annotations

import argparse
import os
import pickle
import statistics
import time

from benchmarks.common import cpu_flags
from engine.runtime.page_table_sync import PageTableReceiver, PageTableSender, from_wire, to_wire
from engine.runtime.step_plan import DecodeItem, decode_plan


def _steps(batch: int, pages: int, steps: int, crossing: int):
    """Plans of consecutive plain decode steps: every step `crossing` sequences gain a page."""
    keys = [f"request-{i:04d}" for i in range(batch)]
    tables = [list(range(i * pages, (i + 1) * pages)) for i in range(batch)]
    next_page = batch * pages
    for step in range(steps):
        for row in range(step * crossing, (step + 1) * crossing):
            tables[row % batch].append(next_page)
            next_page += 1
        items = [DecodeItem([7], len(pages_) * 16, pages_) for pages_ in tables]
        yield decode_plan(items, keys=keys)


def _whole(plans) -> tuple[float, int]:
    started, size = time.perf_counter(), 0
    for plan in plans:
        wire = pickle.dumps(plan)
        size += len(wire)
        pickle.loads(wire)
    return time.perf_counter() - started, size


def _deltas(plans, sender: PageTableSender, receiver: PageTableReceiver) -> tuple[float, int]:
    started, size = time.perf_counter(), 0
    for plan in plans:
        wire = pickle.dumps(to_wire(sender, plan))
        size += len(wire)
        from_wire(receiver, pickle.loads(wire))
    return time.perf_counter() - started, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--pages", type=int, default=10_240)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--crossing", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"batch {args.batch} x {args.pages} pages, {args.crossing} sequences gain a page per step, "
          f"{args.steps} steps per round, {args.repeats} interleaved rounds; CPU flags: {cpu_flags()}; "
          f"load average before: {os.getloadavg()}")
    whole_ms, delta_ms, sizes = [], [], None
    for _ in range(args.repeats):
        plans = list(_steps(args.batch, args.pages, args.steps + 1, args.crossing))
        sender, receiver = PageTableSender(), PageTableReceiver()
        _deltas(plans[:1], sender, receiver)  # the first plan sends every row whole (a reset)
        seconds, whole_bytes = _whole(plans[1:])
        whole_ms.append(seconds * 1e3 / args.steps)
        seconds, delta_bytes = _deltas(plans[1:], sender, receiver)
        delta_ms.append(seconds * 1e3 / args.steps)
        sizes = (whole_bytes // args.steps, delta_bytes // args.steps)
    for name, values in (("whole tables", whole_ms), ("deltas", delta_ms)):
        print(f"{name:>12}: {statistics.median(values):8.3f} ms per step (min {min(values):.3f}, max {max(values):.3f})")
    ratios = [w / d for w, d in zip(whole_ms, delta_ms)]
    print(f"bytes per step: whole {sizes[0]:,} B, deltas {sizes[1]:,} B ({sizes[0] / sizes[1]:,.0f}x fewer); host time "
          f"ratio whole / deltas: median {statistics.median(ratios):.1f}x (min {min(ratios):.1f}, max {max(ratios):.1f})")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()

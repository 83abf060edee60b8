"""Cost of exact KDA rollback in speculative decoding (K3_SPEC 5.1, snapshot path): the scratch a verify step
needs per running request and the time of the commit (copying each request's accepted position into its slot).

State geometry: Kimi K3 at attention-TP 8 by default (69 KDA layers, 12 local heads, K = V = 128, fp32
recurrent state, conv window 3 x 4608 in --conv-dtype). The commit is StatePool.commit_snapshots for --seqs
running requests of a --block verify step; samples are interleaved with a plain slot copy of the same bytes
(the floor) and reported as medians with spread and the load average.

Run: PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_spec_state.py [--seqs 1] [--block 8] [--repeats 7]
     [--device cpu|cuda]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from benchmarks.common import interleave, machine_description
from engine.cache.state_pool import StatePool, StateShape

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=69)
    parser.add_argument("--heads", type=int, default=12, help="KDA heads on this rank (96 / TP)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--conv-dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--seqs", type=int, default=1)
    parser.add_argument("--block", type=int, default=8, help="verify positions (gamma + 1)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shape = StateShape(num_kda_layers=args.layers, num_slots=args.seqs + 1, conv_width=3,
                       conv_channels=3 * args.heads * args.head_dim, num_heads=args.heads, head_k_dim=args.head_dim,
                       head_v_dim=args.head_dim, conv_dtype=DTYPES[args.conv_dtype], ssm_dtype=torch.float32)
    pool = StatePool(shape, device=args.device)
    pool.begin_snapshots(args.seqs, args.block)
    slots, steps = list(range(args.seqs)), [(3 * i + 2) % args.block for i in range(args.seqs)]
    source = torch.randint(0, args.seqs, (args.seqs,), device=args.device)
    target = torch.arange(args.seqs, device=args.device)

    def sync() -> None:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    def timed(fn):
        def run() -> dict[str, float]:
            sync()
            start = time.perf_counter()
            fn()
            sync()
            return {"ms": 1e3 * (time.perf_counter() - start)}
        return run

    def plain_copy() -> None:
        pool.conv.index_copy_(1, target, pool.conv.index_select(1, source))
        pool.recurrent.index_copy_(1, target, pool.recurrent.index_select(1, source))

    results = interleave({"commit_snapshots": timed(lambda: pool.commit_snapshots(slots, steps)),
                          "slot copy (floor)": timed(plain_copy)}, args.repeats)
    print("# KDA speculative-verify state: scratch and commit\n")
    print(f"machine: {machine_description()}  ")
    print(f"device: {args.device}; load average {os.getloadavg()}  ")
    print(f"state per slot: {shape.bytes_per_slot:,} B; verify scratch per running request at block {args.block}: "
          f"{pool.snapshot_bytes_per_seq(args.block):,} B ({pool.snapshot_bytes_per_seq(args.block) / 2**20:.1f} MiB)\n")
    print("| variant | seqs | median ms | min | max |\n|---|---|---|---|---|")
    for name, samples in results.items():
        values = [s["ms"] for s in samples]
        print(f"| {name} | {args.seqs} | {statistics.median(values):.3f} | {min(values):.3f} | {max(values):.3f} |")


if __name__ == "__main__":
    main()

"""Routed-experts MoE paths side by side: the per-expert loop, the grouped active-experts torch path, the
dense all-experts path and (on a GPU) the fused Triton kernel, at the shapes that matter:

  tiny     the embedded model (hidden 192, intermediate 128, 8 experts top-2)
  85m      the 85M-parameter DeepSeek-V3-shaped checkpoint of issue 18 (hidden 1024, 512, 8 experts top-2)
  e64      64 experts top-6 (hidden 2048, intermediate 256: the ~1B GPU benchmark checkpoint's MoE)

Each cell is the median over --repeats interleaved rounds of the ms per call (spread = (max - min) /
median). The `dense?` column is engine.kernels.moe_torch.use_dense_moe's choice, so the table shows
whether the written-down threshold picks the faster path. On CPU the ratios compare this process's CPU
time (with --threads 1 that is the work a path costs, whatever the neighbours on a shared machine do);
wall time is shown beside it. Every path's output is checked against the loop
first. GPU goal (issue 12): fused >= 3x the per-expert loop at 64 experts, top-6, batch 64.

Run: .venv/bin/python benchmarks/bench_moe.py [--device cpu|cuda] [--shapes tiny,85m,e64] [--fp8] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import Table, goal_line, interleave, machine_description
from engine.kernels.fp8_quant import dequantize_fp8_block, quantize_fp8_block
from engine.kernels.moe_torch import moe_dense, moe_grouped, moe_loop, use_dense_moe

SHAPES = {"tiny": (192, 128, 8, 2), "85m": (1024, 512, 8, 2), "e64": (2048, 256, 64, 6)}
DENSE_LIMIT_MACS = 2**33  # the dense path is not timed above this (seconds per call on CPU)


def make_case(shape: str, tokens: int, device: torch.device, dtype: torch.dtype, seed: int):
    hidden, inter, experts, top_k = SHAPES[shape]
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=generator).to(device, dtype)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=generator) / hidden**0.5).to(device, dtype)
    down = (torch.randn(experts, hidden, inter, generator=generator) / inter**0.5).to(device, dtype)
    scores = torch.rand(tokens, experts, generator=generator)
    weights, ids = scores.topk(top_k, dim=-1)
    return x, gate_up, down, weights.to(device), ids.to(device)


def fp8_experts(case: tuple) -> tuple[tuple, dict[str, torch.Tensor]]:
    """The case with its experts rounded to 128x128-block FP8 (so every path sees the same weights) and
    the FP8 tensors + scales the fused FP8 path reads."""
    x, gate_up, down, weights, ids = case
    stored: dict[str, torch.Tensor] = {}
    rounded = []
    for name, tensor in (("gate_up", gate_up), ("down", down)):
        pairs = [quantize_fp8_block(expert) for expert in tensor]
        stored[name] = torch.stack([q for q, _ in pairs])
        stored[name + "_scale"] = torch.stack([scale for _, scale in pairs])
        rounded.append(dequantize_fp8_block(stored[name], stored[name + "_scale"], dtype=tensor.dtype))
    return (x, rounded[0], rounded[1], weights, ids), stored


def paths(device: torch.device, fp8: dict[str, torch.Tensor] | None) -> dict[str, Callable]:
    found: dict[str, Callable] = {"loop": moe_loop, "grouped": moe_grouped, "dense": moe_dense}
    if device.type == "cuda":
        from engine.kernels.fused_moe import fused_moe

        found["fused"] = fused_moe
        if fp8 is not None:
            found["fused-fp8"] = lambda x, gate_up, down, weights, ids: fused_moe(
                x, fp8["gate_up"], fp8["down"], weights, ids, gate_up_scale=fp8["gate_up_scale"],
                down_scale=fp8["down_scale"])
    return found


def timer(device: torch.device, function: Callable, case: tuple, calls: int) -> Callable[[], dict[str, float]]:
    def run() -> dict[str, float]:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start, cpu_start = time.perf_counter(), time.process_time()
        for _ in range(calls):
            function(*case)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return {"ms": 1e3 * (time.perf_counter() - start) / calls,
                "cpu_ms": 1e3 * (time.process_time() - cpu_start) / calls}
    return run


def bench_shape(args, shape: str, device: torch.device, dtype: torch.dtype) -> list[dict]:
    hidden, inter, experts, top_k = SHAPES[shape]
    key = args.clock
    table = Table(f"{shape}: hidden {hidden}, intermediate {inter}, {experts} experts top-{top_k}, {dtype}",
                  ["tokens", "path", "wall ms", "cpu ms", f"{key} spread", "vs loop", "vs grouped", "dense?"])
    rows = []
    for tokens in args.tokens:
        case, fp8 = make_case(shape, tokens, device, dtype, args.seed), None
        if args.fp8 and device.type == "cuda":
            case, fp8 = fp8_experts(case)
        chosen = {name: fn for name, fn in paths(device, fp8).items()
                  if name != "dense" or tokens * experts * 3 * hidden * inter <= DENSE_LIMIT_MACS}
        reference = moe_loop(*case)
        for name, function in chosen.items():
            error = (function(*case) - reference).abs().max().item()
            if error > args.tolerance * max(reference.abs().max().item(), 1.0):
                raise AssertionError(f"{shape} tokens={tokens}: path {name} differs from the loop by {error}")
        calls = max(1, args.calls // max(1, tokens // 16))
        samples = interleave({name: timer(device, fn, case, calls) for name, fn in chosen.items()}, args.repeats)
        medians = {name: statistics.median(s[key] for s in runs) for name, runs in samples.items()}
        for name, runs in samples.items():
            times = [s[key] for s in runs]
            spread = (max(times) - min(times)) / medians[name]
            row = {"shape": shape, "tokens": tokens, "path": name, "clock": key, "ms": medians[name],
                   "wall_ms": statistics.median(s["ms"] for s in runs),
                   "cpu_ms": statistics.median(s["cpu_ms"] for s in runs), "spread": spread,
                   "dense_chosen": use_dense_moe(tokens, experts, hidden, inter)}
            rows.append(row)
            table.add(tokens, name, row["wall_ms"], row["cpu_ms"], f"{spread:.0%}", medians["loop"] / medians[name],
                      medians["grouped"] / medians[name], "yes" if row["dense_chosen"] else "no")
    table.print()
    if device.type == "cuda" and shape == "e64" and 64 in args.tokens:
        fused = next(r["ms"] for r in rows if r["tokens"] == 64 and r["path"] == "fused")
        loop = next(r["ms"] for r in rows if r["tokens"] == 64 and r["path"] == "loop")
        print(goal_line("fused MoE vs per-expert loop, 64 experts top-6 batch 64", loop / fused, 3.0) + "\n")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (GPU default)")
    parser.add_argument("--shapes", default="tiny,85m,e64")
    parser.add_argument("--tokens", default="1,4,16,64", help="comma-separated tokens per step")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20, help="calls per timed sample (fewer for many tokens)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default=None,
                        help="what the ratios compare: wall time (GPU default) or this process's CPU time (CPU "
                             "default: on a shared machine it is what the path costs, not what the neighbours do)")
    parser.add_argument("--tolerance", type=float, default=None)
    parser.add_argument("--fp8", action="store_true", help="GPU: also time the fused path on FP8 experts (128x128 "
                                                            "block scales; every path then uses FP8-rounded weights)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.float32 if device.type == "cpu" else torch.bfloat16)
    args.clock = {"wall": "ms", "cpu": "cpu_ms"}[args.clock or ("cpu" if device.type == "cpu" else "wall")]
    args.tolerance = args.tolerance or (1e-4 if dtype == torch.float32 else 3e-2)
    args.tokens = [int(t) for t in args.tokens.split(",")]
    torch.set_num_threads(args.threads)
    print("# MoE paths\n")
    print(f"machine: {machine_description()}  ")
    print(f"device: {device}, repeats: {args.repeats} (interleaved; medians), tokens: {args.tokens}\n", flush=True)
    rows = [row for shape in args.shapes.split(",") for row in bench_shape(args, shape, device, dtype)]
    if args.json:
        args.json.write_text(json.dumps({"machine": machine_description(), "device": str(device),
                                         "dtype": str(dtype), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()

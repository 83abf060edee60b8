"""Per-step costs on one device, side by side in one run (interleaved repetitions, medians):

  spec vs plain   one speculative decode step (draft + verify) of the embedded model against one plain
                  decode step, same batch (goal on a GPU: spec step <= 1.3x a plain step; a CPU cannot
                  judge it: an 8-row verify is compute-bound there)
  K3 tiny         decode tok/s of the embedded Kimi K3 model with CUDA graphs asked for and without, and
                  how many of its decode and verify steps replayed a graph
  host syncs      synchronising CUDA calls per plain greedy decode step (torch.cuda.set_sync_debug_mode
                  warnings: .item(), .tolist(), .cpu(), nonzero, blocking copies); goal <= 1 (the step's
                  one fetch of sampled ids). CPU: not measurable, reported as such.

    python benchmarks/bench_gpu_steps.py [--device cuda] [--batch 16] [--json F] [--md F]"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
import warnings
from pathlib import Path

import torch

from benchmarks.common import goal_line
from engine.paths import DSV3_MODEL_DIR, K3_MODEL_DIR

logger = logging.getLogger("bench_gpu_steps")


def _start(engine, batch: int, params, tag: str) -> list[str]:
    """Adds `batch` requests and steps until every one has its first token (prefill done)."""
    ids = [f"{tag}-{time.monotonic_ns()}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, [3 + i % 50, 7, 11, 13, 17, 19], params)
    started: set[str] = set()
    while len(started) < len(ids):
        started.update(out.request_id for out in engine.step() if out.new_token_ids)
    return ids


def _finish(engine, ids: list[str]) -> None:
    for rid in ids:
        engine.abort(rid)
    while engine.has_work():
        engine.step()


def _decode_step_times(engine, batch: int, params, steps: int) -> list[float]:
    """Starts `batch` requests, times `steps` decode steps (each ends with its fetch of sampled ids: synced)."""
    ids = _start(engine, batch, params, "steps")
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    _finish(engine, ids)
    return times


def spec_vs_plain(device: str, batch: int, steps: int, repeats: int) -> dict:
    from engine.engine_config import EngineConfig
    from engine.runtime.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model_dir=str(DSV3_MODEL_DIR), device=device, use_graphs=device == "cuda",
                                    kv_memory_bytes=256 * 2**20, max_running=max(batch, 1)))
    try:
        variants = {"spec": SamplingParams(max_new_tokens=10_000, ignore_eos=True, speculative=True),
                    "plain": SamplingParams(max_new_tokens=10_000, ignore_eos=True, speculative=False)}
        samples: dict[str, list[float]] = {name: [] for name in variants}
        for round_index in range(repeats + 1):  # round 0 warms up (graphs, Triton compiles)
            order = list(variants) if round_index % 2 == 0 else list(reversed(variants))
            for name in order:
                times = _decode_step_times(engine, batch, variants[name], steps)
                if round_index:
                    samples[name].append(statistics.median(times))
    finally:
        engine.close()
    spec, plain = (statistics.median(samples[n]) for n in ("spec", "plain"))
    return {"batch": batch, "spec_step_ms": 1e3 * spec, "plain_step_ms": 1e3 * plain, "spec_over_plain": spec / plain,
            "spec_samples_ms": [1e3 * s for s in samples["spec"]], "plain_samples_ms": [1e3 * s for s in samples["plain"]]}


def k3_tiny(device: str, batches: list[int], new_tokens: int, repeats: int) -> dict:
    from benchmarks.common import timed_generate
    from engine.engine_config import EngineConfig
    from engine.runtime.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    results: dict = {}
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    for graphs in (True, False):
        engine = LLMEngine(EngineConfig(model_dir=str(K3_MODEL_DIR), device=device, use_graphs=graphs and device == "cuda",
                                        kv_memory_bytes=256 * 2**20, max_running=max(batches)))
        replays = [0]
        runner = engine.runner if hasattr(engine, "runner") else None
        captured = getattr(runner, "graphs", None)
        if captured is not None:
            original = captured.run_target

            def counted(plan, original=original):
                logits = original(plan)
                replays[0] += logits is not None
                return logits

            captured.run_target = counted
        try:
            for batch in batches:
                prompts = [[3 + (i * 7 + j) % 200 for j in range(8)] for i in range(batch)]
                timed_generate(engine, prompts, params)  # warm-up
                rates = [timed_generate(engine, prompts, params).metrics()["decode_tok_s"] for _ in range(repeats)]
                results.setdefault(batch, {})["graphs" if graphs else "eager"] = statistics.median(rates)
        finally:
            engine.close()
        results[f"replays_{'graphs' if graphs else 'eager'}"] = replays[0]
    return results


def host_syncs_per_plain_step(device: str, batch: int, steps: int) -> dict:
    """Synchronising CUDA calls per plain greedy decode step (torch's sync debug mode counts them)."""
    if device != "cuda":
        return {"syncs_per_step": None, "note": "needs a GPU (torch.cuda.set_sync_debug_mode)"}
    from engine.engine_config import EngineConfig
    from engine.runtime.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model_dir=str(DSV3_MODEL_DIR), device=device, use_graphs=True,
                                    kv_memory_bytes=256 * 2**20, draft_model_dir="", max_running=batch))
    params = SamplingParams(max_new_tokens=10_000, ignore_eos=True)
    try:
        _decode_step_times(engine, batch, params, 3)  # warm-up
        ids = _start(engine, batch, params, "syncs")
        counts, places = [], {}
        for _ in range(steps):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    engine.step()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
            counts.append(len(syncs))
            for w in syncs:
                key = f"{Path(w.filename).name}:{w.lineno}"
                places[key] = places.get(key, 0) + 1
        _finish(engine, ids)
    finally:
        engine.close()
    return {"syncs_per_step": statistics.median(counts), "counts": counts, "where": places}


def render(results: dict, device_name: str) -> tuple[str, list[str]]:
    lines = [f"Per-step costs on {device_name}", ""]
    spec = results["spec_vs_plain"]
    lines.append(f"- spec step {spec['spec_step_ms']:.2f} ms vs plain step {spec['plain_step_ms']:.2f} ms at batch "
                 f"{spec['batch']}: {spec['spec_over_plain']:.2f}x")
    for key, value in results["k3_tiny"].items():
        lines.append(f"- K3 tiny {key}: {value}")
    syncs = results["host_syncs"]
    lines.append(f"- host syncs per plain decode step: {syncs.get('syncs_per_step')} {syncs.get('where', syncs.get('note', ''))}")
    goals = [goal_line("spec step vs plain step", spec["spec_over_plain"], 1.3, higher_is_better=False)]
    if syncs.get("syncs_per_step") is not None:
        goals.append(goal_line("host syncs per plain decode step", syncs["syncs_per_step"], 1.0, unit="",
                               higher_is_better=False))
    return "\n".join(lines) + "\n", goals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--k3-batches", default="1,16")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--md", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    results = {
        "spec_vs_plain": spec_vs_plain(args.device, args.batch, args.steps, args.repeats),
        "k3_tiny": k3_tiny(args.device, [int(b) for b in args.k3_batches.split(",")], args.new_tokens, args.repeats),
        "host_syncs": host_syncs_per_plain_step(args.device, args.batch, args.steps),
    }
    markdown, goals = render(results, device_name)
    print(markdown + "\n".join(goals), flush=True)
    if args.json:
        args.json.write_text(json.dumps({**results, "goals": goals, "device": device_name}, indent=2, default=str))
    if args.md:
        args.md.write_text(markdown + "\n" + "\n".join(f"- {g}" for g in goals) + "\n")


if __name__ == "__main__":
    main()

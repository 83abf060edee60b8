"""The CPU packed linear (engine/kernels/cpu_linear.py) on vs off, in one engine, taking turns.

Variants, each on the held-out prompts (greedy, eos ignored): single stream with speculation off ("plain")
and on (its verify forwards multiply block-size rows: the packed path's case), and a batch of 16 with
speculation off (16-row decode steps). "packed" and "F.linear" runs of each alternate within one process,
switching cpu_linear.AVAILABLE, so the machine's drift cancels in the per-round ratios. Reported: tok/s
(median (min..max) of --repeats rounds), the per-round packed / F.linear ratio, CPU-time ratio (the engine
thread's, at 1 torch thread all of the engine's work), whether outputs are identical, and the load.

Run: OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.bench_packed_linear --threads 1 --repeats 5
"""
from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.common import Table, add_common_arguments, interleave, load_note, median, paired, print_header
from benchmarks.prompts import held_out_prompts
from engine import LLM, SamplingParams
from engine.kernels import cpu_linear


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser, repeats=5)
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts per single-stream run")
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.prompts, args.new_tokens = 1, 2, 16
    print_header("bench_packed_linear: oneDNN packed few-row linears vs F.linear (in process)", args)
    if not cpu_linear.AVAILABLE:
        raise SystemExit("this torch build has no oneDNN linear ops (or PDSERVE_CPU_PACKED_LINEAR=0)")
    llm = LLM(str(args.model), device="cpu", num_threads=args.threads, max_running=16)
    config = llm.model_config
    bench, source = held_out_prompts(args.model, max(16, args.prompts), 64, config.vocab_size,
                                     list(config.eos_token_id), args.seed)
    prompts = [p.token_ids for p in bench]
    outputs: dict[str, list[list[int]]] = {}

    def run(name: str, packed: bool, speculative: bool, batch: int):
        params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True, speculative=speculative)
        chosen = prompts[:16] if batch > 1 else prompts[: args.prompts]

        def once() -> dict[str, float]:
            cpu_linear.AVAILABLE = packed
            try:
                start, cpu = time.perf_counter(), time.thread_time()
                results = ([llm.generate([p], params)[0] for p in chosen] if batch == 1 else llm.generate(chosen, params))
                wall, cpu = time.perf_counter() - start, time.thread_time() - cpu
            finally:
                cpu_linear.AVAILABLE = True
            outputs[name] = results
            tokens = sum(len(r) for r in results)
            return {"tok_s": tokens / wall, "cpu_tok_s": tokens / cpu}
        return once

    cases = (("single stream, spec off", False, 1), ("single stream, spec on", True, 1), ("batch 16, spec off", False, 16))
    table = Table(f"packed vs F.linear, {args.new_tokens} new tokens ({source}); median (min..max) of {args.repeats} "
                  "interleaved rounds", ["case", "F.linear tok/s", "packed tok/s", "packed / F.linear (per round)",
                                         "CPU-time ratio (per round)", "identical", "load"])
    for label, speculative, batch in cases:
        variants = {f"{label} F.linear": run(f"{label} F.linear", False, speculative, batch),
                    f"{label} packed": run(f"{label} packed", True, speculative, batch)}
        runs = interleave(variants, args.repeats)
        plain, packed = runs[f"{label} F.linear"], runs[f"{label} packed"]
        same = outputs[f"{label} F.linear"] == outputs[f"{label} packed"]
        table.add(label, median(plain, "tok_s"), median(packed, "tok_s"), _ratios(paired(packed, plain, "tok_s")),
                  _ratios(paired(packed, plain, "cpu_tok_s")), "yes" if same else "NO", load_note(runs))
        print(f"{label} done", flush=True)
    print()
    table.print()
    llm.close()


def _ratios(values: list[float]) -> str:
    return f"{statistics.median(values):.3f}x ({min(values):.3f}..{max(values):.3f})"


if __name__ == "__main__":
    main()

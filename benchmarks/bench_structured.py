"""Structured outputs' cost: decode throughput with a JSON-schema grammar vs unconstrained, in process, on one
LLM (issue 36, benchmark: goal constrained >= 90% of unconstrained).

For each concurrency (requests decoding together) and speculation setting the two variants take turns
(interleave(): alternating order each round, one unrecorded warm-up each): "free" (no grammar) and "json" (a
schema of an unbounded array of small objects, so the grammar never completes before max_new_tokens and both
variants decode the same number of tokens). Both ignore eos and sample at temperature 1 with fixed seeds.
Reported per variant: decode tok/s (decode steps only: every request already has its first token) and CPU ms per
generated token (the whole process, prefill included: the grammar masks run on a helper thread during the forward,
so the engine thread's own CPU time would miss them; a shared machine disturbs CPU time far less than wall time),
medians with (min..max); and the paired per-round ratios json / free (tok/s) and free / json (CPU per token). With
speculation the acceptance differs between the two texts (the grammar picks the drafts), so those rows measure
the whole effect, not only the mask's cost.

Run: .venv/bin/python -m benchmarks.bench_structured [--model DIR] [--quick]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from benchmarks.common import (Table, add_common_arguments, goal_line, interleave, load_note, median, paired,
                               print_header, spread, timed_groups)
from benchmarks.prompts import held_out_prompts
from engine import LLM, SamplingParams

SCHEMA = {"type": "array", "minItems": 1000, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 16}, "size": {"type": "integer"},
                                     "kind": {"enum": ["file", "dir", "link"]}},
    "required": ["name", "size", "kind"], "additionalProperties": False}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser, repeats=5)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompts-per-run", type=int, nargs="+", default=[4, 16],
                        help="prompts each run decodes, per concurrency (in groups of the concurrency)")
    parser.add_argument("--speculative", choices=["off", "on", "both"], default="both")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.new_tokens = 2, 16
    print_header("Structured outputs: constrained vs unconstrained decode throughput", args)
    specs = {"off": [False], "on": [None], "both": [False, None]}[args.speculative]
    with LLM(str(args.model), attention_backend="torch") as llm:
        held_out, source = held_out_prompts(args.model, max(args.prompts_per_run), 32, llm.model_config.vocab_size)
        prompts = [list(p.token_ids) for p in held_out]
        print(f"prompts: {source}\n")
        table = Table("decode throughput, json schema vs free text", [
            "concurrency", "speculation", "variant", "decode tok/s", "CPU ms/token", "json/free tok/s",
            "free/json CPU", "acceptance"])
        ratios: list[float] = []
        all_runs = {}
        for concurrency, count in zip(args.concurrency, args.prompts_per_run):
            for speculative in specs:
                variants = {name: _variant(llm, prompts[:count], concurrency, args.new_tokens, grammar, speculative)
                            for name, grammar in (("free", None), ("json", json.dumps(SCHEMA)))}
                runs = interleave(variants, args.repeats)
                all_runs.update({f"{concurrency}/{speculative}/{name}": samples for name, samples in runs.items()})
                speed = paired(runs["json"], runs["free"], "decode_tok_s")
                cpu = paired(runs["free"], runs["json"], "cpu_ms_per_token")  # free/json CPU: higher is better
                ratios.append(statistics.median(speed))
                for name, samples in runs.items():
                    table.add(concurrency, "on" if speculative is None else "off", name,
                               spread([s["decode_tok_s"] for s in samples]),
                               spread([s["cpu_ms_per_token"] for s in samples]),
                               spread(speed, 100, "%") if name == "json" else "",
                               spread(cpu, 100, "%") if name == "json" else "",
                               f"{median(samples, 'acceptance'):.2f}" if speculative is None else "-")
        print(table.render())
        print(f"\nload averages at the end of the runs: {load_note(all_runs)}")
        print(goal_line("json/free decode tok/s (worst median)", min(ratios) * 100, 90, unit="%"))


def _variant(llm: LLM, prompts: list[list[int]], concurrency: int, new_tokens: int, grammar: str | None,
             speculative: bool | None):
    def run() -> dict[str, float]:
        stats = llm.acceptance_stats
        before = (stats.num_accepted_drafts, stats.num_drafts)
        params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=0, ignore_eos=True,
                                speculative=speculative,
                                structured_output=("json_schema", grammar) if grammar is not None else None)
        cpu = time.process_time()
        run = timed_groups(llm.engine, prompts, params, concurrency)
        metrics = run.metrics()
        metrics["cpu_ms_per_token"] = 1e3 * (time.process_time() - cpu) / max(1, run.new_tokens)
        drafts = stats.num_drafts - before[1]
        metrics["acceptance"] = (stats.num_accepted_drafts - before[0]) / drafts if drafts else 0.0
        return metrics

    return run


if __name__ == "__main__":
    main()

"""Small-weight CPU linears through the transposed copy (engine/kernels/cpu_linear.py, the default) or not, on
the K3 default model's speculation, in one process: the two settings take turns over --repeats rounds (order
reversed every other round), each round generating the held-out prompts single stream with speculation off and
on (verify block --block). Reported per setting: plain and speculative tok/s (medians) and the speed-up, with
its per-round spread. The setting only changes which matmul routine runs, so outputs are checked equal.

Run: OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.bench_linear_layout [--repeats 6] [--block 4]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from benchmarks.bench_k3_spec import K3_DEFAULT
from benchmarks.common import machine_description
from benchmarks.prompts import held_out_prompts
from engine import LLM, SamplingParams
from engine.kernels import cpu_linear


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(K3_DEFAULT))
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--block", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    print(f"# Transposed small-weight linears on vs off, K3 speculation in process\n\n{machine_description()}\n")
    llm = LLM(args.model, device="cpu", num_threads=1, max_running=1, spec_block_size=args.block)
    config = llm.model_config
    prompts = [p.token_ids for p in held_out_prompts(args.model, args.prompts, 64, config.vocab_size,
                                                     list(config.eos_token_id), 0)[0]]
    params = {speculative: SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True,
                                          speculative=speculative, block_size=args.block if speculative else None)
              for speculative in (False, True)}
    settings = {"transposed": cpu_linear.TRANSPOSED_MAX_BYTES, "F.linear / packed only": 0}
    seconds = {(name, spec): [] for name in settings for spec in (False, True)}
    outputs = {}

    def run(name: str, speculative: bool, record: bool) -> None:
        cpu_linear.TRANSPOSED_MAX_BYTES = settings[name]
        started = time.perf_counter()
        texts = [llm.generate([prompt], params[speculative])[0] for prompt in prompts]
        if record:
            seconds[(name, speculative)].append(time.perf_counter() - started)
        outputs[(name, speculative)] = texts

    names = list(settings)
    for round_index in range(args.repeats + 1):  # round 0: warm-up
        for name in names if round_index % 2 == 0 else reversed(names):
            for speculative in (False, True):
                run(name, speculative, round_index > 0)
    cpu_linear.TRANSPOSED_MAX_BYTES = settings["transposed"]
    tokens = args.prompts * args.new_tokens
    print(f"| linears | plain tok/s | speculative tok/s (B={args.block}) | speed-up, median (per-round min..max) |")
    print("|---|---:|---:|---:|")
    for name in names:
        plain, spec = seconds[(name, False)], seconds[(name, True)]
        ratios = [a / b for a, b in zip(plain, spec)]
        print(f"| {name} | {tokens / statistics.median(plain):.0f} | {tokens / statistics.median(spec):.0f} | "
              f"{statistics.median(plain) / statistics.median(spec):.2f}x ({min(ratios):.2f}..{max(ratios):.2f}) |")
    same = all(outputs[(name, spec)] == outputs[(names[0], False)] for name in names for spec in (False, True))
    print(f"\noutputs identical across settings and speculation: {same}; load average {os.getloadavg()[0]:.1f}")
    llm.close()


if __name__ == "__main__":
    main()

"""K3 default model (pdserve-k3-tiny) decode throughput at batch 1 and 16, in process, with the MXFP4 experts'
kept decoded copy on (the default) against off (PDSERVE_MXFP4_DECODED_MB=0: every expert matmul decodes its
weights again, the pre-cache behaviour of the per-expert path), taking turns in one process.

Per variant and batch: one closed-loop generate of `batch` held-out prompts (greedy, ignore eos, speculation
off), after an unrecorded warm-up; reported: median (min..max) over --repeats interleaved rounds of decode tok/s
(wall, decode steps only), the engine thread's CPU ms per decoded token (the steadier figure on a shared
machine), prefill ms (the whole generate minus decode), the per-round on/off ratio, and whether the outputs are
identical (they must be: decoding is elementwise). Load average, other processes' CPU and CPU flags are printed.

Run: OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.bench_k3_batch [--repeats 5] [--batches 1 16]
     [--prompt-len 64] [--new-tokens 64]
"""
from __future__ import annotations

import argparse
import os
import statistics

from benchmarks.common import (REPO_ROOT, Table, interleave, load_note, median, paired, print_header, spread,
                               timed_generate)
from benchmarks.prompts import held_out_prompts
from engine import LLM
from engine.layers import mxfp4
from engine.sampling_params import SamplingParams

K3_DEFAULT = REPO_ROOT / "models" / "pdserve-k3-tiny"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(K3_DEFAULT))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print_header("bench_k3_batch: K3 default model decode, MXFP4 decoded copy on vs off (in process)", args)
    print(f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '-')}\n")
    llm = LLM(args.model, device="cpu", num_threads=args.threads, max_running=max(args.batches))
    config = llm.model_config
    bench_prompts, source = held_out_prompts(args.model, max(args.batches), args.prompt_len, config.vocab_size,
                                             list(config.eos_token_id), args.seed)
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True, speculative=False)
    cap = mxfp4.DEQUANT_CACHE_MAX_BYTES
    table = Table(f"K3 default model, prompt {args.prompt_len} + {args.new_tokens} new tokens ({source}), greedy, "
                  f"{args.threads} thread(s), median (min..max) of {args.repeats} interleaved rounds",
                  ["batch", "variant", "decode tok/s", "CPU ms / token", "prefill ms", "on/off decode tok/s",
                   "identical", "load"])
    for batch in args.batches:
        prompts = [p.token_ids for p in bench_prompts[:batch]]
        outputs: dict[str, list[list[int]]] = {}

        def variant(name: str, cap_bytes: int):
            def run() -> dict[str, float]:
                mxfp4.DEQUANT_CACHE_MAX_BYTES = cap_bytes
                try:
                    timed = timed_generate(llm.engine, prompts, params)
                finally:
                    mxfp4.DEQUANT_CACHE_MAX_BYTES = cap
                outputs[name] = timed.outputs
                metrics = timed.metrics()
                metrics["prefill_ms"] = 1e3 * (timed.total_s - timed.decode_s)
                return metrics
            return run

        runs = interleave({"decoded copy": variant("decoded copy", cap), "decode per call": variant("decode per call", 0)},
                          args.repeats)
        ratios = paired(runs["decoded copy"], runs["decode per call"], "decode_tok_s")
        same = outputs["decoded copy"] == outputs["decode per call"]
        for name, samples in runs.items():
            table.add(batch, name, spread([s["decode_tok_s"] for s in samples]),
                      spread([s["decode_cpu_ms_per_token"] for s in samples]),
                      spread([s["prefill_ms"] for s in samples]),
                      spread(ratios, unit="x") if name == "decoded copy" else "", same, load_note(runs))
        print(f"batch {batch}: decoded copy {median(runs['decoded copy'], 'decode_tok_s'):.1f} tok/s, per-call "
              f"{median(runs['decode per call'], 'decode_tok_s'):.1f} tok/s, ratio median "
              f"{statistics.median(ratios):.2f}x", flush=True)
    print()
    table.print()
    print(f"load average at the end: {os.getloadavg()[0]:.1f} (1 min), {os.getloadavg()[1]:.1f} (5 min)")
    llm.close()


if __name__ == "__main__":
    main()

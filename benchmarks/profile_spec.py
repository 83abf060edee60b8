"""The speculative step split (issue 18 item 4): where a draft + verify + commit step's time goes, next to a
plain decode step, at batch 1, in process.

For each model (default: the K3 default model and the DeepSeek-V3 tiny model, each with its draft/) one
prompt of held-out Python is generated greedily, speculation off ("plain") and on at each --blocks size, the
variants taking turns (interleaved, order alternating each round) after one unrecorded warm-up each. Inside
every pure decode step the engine's pieces are timed by wrapping their methods:

  draft fwd     ModelRunner.forward_draft (the draft network + LM head: model maths)
  draft host    ModelRunner.run_draft minus forward_draft (draft inputs: context slots, the H2D copy)
  propose rest  LLMEngine._propose minus run_draft (Markov head / argmax over the draft slots, the D2H fetch)
  target fwd    ModelRunner.forward_target (the decode or verify forward: model maths)
  target host   ModelRunner.run_target minus forward_target (plan packing, H2D, state slots)
  sample        LLMEngine._verify minus run_target (plan building, sampling / greedy acceptance, the fetch)
  commit        LLMEngine._commit (KDA state commit, appending tokens, page truncation, statistics)
  rest          the step minus all of the above (scheduling, output collection)

Times are the engine thread's CPU time by default (--clock cpu: at 1 torch thread that is the engine's own
work, and it stays steady when other processes share the cores; --clock wall for wall time). Each cell is the
median over --repeats runs of the run's mean per decode step (ms), with the spread (min..max) of those means; "step / plain" is the ratio of medians; "ms / token" divides by the tokens a step emits (the
acceptance length for speculative steps). The load average is printed before and after: the machine is shared.
Goal (issue 18): a speculative step <= 1.3x a plain step. --baseline [specpay] adds each variant as the engine was
before the specpay changes (draft context stored in every forward, per-layer draft context entries) and prints the
per-round after / before ratios: an in-process before / after.

Run: OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.profile_spec [--models DIR ...] [--repeats 5]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import REPO_ROOT, Table, interleave, make_prompts, paired, print_header, ratio
from engine import LLM, SamplingParams
from engine.runtime import llm_engine
from engine.models.dflash import DFlashLayer

MODELS = (REPO_ROOT / "models" / "pdserve-k3-tiny", REPO_ROOT / "models" / "pdserve-tiny")
PIECES = ("draft fwd", "draft host", "propose rest", "target fwd", "target host", "sample", "commit", "rest")
GOAL = 1.3


class StepClock:
    """Wraps named methods of objects; accumulates each one's time within the current step. now: the clock,
    time.thread_time (CPU time of the calling thread: at 1 torch thread the engine's own work, steady under
    load) or time.perf_counter (wall time)."""

    def __init__(self, now: Callable[[], float]) -> None:
        self.current: dict[str, float] = {}
        self.now = now

    def wrap(self, owner: object, method: str, key: str) -> None:
        inner: Callable = getattr(owner, method)

        def timed(*args, **kwargs):
            start = self.now()
            try:
                return inner(*args, **kwargs)
            finally:
                self.current[key] = self.current.get(key, 0.0) + self.now() - start

        setattr(owner, method, timed)


def split_of(totals: dict[str, float], step: float) -> dict[str, float]:
    """Raw wrapped-method times of one step (seconds) -> the PIECES (ms); the pieces add up to the step."""
    get = totals.get
    pieces = {
        "draft fwd": get("forward_draft", 0.0),
        "draft host": get("run_draft", 0.0) - get("forward_draft", 0.0),
        "propose rest": get("propose", 0.0) - get("run_draft", 0.0),
        "target fwd": get("forward_target", 0.0),
        "target host": get("run_target", 0.0) - get("forward_target", 0.0),
        "sample": get("verify", 0.0) - get("run_target", 0.0),
        "commit": get("commit", 0.0),
    }
    pieces["rest"] = step - sum(pieces.values())
    return {key: 1e3 * value for key, value in pieces.items()}


@contextlib.contextmanager
def specfast_baseline(llm: LLM, active: bool):
    """active: the DFlash draft layers as before branch specfast - a norm and a RoPE each for the queries and the
    keys, instead of one of each over both (bit-identical either way)."""
    if not active:
        yield
        return
    saved = DFlashLayer._fused_queries_keys
    DFlashLayer._fused_queries_keys = lambda *args: None
    try:
        yield
    finally:
        DFlashLayer._fused_queries_keys = saved


@contextlib.contextmanager
def issue18_baseline(llm: LLM, active: bool):
    """active: the engine as it was before the specpay changes of issue 18, for an in-process before / after -
    every forward stores draft context (also for speculative=False requests) and the draft computes its
    context entries layer by layer."""
    if not active:
        yield
        return
    draft = llm.engine.runner.draft
    saved = llm_engine.speculates
    llm_engine.speculates = lambda params, has_draft: has_draft
    draft._fused_context_entries = lambda *args: None
    try:
        yield
    finally:
        llm_engine.speculates = saved
        del draft._fused_context_entries


BASELINES = {"specpay": issue18_baseline, "specfast": specfast_baseline}


def variant(llm: LLM, clock: StepClock, prompt: list[int], params: SamplingParams, outputs: dict, key: str,
            baseline: str | None = None):
    """One greedy generation of the prompt; metrics: the mean of each piece per decode step, tokens per step."""
    engine = llm.engine
    counter = iter(range(10**9))

    def run() -> dict[str, float]:
        with BASELINES[baseline or "specpay"](llm, baseline is not None):
            return measured()

    def measured() -> dict[str, float]:
        request = f"profile-{key}-{next(counter)}"
        engine.add_request(request, list(prompt), params)
        tokens: list[int] = []
        splits: list[dict[str, float]] = []
        emitted = 0
        while engine.has_work():
            decoding = engine.num_waiting == 0 and bool(tokens)
            clock.current = {}
            start = clock.now()
            step_outputs = engine.step()
            elapsed = clock.now() - start
            produced = 0
            for out in step_outputs:
                if out.request_id == request:
                    tokens.extend(out.new_token_ids)
                    produced += len(out.new_token_ids)
            if decoding:
                splits.append(split_of(clock.current, elapsed))
                emitted += produced
        outputs[key] = tokens
        metrics = {piece: statistics.fmean(s[piece] for s in splits) for piece in PIECES}
        metrics["step"] = sum(metrics[piece] for piece in PIECES)
        metrics["tokens_per_step"] = emitted / len(splits)
        return metrics

    return run


def profile_model(model: Path, args: argparse.Namespace) -> None:
    llm = LLM(str(model), device="cpu", num_threads=args.threads, max_running=4, spec_block_size=max(args.blocks))
    engine = llm.engine
    if not engine.has_draft:
        raise SystemExit(f"{model} has no draft/ folder")
    clock = StepClock(time.perf_counter if args.clock == "wall" else time.thread_time)
    runner = engine.runner
    for owner, method, key in ((runner, "forward_draft", "forward_draft"), (runner, "run_draft", "run_draft"),
                               (runner, "forward_target", "forward_target"), (runner, "run_target", "run_target"),
                               (engine, "_propose", "propose"), (engine, "_verify", "verify"),
                               (engine, "_commit", "commit")):
        clock.wrap(owner, method, key)
    config = llm.model_config
    prompt = make_prompts(model, 1, args.prompt_len, args.seed, config.vocab_size, list(config.eos_token_id))[0][0]
    blocks = [b for b in args.blocks if b <= engine.draft_config.verify_block_size]
    outputs: dict[str, list[int]] = {}
    variants = {"plain": variant(llm, clock, prompt, SamplingParams(
        max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True, speculative=False), outputs, "plain")}
    for block in blocks:
        params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True, speculative=True,
                                block_size=block)
        variants[f"B={block}"] = variant(llm, clock, prompt, params, outputs, f"B={block}")
    if args.baseline:  # "(before)" variants: the engine before the named change, for paired after / before ratios
        for name in list(variants):
            params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True,
                                    speculative=name != "plain", block_size=None if name == "plain" else int(name[2:]))
            variants[f"{name} (before)"] = variant(llm, clock, prompt, params, outputs, f"{name} (before)", args.baseline)
    load_before = os.getloadavg()[0]
    runs = interleave(variants, args.repeats)
    load_after = os.getloadavg()[0]
    table = Table(f"{model.name} ({type(runner.model).__name__}, draft {type(runner.draft).__name__}): one decode step at "
                  f"batch 1, {args.clock} ms, median (min..max) of {args.repeats} interleaved runs' per-step means; "
                  f"load average {load_before:.1f} -> {load_after:.1f}",
                  ["variant", "step", *PIECES, "tokens / step", "ms / token", "step / plain", "identical"])
    plain_step = statistics.median(m["step"] for m in runs["plain"])
    plain_per_token = statistics.median(m["step"] / m["tokens_per_step"] for m in runs["plain"])
    for name, samples in runs.items():
        def cell(key: str) -> str:
            values = [m[key] for m in samples]
            return f"{statistics.median(values):.2f} ({min(values):.2f}..{max(values):.2f})"

        step = statistics.median(m["step"] for m in samples)
        per_token = statistics.median(m["step"] / m["tokens_per_step"] for m in samples)
        table.add(name, cell("step"), *(f"{statistics.median(m[p] for m in samples):.2f}" for p in PIECES),
                  statistics.median(m["tokens_per_step"] for m in samples), per_token,
                  f"{ratio(step, plain_step):.2f}x", "yes" if outputs[name] == outputs["plain"] else "NO")
    table.print()
    for name in runs:
        if not name.startswith("plain") and not name.endswith("(before)"):
            step = statistics.median(m["step"] for m in runs[name])
            per_token = statistics.median(m["step"] / m["tokens_per_step"] for m in runs[name])
            met = "MET" if ratio(step, plain_step) <= GOAL else "NOT MET"
            print(f"- {model.name} {name}: spec step / plain step {ratio(step, plain_step):.2f}x (goal <= {GOAL}x: "
                  f"{met}); decode-step speed-up {ratio(plain_per_token, per_token):.2f}x")
    for name in [n for n in runs if f"{n} (before)" in runs]:
        ratios = paired(runs[name], runs[f"{name} (before)"], "step")
        print(f"- {model.name} {name}: step after / before (the {args.baseline} changes of issue 18), per round: median "
              f"{statistics.median(ratios):.3f}x ({', '.join(f'{r:.3f}' for r in ratios)})")
    print(flush=True)
    llm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, nargs="+", default=list(MODELS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--blocks", type=int, nargs="+", default=[8])
    parser.add_argument("--baseline", nargs="?", const="specpay", choices=sorted(BASELINES),
                        help="also run every variant as the engine was before a change, in-process before / after with "
                             "per-round ratios: specpay (the default; issue 18: draft context stored in every forward, "
                             "per-layer context entries) or specfast (per-module draft query / key norms and RoPE)")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="cpu: the engine thread's CPU time (default; steady on a shared machine); wall: wall time")
    args = parser.parse_args()
    args.model = ", ".join(str(m) for m in args.models)
    print_header("profile_spec: the speculative step split vs a plain decode step (batch 1, in process)", args)
    for model in args.models:
        profile_model(model, args)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()

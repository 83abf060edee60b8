"""Shared helpers of the benchmark scripts: the machine description, interleaved repetitions, a timed
engine step loop (TTFT and decode-only time), benchmark prompts, and markdown tables.

Every comparison in BENCHMARKS.md is measured side by side in one process run: the compared variants take
turns (round r runs them in order, round r + 1 in reverse order), each is repeated, and the tables report
the median of the repetitions and the ratio of medians. The machine is shared and noisy; ratios within one
run are what count.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.machine_load import OtherLoad
from engine.paths import DSV3_MODEL_DIR
from rpc.processes import cpu_seconds as process_cpu_seconds  # noqa: F401 - re-exported for the benches
from rpc.processes import tree_cpu_seconds  # noqa: F401 - re-exported for the benches

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = DSV3_MODEL_DIR  # the figures in BENCHMARKS.md; bench_k3_spec.py measures the K3 default
Metrics = dict[str, float]


# --- the machine ------------------------------------------------------------------------------------
def cpu_model_name() -> str:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        text = ""
    for line in text.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def memory_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


def cpu_flags() -> str:
    """The vector extensions the CPU reports (what the matmuls can use)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            flags = next(line for line in handle if line.startswith("flags")).split(":", 1)[1].split()
    except (OSError, StopIteration):
        return "unknown"
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")
    return " ".join(flag for flag in wanted if flag in flags) or "none of " + ",".join(wanted)


def machine_description() -> str:
    """One line: CPU model, cores, RAM, torch version and threads, load, date, commit."""
    load = os.getloadavg()[0]
    return (f"{cpu_model_name()}, {os.cpu_count()} cores, {memory_gib():.0f} GiB RAM, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads), load average {load:.1f} at start, "
            f"{datetime.datetime.now().isoformat(timespec='seconds')}, commit {git_commit()}")


def add_common_arguments(parser: argparse.ArgumentParser, repeats: int) -> None:
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="model directory (default: pdserve-tiny)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (engine and reference alike)")
    parser.add_argument("--repeats", type=int, default=repeats, help="interleaved repetitions of each variant")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and shorter runs (smoke check)")
    parser.add_argument("--seed", type=int, default=0)


def print_header(title: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    print(f"# {title}\n")
    print(f"machine: {machine_description()}  ")
    print(f"CPU flags: {cpu_flags()}  ")
    print(f"model: {args.model}  ")
    print(f"repeats: {args.repeats} (interleaved; tables show medians)\n", flush=True)


# --- interleaved repetitions ------------------------------------------------------------------------
def interleave(variants: dict[str, Callable[[], Metrics]], repeats: int,
               warmup: bool | Sequence[str] = True) -> dict[str, list[Metrics]]:
    """Runs every variant `repeats` times, taking turns (alternating the order each round), after an
    unrecorded warm-up run of every variant (warmup=True) or of the named ones; returns each variant's list
    of metrics dicts."""
    names = list(variants)
    for name in names if warmup is True else (warmup or ()):
        variants[name]()
    results: dict[str, list[Metrics]] = {name: [] for name in names}
    for round_index in range(repeats):
        for name in names if round_index % 2 == 0 else reversed(names):
            others = OtherLoad()
            metrics = variants[name]()
            metrics.setdefault("load", os.getloadavg()[0])  # the 1-minute load average as the run ended
            metrics.setdefault("other_cores", others.cores())  # what processes outside this run used meanwhile
            results[name].append(metrics)
    return results


def paired(numerators: Sequence[Metrics], denominators: Sequence[Metrics], key: str,
           combine: Callable[[float, float], float] = lambda a, b: a / b if b else float("nan")) -> list[float]:
    """combine(numerator, denominator) of `key` for each round of an interleave() (round r with round r):
    ratios (or differences) from runs that took turns, so slow drifts of the machine cancel out."""
    return [combine(a[key], b[key]) for a, b in zip(numerators, denominators) if key in a and key in b]


def spread(values: Sequence[float], scale: float = 1.0, unit: str = "") -> str:
    """'median (min..max)' of values times scale, e.g. '94.1% (90.2..97.0)'."""
    if not values:
        return "-"
    low, mid, high = (scale * v for v in (min(values), statistics.median(values), max(values)))
    return f"{mid:.1f}{unit} ({low:.1f}..{high:.1f})"


def load_note(runs: dict[str, list[Metrics]]) -> str:
    """The load averages the runs ended at, 'min..max', with how many runs saw more load than cores, and the
    most CPU processes outside the benchmark used during a run (machine_load.OtherLoad, in cores)."""
    loads = [m["load"] for samples in runs.values() for m in samples if "load" in m]
    if not loads:
        return "-"
    over = sum(load > (os.cpu_count() or 1) for load in loads)
    others = [m["other_cores"] for samples in runs.values() for m in samples if "other_cores" in m]
    return (f"{min(loads):.1f}..{max(loads):.1f}" + (f" ({over}/{len(loads)} runs above {os.cpu_count()} cores)" if over else "")
            + (f"; others <= {max(others):.2f} cores" if others else ""))


def most_other_load(runs: dict[str, list[Metrics]]) -> float:
    """The most CPU (in cores) processes outside the benchmark used during any one of the runs."""
    return max((m.get("other_cores", 0.0) for samples in runs.values() for m in samples), default=0.0)


def median(samples: Sequence[Metrics], key: str) -> float:
    values = [s[key] for s in samples if key in s]
    return statistics.median(values) if values else float("nan")


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else float("nan")


def goal_line(name: str, measured: float, target: float, unit: str = "x", higher_is_better: bool = True) -> str:
    met = measured >= target if higher_is_better else measured <= target
    relation = ">=" if higher_is_better else "<="
    return f"goal {name}: {relation} {target:g}{unit}, measured {measured:.2f}{unit}: {'MET' if met else 'NOT MET'}"


# --- a timed engine step loop -----------------------------------------------------------------------
@dataclass
class TimedRun:
    """What `timed_generate` saw: wall time, decode-only step time and tokens, and each request's TTFT
    (time from submission to the step that produced its first token)."""

    outputs: list[list[int]]
    total_s: float
    decode_s: float = 0.0
    decode_tokens: int = 0
    decode_steps: int = 0
    decode_cpu_s: float = 0.0  # CPU time of the calling thread in decode steps (the engine's, at 1 torch thread)
    ttft_s: list[float] = field(default_factory=list)

    @property
    def new_tokens(self) -> int:
        return sum(len(out) for out in self.outputs)

    def metrics(self) -> Metrics:
        return {
            "tok_s": self.new_tokens / self.total_s,
            "decode_tok_s": self.decode_tokens / self.decode_s if self.decode_s else float("nan"),
            "ttft_ms": 1e3 * statistics.median(self.ttft_s) if self.ttft_s else float("nan"),
            "step_ms": 1e3 * self.decode_s / self.decode_steps if self.decode_steps else float("nan"),
            "decode_cpu_ms_per_token": 1e3 * self.decode_cpu_s / self.decode_tokens if self.decode_tokens else float("nan"),
            "seconds": self.total_s,
        }


_run_ids = iter(range(10**12))


def timed_generate(engine, prompts: list[list[int]], params) -> TimedRun:
    """LLM.generate's loop (add every request, step until done) with timing. A step counts as decode when
    nothing is waiting and every request already has its first token."""
    ids = [f"bench-{next(_run_ids)}" for _ in prompts]
    outputs: dict[str, list[int]] = {rid: [] for rid in ids}
    first: dict[str, float] = {}
    start = time.perf_counter()
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, list(prompt), params)
    run = TimedRun(outputs=[], total_s=0.0)
    while engine.has_work():
        is_decode = engine.num_waiting == 0 and len(first) == len(ids)
        step_start, cpu_start = time.perf_counter(), time.thread_time()
        step_outputs = engine.step()
        now, cpu_end = time.perf_counter(), time.thread_time()
        produced = 0
        for out in step_outputs:
            if out.request_id in outputs:
                outputs[out.request_id].extend(out.new_token_ids)
                produced += len(out.new_token_ids)
                if out.new_token_ids and out.request_id not in first:
                    first[out.request_id] = now - start
        if is_decode:
            run.decode_s += now - step_start
            run.decode_cpu_s += cpu_end - cpu_start
            run.decode_tokens += produced
            run.decode_steps += 1
    run.total_s = time.perf_counter() - start
    run.outputs = [outputs[rid] for rid in ids]
    run.ttft_s = [first[rid] for rid in ids if rid in first]
    return run


def timed_groups(engine, prompts: list[list[int]], params, group_size: int) -> TimedRun:
    """The prompts in consecutive groups of `group_size` (one timed_generate each), merged into one TimedRun
    (times and tokens summed, TTFTs pooled): a closed loop at concurrency `group_size`."""
    return merge_runs([timed_generate(engine, prompts[start : start + group_size], params)
                       for start in range(0, len(prompts), group_size)])


def merge_runs(runs: Sequence[TimedRun]) -> TimedRun:
    """Runs one after another as one TimedRun (times and tokens summed, outputs in order, TTFTs pooled)."""
    merged = TimedRun(outputs=[], total_s=0.0)
    for run in runs:
        merged.outputs += run.outputs
        merged.total_s += run.total_s
        merged.decode_s += run.decode_s
        merged.decode_tokens += run.decode_tokens
        merged.decode_steps += run.decode_steps
        merged.decode_cpu_s += run.decode_cpu_s
        merged.ttft_s += run.ttft_s
    return merged


class ForwardTimer:
    """Wraps a ModelRunner method and records the wall time of each call (seconds)."""

    def __init__(self, runner, name: str) -> None:
        self.samples: list[float] = []
        self._inner = getattr(runner, name)
        setattr(runner, name, self)

    def take(self) -> list[float]:
        """The samples recorded since the last take()."""
        samples, self.samples = self.samples, []
        return samples

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self._inner(*args, **kwargs)
        finally:
            self.samples.append(time.perf_counter() - start)


# --- prompts ----------------------------------------------------------------------------------------
def held_out_python_text(max_chars: int = 400_000) -> str:
    """The default model's held-out split of the standard library sources (never trained on)."""
    from training.corpus import EXCLUDED_DIRS, is_held_out, stdlib_root

    root, parts, size = stdlib_root(), [], 0
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        relpath = path.relative_to(root).as_posix()
        if EXCLUDED_DIRS.intersection(path.relative_to(root).parts) or not is_held_out(relpath):
            continue
        try:
            parts.append(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
        size += len(parts[-1])
        if size >= max_chars:
            break
    return "\n".join(parts)


def make_prompts(model_dir: Path, count: int, length: int, seed: int, vocab_size: int,
                 avoid: Sequence[int] = ()) -> tuple[list[list[int]], str]:
    """`count` prompts of exactly `length` tokens: windows of held-out Python tokenized with the model's
    tokenizer.json when it and `tokenizers` are available, else uniform random ids (avoiding `avoid`).
    Returns (prompts, a description of where they came from)."""
    generator = torch.Generator().manual_seed(seed)
    tokenizer_file = Path(model_dir) / "tokenizer.json"
    stream: list[int] = []
    if tokenizer_file.is_file():
        try:
            from tokenizers import Tokenizer
        except ImportError:
            Tokenizer = None  # noqa: N806
        if Tokenizer is not None:
            tokenizer = Tokenizer.from_file(str(tokenizer_file))
            stream = [t for t in tokenizer.encode(held_out_python_text()).ids if t < vocab_size and t not in avoid]
    if len(stream) > length + count:
        starts = torch.randint(0, len(stream) - length, (count,), generator=generator).tolist()
        return [stream[s : s + length] for s in starts], "held-out Python (stdlib), model tokenizer"
    allowed = torch.tensor([t for t in range(vocab_size) if t not in set(avoid)])
    picks = torch.randint(0, len(allowed), (count, length), generator=generator)
    return allowed[picks].tolist(), "uniform random token ids"


# --- tables -----------------------------------------------------------------------------------------
class Table:
    """A markdown table printed as soon as it is complete."""

    def __init__(self, title: str, columns: Sequence[str]) -> None:
        self.title, self.columns, self.rows = title, list(columns), []

    def add(self, *cells: object) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"{len(cells)} cells for {len(self.columns)} columns")
        self.rows.append([_format(cell) for cell in cells])

    def render(self) -> str:
        widths = [max(len(str(c)), *(len(r[i]) for r in self.rows)) for i, c in enumerate(self.columns)]
        lines = [f"### {self.title}", "",
                 "| " + " | ".join(c.ljust(w) for c, w in zip(self.columns, widths)) + " |",
                 "|" + "|".join("-" * (w + 2) if i == 0 else "-" * (w + 1) + ":" for i, w in enumerate(widths)) + "|"]
        for row in self.rows:
            lines.append("| " + " | ".join(cell.rjust(w) if i else cell.ljust(w)
                                         for i, (cell, w) in enumerate(zip(row, widths))) + " |")
        return "\n".join(lines) + "\n"

    def print(self) -> None:
        print(self.render(), flush=True)


def _format(cell: object) -> str:
    if isinstance(cell, float):
        if cell != cell:
            return "-"
        if abs(cell) >= 100:
            return f"{cell:,.0f}"
        return f"{cell:.2f}" if abs(cell) >= 1 else f"{cell:.3f}"
    return str(cell)

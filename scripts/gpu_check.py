"""The one-shot device check behind scripts/gpu_check.sh: on one NVIDIA or AMD GPU, in <= 8 minutes with a
cold Triton cache, from the source tree with the machine's own Python and GPU torch (no package registry:
gpu_check.sh installs the carried wheels first). Stages, each with its own time budget (seconds):

  smoke (first: a broken basic path fails fast and says so)
    1. imports            every module of every package imports (generated protobuf vs the installed runtime too)  30
    2. kernels            every Triton kernel runs on the device at every attention head dim in use (models,
                          presets, benchmark checkpoints) against torch, compiled (TRITON_INTERPRET=0)         60
    3. generate           one greedy generate of each embedded model (DeepSeek-V3 tiny with its draft, Kimi K3
                          tiny) with attention "auto" and CUDA graphs                                       60
  tests
    4. gpu tests          pytest -m gpu on the GPU test files (fused MoE, FP8 GEMM, graphs, device weights)
                          and the Triton attention tests on the device                                      100
  benchmarks (goals printed beside each)
    5. decode             ~1B random DeepSeek-V3-shaped checkpoint, bf16: engine (graphs, eager) vs transformers
                          at batch 1 / 16 / 64 (engine >= 5x transformers at 16; graphs >= 2x eager at 1)     110
    6. fused MoE          64 experts top-6: fused Triton kernel vs the per-expert loop (>= 3x at batch 64)      40
    7. steps              spec step vs plain step (<= 1.3x), K3 tiny with graphs, host syncs per plain
                          decode step (<= 1)                                                               70
  if time is left
    8. parity             engine vs transformers, fp32 tiny configs (logits within 1e-4, greedy identical)     60
  --with-services only (three cluster start-ups: more than the 8 minutes)
    9. one GPU: shared weights + device KV handoff (pytest), 10. KV handoff benchmark

Writes OUT/gpu_check.json (every stage: status, seconds, budget, details) and OUT/gpu_check.md after every
stage (a kill still leaves the results so far); gpu_check.sh tees the log to OUT/gpu_check.log. --dry-run
runs the same Python on CPU with tiny sizes (no GPU needed); tests/scripts/test_gpu_check.py runs it."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GPU_HANDOFF_TESTS = "tests/services/test_gpu_handoff.py"
GPU_TEST_FILES = ["tests/engine/test_fused_moe.py", "tests/engine/test_fp8_gemm.py", "tests/engine/test_gpu_runtime.py",
                  "tests/engine/test_device_weights.py"]
PACKAGES = ("engine", "rpc", "kvtransfer", "gateway", "prefill_worker", "decode_worker", "pdserve", "bench")
# A child pytest; hypothesis's plugin (~1 s of start-up) is left out: no stage selects a hypothesis test.
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:hypothesispytest"]


@dataclass(frozen=True)
class Stage:
    name: str
    budget_s: float
    function: object
    optional: bool = False  # runs only when its budget still fits in what is left


class Stages:
    """Runs named stages, each recorded as passed / failed / skipped with its time, budget and details."""

    def __init__(self, out_dir: Path, deadline: float) -> None:
        self.out_dir, self.deadline = out_dir, deadline
        self.records: list[dict] = []
        self.markdown: list[str] = []
        self.budget = 0.0  # the running stage's budget: commands take min(budget, time left)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def timeout(self) -> float:
        return max(1.0, min(self.budget, self.left() - 5))

    def run(self, stage: Stage, args) -> None:
        started = time.monotonic()
        record: dict = {"stage": stage.name, "budget_s": stage.budget_s}
        self.budget = stage.budget_s
        try:
            if self.left() < 10 or (stage.optional and self.left() < stage.budget_s):
                record.update(status="skipped", details=f"{self.left():.0f} s left of the budget")
            else:
                status, details = stage.function(args, self)
                record.update(status=status, details=details)
        except subprocess.TimeoutExpired as error:
            record.update(status="failed", details=f"over its {stage.budget_s:.0f} s budget: {error.cmd[-1]}")
        except Exception as error:  # a stage's failure is recorded and the next stage still runs
            record.update(status="failed", details=f"{type(error).__name__}: {error}")
        record["seconds"] = round(time.monotonic() - started, 1)
        print(f"[gpu_check] {stage.name}: {record['status']} ({record['seconds']} s of {stage.budget_s:.0f}) "
              f"{str(record['details'])[:400]}", flush=True)
        self.records.append(record)


def run_command(command: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                **(env or {})}
    return subprocess.run(command, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=max(timeout, 1))


def _pytest_status(result: subprocess.CompletedProcess) -> tuple[str, str]:
    tail = "\n".join(result.stdout.strip().splitlines()[-8:])
    if result.returncode == 5 or (result.returncode == 0 and "passed" not in tail):
        return "skipped", tail or "no test collected"
    return ("passed" if result.returncode == 0 else "failed"), tail


def _triton_env(args) -> dict:
    return {"TRITON_INTERPRET": "0" if args.device == "cuda" else "1", "PDSERVE_TEST_DEVICE": args.device,
            "TRITON_DEFAULT_FP_FUSION": "1"}


# --- smoke -----------------------------------------------------------------------------------------------
IMPORT_ALL = """
import importlib, pkgutil, sys, traceback
failed = []
for package in sys.argv[1:]:
    root = importlib.import_module(package)
    for info in pkgutil.walk_packages(root.__path__, package + "."):
        if info.name.endswith("__main__"):
            continue
        try:
            importlib.import_module(info.name)
        except ImportError as error:  # optional backends (aiter, fla, mooncake) say so in their message
            if getattr(error, "name", None) in ("aiter", "fla", "mooncake", "openai"):
                continue
            failed.append(f"{info.name}: {type(error).__name__}: {error}")
        except Exception as error:
            failed.append(f"{info.name}: {type(error).__name__}: {error}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def stage_imports(args, stages: Stages):
    """Every module imports: catches a package the box lacks or too old a protobuf / grpcio for the generated code."""
    result = run_command([sys.executable, "-c", IMPORT_ALL, *PACKAGES], stages.timeout())
    versions = run_command([sys.executable, "-c", "import grpc, google.protobuf, torch, triton; print("
                            "f'grpcio {grpc.__version__}, protobuf {google.protobuf.__version__}, torch {torch.__version__},"
                            " triton {triton.__version__}')"], 30).stdout.strip()
    if result.returncode:
        return "failed", (result.stdout + result.stderr)[-2000:]
    return "passed", versions


def stage_kernels(args, stages: Stages):
    """Every attention kernel at every head dim in use, on the device against torch (compiled on a GPU; the
    interpreter in the dry run), and the split-count buckets."""
    result = run_command([*PYTEST, "-rs", "tests/engine/test_attention_backends.py", "-k",
                          "every_head_dim_in_use and not compile or bucketed"], stages.timeout(), _triton_env(args))
    return _pytest_status(result)


GENERATE = """
import json, sys
from engine.llm import LLM
from engine.paths import DSV3_MODEL_DIR, K3_MODEL_DIR
from engine.sampling_params import SamplingParams
device = sys.argv[1]
out = {}
for name, model in (("deepseek-v3 tiny + draft", DSV3_MODEL_DIR), ("kimi-k3 tiny", K3_MODEL_DIR)):
    llm = LLM(str(model), device=device, attention_backend="auto", use_graphs=True, kv_memory_bytes=64 * 2**20)
    try:
        results = llm.generate([[5, 9, 14, 3], [7, 7, 2]], SamplingParams(max_new_tokens=8, ignore_eos=True))
        out[name] = [r.token_ids if hasattr(r, "token_ids") else r for r in results]
    finally:
        llm.close()
print(json.dumps(out, default=str))
"""


def stage_generate(args, stages: Stages):
    """One greedy generate per embedded model with attention auto (Triton on a GPU) and graphs: the first
    prefill at head dim 32, graph capture and replay, the draft, the K3 state slots."""
    result = run_command([sys.executable, "-c", GENERATE, args.device], stages.timeout(), {"TRITON_INTERPRET": "0"})
    if result.returncode:
        return "failed", result.stderr[-2000:]
    return "passed", result.stdout.strip()[-600:]


# --- tests -----------------------------------------------------------------------------------------------
def stage_gpu_tests(args, stages: Stages):
    """pytest -m gpu on the GPU test files and the Triton attention tests on the device (the dry run collects
    them only: the CPU suite runs their CPU halves)."""
    select = [] if args.device == "cuda" else ["--collect-only"]
    result = run_command([*PYTEST, "-rs", *select, "-m", "gpu or not slow", *GPU_TEST_FILES,
                          "tests/engine/test_attention_backends.py"], stages.timeout(), _triton_env(args))
    if args.device != "cuda":
        return ("passed" if result.returncode == 0 else "failed"), "collected only (dry run)"
    return _pytest_status(result)


# --- benchmarks ------------------------------------------------------------------------------------------
def stage_decode_bench(args, stages: Stages):
    checkpoint = Path(args.work_dir) / ("tiny-random" if args.dry_run else "random-1b")
    if not (checkpoint / "config.json").exists():
        command = [sys.executable, "benchmarks/write_random_checkpoint.py", str(checkpoint)]
        result = run_command(command + (["--tiny", "--dtype", "float32"] if args.dry_run else []), stages.timeout())
        if result.returncode:
            return "failed", result.stderr[-800:]
    json_path, md_path = stages.out_dir / "bench_gpu_decode.json", stages.out_dir / "bench_gpu_decode.md"
    options = (["--device", "cpu", "--dtype", "float32", "--batches", "1,2", "--new-tokens", "3", "--prompt-len", "4",
                "--repeats", "1", "--kv-memory-mb", "16"] if args.dry_run else
               ["--device", "cuda", "--dtype", "bfloat16", "--batches", "1,16,64", "--new-tokens", "32", "--repeats", "5"])
    result = run_command([sys.executable, "benchmarks/bench_gpu_decode.py", "--model", str(checkpoint), *options,
                          "--json", str(json_path), "--md", str(md_path)], stages.timeout(), {"TRITON_INTERPRET": "0"})
    if result.returncode:
        return "failed", result.stderr[-1500:]
    stages.markdown.append(md_path.read_text())
    return "passed", json.loads(json_path.read_text())["goals"]


def stage_moe_bench(args, stages: Stages):
    json_path = stages.out_dir / "bench_moe.json"
    options = (["--device", "cpu", "--shapes", "tiny", "--tokens", "1,4", "--repeats", "1", "--calls", "2"]
               if args.dry_run else ["--device", "cuda", "--shapes", "e64", "--tokens", "1,16,64"])
    result = run_command([sys.executable, "benchmarks/bench_moe.py", *options, "--json", str(json_path)],
                         stages.timeout(), {"TRITON_INTERPRET": "0"})
    if result.returncode:
        return "failed", result.stderr[-1500:]
    stages.markdown.append("Fused MoE (benchmarks/bench_moe.py)\n\n```\n" + result.stdout.strip() + "\n```\n")
    return "passed", result.stdout.strip().splitlines()[-3:]


def stage_steps_bench(args, stages: Stages):
    json_path, md_path = stages.out_dir / "bench_gpu_steps.json", stages.out_dir / "bench_gpu_steps.md"
    options = (["--device", "cpu", "--batch", "2", "--k3-batches", "1,2", "--steps", "2", "--new-tokens", "3",
                "--repeats", "1"] if args.dry_run else ["--device", "cuda", "--batch", "16", "--k3-batches", "1,16"])
    result = run_command([sys.executable, "benchmarks/bench_gpu_steps.py", *options, "--json", str(json_path),
                          "--md", str(md_path)], stages.timeout(), {"TRITON_INTERPRET": "0"})
    if result.returncode:
        return "failed", result.stderr[-1500:]
    stages.markdown.append(md_path.read_text())
    return "passed", json.loads(json_path.read_text())["goals"]


def stage_parity(args, stages: Stages):
    from scripts.gpu_parity import fp32_tiny_parity

    details = fp32_tiny_parity(args.device, variants=("yarn",) if args.dry_run else None, work_dir=args.work_dir)
    ok = all(d["max_abs_diff"] <= 1e-4 and d["greedy_identical"] for d in details)
    return ("passed" if ok else "failed"), details


# --- services (--with-services) --------------------------------------------------------------------------
def stage_gpu_handoff(args, stages: Stages):
    """Weight sharing and device KV handoff through the real services on one GPU (collection only in the
    dry run: the CPU suite runs the same code over the memfd stand-in)."""
    select = [] if args.device == "cuda" else ["--collect-only"]
    result = run_command([*PYTEST, "-rs", "-s", *select, GPU_HANDOFF_TESTS], stages.timeout())
    if args.device != "cuda":
        return ("passed" if result.returncode == 0 else "failed"), "collected only (dry run)"
    return _pytest_status(result)


def stage_kv_handoff_bench(args, stages: Stages):
    tokens = ["--tokens", "256", "--repeat", "2"] if args.dry_run else ["--tokens", "8192", "--repeat", "5"]
    result = run_command([sys.executable, "benchmarks/bench_kvtransfer.py", "--device", args.device, *tokens],
                         stages.timeout())
    if result.returncode:
        return "failed", result.stderr[-1500:]
    stages.markdown.append("KV handoff (benchmarks/bench_kvtransfer.py)\n\n```\n" + result.stdout.strip() + "\n```\n")
    return "passed", result.stdout.strip().splitlines()[-12:]


STAGES = [
    Stage("smoke: every module imports", 30, stage_imports),
    Stage("smoke: Triton kernels at every head dim in use vs torch", 60, stage_kernels),
    Stage("smoke: one generate per embedded model (attention auto, graphs)", 60, stage_generate),
    Stage("gpu tests: MoE / FP8 kernels, graphs, device weights, Triton attention (pytest)", 100, stage_gpu_tests),
    Stage("benchmark: decode, ~1B random checkpoint, engine vs transformers", 110, stage_decode_bench),
    Stage("benchmark: fused MoE vs per-expert loop", 40, stage_moe_bench),
    Stage("benchmark: spec vs plain step, K3 tiny graphs, host syncs per step", 70, stage_steps_bench),
    Stage("engine vs transformers, fp32 tiny configs", 60, stage_parity, optional=True),
]
SERVICE_STAGES = [
    Stage("one GPU: shared weights + device KV handoff (pytest)", 240, stage_gpu_handoff),
    Stage("KV handoff benchmark: shm / device / grpc, 8K tokens", 90, stage_kv_handoff_bench),
]


def environment(args) -> dict:
    import torch

    info = {"python": sys.version.split()[0], "torch": torch.__version__, "hip": torch.version.hip,
            "cuda": torch.version.cuda, "device": args.device, "dry_run": args.dry_run}
    if args.device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", nargs="?", type=Path, default=Path(os.environ.get("OUT") or REPO / "runs" / "gpu_check"))
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: checks the script itself")
    parser.add_argument("--budget-s", type=float, default=465.0,
                        help="total time budget (default: 8 minutes less a margin for the reports)")
    parser.add_argument("--with-services", action="store_true",
                        help="also the one-GPU service stages (three cluster start-ups: beyond 8 minutes)")
    args = parser.parse_args()
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no GPU visible (torch.cuda.is_available() is False); use --dry-run on CPU", file=sys.stderr)
        return 2
    args.device = "cpu" if args.dry_run else "cuda"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    args.work_dir = tempfile.mkdtemp(prefix="pdserve-gpu-check-")
    stages = Stages(args.out_dir, time.monotonic() + args.budget_s)
    passed = True
    for stage in STAGES + (SERVICE_STAGES if args.with_services else []):
        stages.run(stage, args)
        passed = write_reports(args, stages)  # after every stage: a kill still leaves the results so far
    print(f"[gpu_check] wrote {args.out_dir / 'gpu_check.json'} and gpu_check.md; passed={passed}")
    return 0 if passed else 1


def write_reports(args, stages: Stages) -> bool:
    """OUT/gpu_check.json and OUT/gpu_check.md for the stages run so far; returns whether none failed."""
    summary = {"environment": environment(args), "stages": stages.records,
               "passed": all(r["status"] != "failed" for r in stages.records)}
    (args.out_dir / "gpu_check.json").write_text(json.dumps(summary, indent=2, default=str))
    lines = ["# gpu_check", "", f"environment: {summary['environment']}", "", "| stage | status | seconds | budget |",
             "|---|---|--:|--:|", *(f"| {r['stage']} | {r['status']} | {r['seconds']} | {r['budget_s']:.0f} |"
                                   for r in stages.records), "", *stages.markdown]
    (args.out_dir / "gpu_check.md").write_text("\n".join(lines) + "\n")
    return summary["passed"]


if __name__ == "__main__":
    sys.exit(main())

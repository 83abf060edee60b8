"""The one-shot device check behind scripts/gpu_check.sh: on one NVIDIA or AMD GPU, in <= 8 minutes,
from the source tree with the machine's own Python and GPU torch (no package registry is used):

  1. pytest -m gpu (fused MoE / FP8 GEMM kernels against torch on the device, every GPU-marked test)
     and the Triton attention tests on the device, compiled kernels (TRITON_INTERPRET=0)
  2. engine vs transformers on the GPU: fp32 tiny configs (logits within 1e-4, greedy identical) and the
     default model in bf16 (greedy identical)
  3. the decode benchmark of a ~1B-parameter DeepSeek-V3-shaped random checkpoint: greedy tok/s at
     batch 1 / 16 / 64, engine with graphs, engine eager, transformers
  4. the fused-MoE benchmark (64 experts, top-6)
  5. one prefill + one decode worker on one GPU: weights shared over CUDA / HIP IPC (device memory ~1x weights),
     KV pages device to device, greedy outputs equal the CPU path's (tests/services/test_gpu_handoff.py), and
     the KV handoff benchmark of an 8K-token DeepSeek-V3-layout prompt (shm, device, grpc)

Writes OUT/gpu_check.json (every stage: status, seconds, details) and OUT/gpu_check.md (tables for
BENCHMARKS.md). --dry-run runs the same Python on CPU with tiny sizes (no GPU needed); it is what
tests/scripts/test_gpu_check.py runs."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GPU_HANDOFF_TESTS = "tests/services/test_gpu_handoff.py"
# A child pytest; hypothesis's plugin (~1 s of start-up) is left out: no stage selects a hypothesis test.
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:hypothesispytest"]


class Stages:
    """Runs named stages, each recorded as passed / failed / skipped with its time and details."""

    def __init__(self, out_dir: Path, deadline: float) -> None:
        self.out_dir, self.deadline = out_dir, deadline
        self.records: list[dict] = []
        self.markdown: list[str] = []

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, name: str, function) -> None:
        started = time.monotonic()
        record: dict = {"stage": name}
        try:
            if self.left() < 10:
                record.update(status="skipped", details="no time left in the 8-minute budget")
            else:
                status, details = function()
                record.update(status=status, details=details)
        except Exception as error:  # a stage's failure is recorded and the next stage still runs
            record.update(status="failed", details=f"{type(error).__name__}: {error}")
        record["seconds"] = round(time.monotonic() - started, 1)
        print(f"[gpu_check] {name}: {record['status']} ({record['seconds']} s) {str(record['details'])[:300]}", flush=True)
        self.records.append(record)


def run_command(command: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(command, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=max(timeout, 1))


def _pytest_status(result: subprocess.CompletedProcess) -> tuple[str, str]:
    tail = "\n".join(result.stdout.strip().splitlines()[-6:])
    if result.returncode == 5 or (result.returncode == 0 and "passed" not in tail):
        return "skipped", tail or "no test collected"
    return ("passed" if result.returncode == 0 else "failed"), tail


def stage_attention_kernels(args, stages: Stages):
    """The Triton attention kernels against the torch reference with compiled kernels on the device (on
    CPU, in the dry run, only the collection runs: the interpreter version is part of the CPU suite)."""
    env = {"TRITON_INTERPRET": "0" if args.device == "cuda" else "1", "PDSERVE_TEST_DEVICE": args.device}
    select = [] if args.device == "cuda" else ["-m", "gpu"]
    result = run_command([*PYTEST, "-rs", *select,
                          "tests/engine/test_attention_backends.py"], min(stages.left() - 240, 150), env)
    return _pytest_status(result)


def stage_pytest_gpu_marked(args, stages: Stages):
    """Every test marked `gpu`: the fused MoE and FP8 GEMM kernels against torch on the device, and the rest
    (they skip cleanly without a GPU)."""
    env = {"TRITON_INTERPRET": "0" if args.device == "cuda" else "1"}
    paths = (["tests", "--ignore", GPU_HANDOFF_TESTS] if args.device == "cuda" else
             ["tests/engine/test_fused_moe.py", "tests/engine/test_fp8_gemm.py"])
    result = run_command([*PYTEST, "-m", "gpu", "-rs", *paths],
                         min(stages.left() - 240, 150), env)
    return _pytest_status(result)


def stage_gpu_handoff(args, stages: Stages):
    """Weight sharing and device KV handoff through the real services on one GPU (collection only in the
    dry run: the CPU suite runs the same code over the memfd stand-in)."""
    select = [] if args.device == "cuda" else ["--collect-only"]
    result = run_command([*PYTEST, "-rs", "-s", *select,
                          GPU_HANDOFF_TESTS], min(stages.left() - 120, 240))
    if args.device != "cuda":
        return ("passed" if result.returncode == 0 else "failed"), "collected only (dry run)"
    return _pytest_status(result)


def stage_kv_handoff_bench(args, stages: Stages):
    tokens = ["--tokens", "256", "--repeat", "2"] if args.dry_run else ["--tokens", "8192", "--repeat", "5"]
    result = run_command([sys.executable, "benchmarks/bench_kvtransfer.py", "--device", args.device, *tokens],
                         stages.left() - 60)
    if result.returncode:
        return "failed", result.stderr[-1500:]
    stages.markdown.append("KV handoff (benchmarks/bench_kvtransfer.py)\n\n```\n" + result.stdout.strip() + "\n```\n")
    return "passed", result.stdout.strip().splitlines()[-12:]


def stage_parity(args, stages: Stages):
    from scripts.gpu_parity import fp32_tiny_parity

    details = fp32_tiny_parity(args.device, variants=("yarn",) if args.dry_run else None, work_dir=args.work_dir)
    ok = all(d["max_abs_diff"] <= 1e-4 and d["greedy_identical"] for d in details)
    return ("passed" if ok else "failed"), details


def stage_bf16_parity(args, stages: Stages):
    from scripts.gpu_parity import bf16_default_model_greedy

    if args.dry_run:
        return "skipped", "bf16 greedy parity runs on a GPU only"
    details = bf16_default_model_greedy(args.device)
    return ("passed" if details["greedy_identical"] else "failed"), details


def stage_decode_bench(args, stages: Stages):
    checkpoint = Path(args.work_dir) / ("tiny-random" if args.dry_run else "random-1b")
    if not (checkpoint / "config.json").exists():
        command = [sys.executable, "benchmarks/write_random_checkpoint.py", str(checkpoint)]
        result = run_command(command + (["--tiny", "--dtype", "float32"] if args.dry_run else []), stages.left() - 60)
        if result.returncode:
            return "failed", result.stderr[-800:]
    json_path, md_path = stages.out_dir / "bench_gpu_decode.json", stages.out_dir / "bench_gpu_decode.md"
    options = (["--device", "cpu", "--dtype", "float32", "--batches", "1,2", "--new-tokens", "3", "--prompt-len", "4",
                "--repeats", "1", "--kv-memory-mb", "16"] if args.dry_run else
               ["--device", "cuda", "--dtype", "bfloat16", "--batches", "1,16,64", "--new-tokens", "64", "--repeats", "5"])
    result = run_command([sys.executable, "benchmarks/bench_gpu_decode.py", "--model", str(checkpoint), *options,
                          "--json", str(json_path), "--md", str(md_path)], stages.left() - 45)
    if result.returncode:
        return "failed", result.stderr[-1500:]
    stages.markdown.append(md_path.read_text())
    return "passed", json.loads(json_path.read_text())["goals"]


def stage_moe_bench(args, stages: Stages):
    if args.dry_run:
        return "skipped", "the fused-MoE benchmark runs on a GPU only"
    json_path = stages.out_dir / "bench_moe.json"
    result = run_command([sys.executable, "benchmarks/bench_moe.py", "--device", "cuda", "--shapes", "e64",
                          "--tokens", "1,16,64", "--json", str(json_path)], stages.left() - 5, {"TRITON_INTERPRET": "0"})
    if result.returncode:
        return "failed", result.stderr[-1500:]
    stages.markdown.append(result.stdout)
    return "passed", result.stdout.strip().splitlines()[-3:]


def environment(args) -> dict:
    import torch

    info = {"python": sys.version.split()[0], "torch": torch.__version__, "hip": torch.version.hip,
            "cuda": torch.version.cuda, "device": args.device, "dry_run": args.dry_run}
    if args.device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", nargs="?", type=Path, default=REPO / "runs" / "gpu_check")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: checks the script itself")
    parser.add_argument("--budget-s", type=float, default=465.0,
                        help="stage time budget (default: 8 minutes less a margin for the reports)")
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
    for name, function in [("gpu-marked tests: MoE / FP8 kernels vs torch (pytest -m gpu)", stage_pytest_gpu_marked),
                           ("Triton attention vs torch on the device (pytest)", stage_attention_kernels),
                           ("engine vs transformers, fp32 tiny configs", stage_parity),
                           ("engine vs transformers, bf16 default model", stage_bf16_parity),
                           ("one GPU: shared weights + device KV handoff (pytest)", stage_gpu_handoff),
                           ("KV handoff benchmark: shm / device / grpc, 8K tokens", stage_kv_handoff_bench),
                           ("decode benchmark, ~1B random checkpoint", stage_decode_bench),
                           ("fused MoE benchmark", stage_moe_bench)]:
        stages.run(name, lambda function=function: function(args, stages))
        passed = write_reports(args, stages)  # after every stage: a kill still leaves the results so far
    print(f"[gpu_check] wrote {args.out_dir / 'gpu_check.json'} and gpu_check.md; passed={passed}")
    return 0 if passed else 1


def write_reports(args, stages: Stages) -> bool:
    """OUT/gpu_check.json and OUT/gpu_check.md for the stages run so far; returns whether none failed."""
    summary = {"environment": environment(args), "stages": stages.records,
               "passed": all(r["status"] != "failed" for r in stages.records)}
    (args.out_dir / "gpu_check.json").write_text(json.dumps(summary, indent=2, default=str))
    lines = ["# gpu_check", "", f"environment: {summary['environment']}", "", "| stage | status | seconds |",
             "|---|---|--:|", *(f"| {r['stage']} | {r['status']} | {r['seconds']} |" for r in stages.records), "",
             *stages.markdown]
    (args.out_dir / "gpu_check.md").write_text("\n".join(lines) + "\n")
    return summary["passed"]

if __name__ == "__main__":
    sys.exit(main())

"""Attention backends: prefill tok/s per backend and head count, decode step time, and the torch-formulation
comparison behind TorchAttentionBackend (explicit matmul vs SDPA with Dqk != Dv vs SDPA with v padded).

Tables (median of --repeat timed runs after one warm-up):
  prefill        every backend that runs on --device, 12 vs 16 heads (12 goes through the head-padding
                 wrapper where a backend needs it); on GPUs each row also shows max |out - torch|
  decode         absorbed decode over the paged latent cache, q_len 1 and 4 (speculative verification)
  formulations   one causal sequence, float32, three ways to compute it with torch ops
Triton runs only on a GPU: on CPU it needs the interpreter (TRITON_INTERPRET=1), far too slow to time.
Dims: --dims dsv3 (q/k 192, v 128, latent 512 + 64) or tiny (the embedded model: 32, 16, 64 + 16).

Run: .venv/bin/python benchmarks/bench_attention.py [--device cpu|cuda] [--tokens 2048] [--dims dsv3]
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.attention.registry import get_attention_backend
from engine.attention.torch_backend import TorchAttentionBackend
from engine.runtime.forward_batch import build_attention_metadata

DIMS = {"dsv3": (192, 128, 512, 64), "tiny": (32, 16, 64, 16)}  # dqk, dv, latent, rope
REFERENCE_LIMIT_BYTES = 16 * 2**30


def timed(device: torch.device, repeat: int, run: Callable[[], object]) -> float:
    """Median seconds of `repeat` runs after one warm-up."""
    run()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def runnable_backends(device: torch.device) -> list[str]:
    names = ["torch"]
    if device.type != "cpu":
        names.append("triton")
        if getattr(torch.version, "hip", None) is not None:
            names.append("aiter")
    return names


def bench_prefill(args, device: torch.device, dtype: torch.dtype) -> None:
    dqk, dv, _, _ = DIMS[args.dims]
    seq_len = args.tokens // args.seqs
    lens = (seq_len,) * args.seqs
    cu = torch.arange(args.seqs + 1, dtype=torch.int32, device=device) * seq_len
    reference = TorchAttentionBackend()
    print(f"\nprefill: {args.seqs} x {seq_len} tokens, q/k {dqk}, v {dv}, {dtype}, device {device}")
    print(f"{'backend':<10}{'heads':>6}{'ms':>10}{'tok/s':>12}{'max err':>10}")
    for heads in (12, 16):
        q = torch.randn(args.tokens, heads, dqk, device=device, dtype=dtype)
        k = torch.randn(args.tokens, heads, dqk, device=device, dtype=dtype)
        v = torch.randn(args.tokens, heads, dv, device=device, dtype=dtype)
        # the torch reference materialises [H, L, L] float32 scores per sequence
        reference_fits = heads * seq_len**2 * 4 <= REFERENCE_LIMIT_BYTES
        expected = reference.prefill(q, k, v, cu, cu, lens, lens, dqk**-0.5).float() if reference_fits else None
        for name in runnable_backends(device):
            if name == "torch" and not reference_fits:
                print(f"{name:<10}{heads:>6}  skipped: {seq_len}^2 x {heads} float32 scores exceed the memory limit")
                continue
            try:
                backend = get_attention_backend(name, num_heads=heads, device=str(device))
            except ValueError as error:
                print(f"{name:<10}{heads:>6}  unavailable: {error}")
                continue
            run = lambda: backend.prefill(q, k, v, cu, cu, lens, lens, dqk**-0.5)  # noqa: E731
            error = (run().float() - expected).abs().max().item() if expected is not None else float("nan")
            seconds = timed(device, args.repeat, run)
            print(f"{name:<10}{heads:>6}{seconds * 1e3:>10.2f}{args.tokens / seconds:>12.0f}{error:>10.1e}")
    if device.type == "cpu":
        print("triton: skipped on CPU (interpreter only, far too slow to time); run with --device cuda")


def bench_decode(args, device: torch.device, dtype: torch.dtype) -> None:
    _, _, latent, rope = DIMS[args.dims]
    page_size, context = 16, args.context
    pages_per_seq = -(-context // page_size)
    cache = torch.randn(args.batch * pages_per_seq, page_size, latent + rope, device=device, dtype=dtype)
    print(f"\ndecode: batch {args.batch}, context {context}, latent {latent} + rope {rope}, page {page_size}")
    print(f"{'backend':<10}{'heads':>6}{'q_len':>6}{'ms/step':>10}{'max err':>10}")
    for q_len in (1, 4):
        tables = [list(range(i * pages_per_seq, (i + 1) * pages_per_seq)) for i in range(args.batch)]
        attn = build_attention_metadata([q_len] * args.batch, [context] * args.batch, tables, page_size, device)
        for heads in (12, 16):
            q = torch.randn(args.batch * q_len, heads, latent + rope, device=device, dtype=dtype)
            scale = (latent + rope) ** -0.5
            expected = TorchAttentionBackend().decode(q, cache, attn, scale, latent).float()
            for name in runnable_backends(device):
                try:
                    backend = get_attention_backend(name, num_heads=heads, device=str(device))
                except ValueError as error:
                    print(f"{name:<10}{heads:>6}{q_len:>6}  unavailable: {error}")
                    continue
                run = lambda: backend.decode(q, cache, attn, scale, latent)  # noqa: E731
                error = (run().float() - expected).abs().max().item()
                seconds = timed(device, args.repeat, run)
                print(f"{name:<10}{heads:>6}{q_len:>6}{seconds * 1e3:>10.3f}{error:>10.1e}")


def causal_explicit(q, k, v, scale):
    """What TorchAttentionBackend does: q/k/v [H, L, D] -> [H, L, Dv]."""
    scores = torch.matmul(q, k.transpose(1, 2)).mul_(scale)
    length = q.shape[1]
    mask = torch.ones(length, length, dtype=torch.bool, device=q.device).triu_(1)
    return torch.matmul(torch.softmax(scores.masked_fill_(mask, float("-inf")), dim=-1), v)


def causal_sdpa(q, k, v, scale):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def causal_sdpa_padded_v(q, k, v, scale):
    padded = F.pad(v, (0, q.shape[-1] - v.shape[-1]))
    return F.scaled_dot_product_attention(q, k, padded, is_causal=True, scale=scale)[..., : v.shape[-1]]


def bench_formulations(args, device: torch.device) -> None:
    print(f"\nformulations (torch, float32, one causal sequence, device {device}, {torch.get_num_threads()} threads)")
    print(f"{'dims':<8}{'heads':>6}{'len':>6}{'explicit ms':>13}{'sdpa ms':>10}{'sdpa+pad ms':>13}{'best':>12}{'max diff':>10}")
    for dims in ("tiny", "dsv3"):
        dqk, dv, _, _ = DIMS[dims]
        for length in args.lengths:
            heads = 12 if dims == "tiny" else 16
            q, k = (torch.randn(heads, length, dqk, device=device) for _ in range(2))
            v = torch.randn(heads, length, dv, device=device)
            ways = {"explicit": causal_explicit, "sdpa": causal_sdpa, "sdpa+pad": causal_sdpa_padded_v}
            outputs = {name: way(q, k, v, dqk**-0.5) for name, way in ways.items()}
            diff = max((out - outputs["explicit"]).abs().max().item() for out in outputs.values())
            ms = {name: timed(device, args.repeat, lambda w=way: w(q, k, v, dqk**-0.5)) * 1e3 for name, way in ways.items()}
            best = min(ms, key=ms.get)
            print(f"{dims:<8}{heads:>6}{length:>6}{ms['explicit']:>13.2f}{ms['sdpa']:>10.2f}{ms['sdpa+pad']:>13.2f}"
                  f"{best:>12}{diff:>10.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dims", choices=sorted(DIMS), default="dsv3")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="default: float32 on CPU, bfloat16 on GPUs")
    parser.add_argument("--tokens", type=int, default=2048, help="prefill tokens in the batch")
    parser.add_argument("--seqs", type=int, default=4, help="prefill sequences (equal lengths)")
    parser.add_argument("--batch", type=int, default=8, help="decode sequences")
    parser.add_argument("--context", type=int, default=1000, help="decode context length")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048], help="formulation sequence lengths")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["prefill", "decode", "formulations"])
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.float32 if device.type == "cpu" else torch.bfloat16)
    torch.manual_seed(0)
    if "prefill" not in args.skip:
        bench_prefill(args, device, dtype)
    if "decode" not in args.skip:
        bench_decode(args, device, dtype)
    if "formulations" not in args.skip:
        bench_formulations(args, device)


if __name__ == "__main__":
    main()

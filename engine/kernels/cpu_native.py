"""Fused CPU loops in C (engine/kernels/cpu_native.c), for the places where a small model's step is dozens of
tiny PyTorch ops in a Python loop and the dispatch, not the arithmetic, is the cost:

- kda_recurrent: KDA's recurrent form over T steps for N sequences (decode: T = 1; speculative verify: T = the
  block, with the state after every step kept). In PyTorch that is 5 ops per step per layer; on the embedded
  K3 model's verify step (3 KDA layers, T = 8) ~0.25 ms per layer of dispatch for ~0.05 MFLOP.
- markov_greedy: DSpark's greedy draft chain with the vanilla Markov head, sequential over the draft slots
  (3 ops and an argmax per slot in PyTorch).

The source is compiled on first use with the system C compiler (cc / gcc, or $CC) into a per-user cache
(PDSERVE_NATIVE_CACHE, default ~/.cache/pdserve/native), keyed by the source, the flags and the CPU's flags
(-march=native), written under a temporary name and renamed, so processes racing to build it are harmless.
Where there is no compiler or the build fails (a warning names why, once per process), off the CPU, while
autograd records, or with PDSERVE_CPU_NATIVE=0, callers use their PyTorch path.

Numerics: the same operations in the same order per element as the PyTorch path, with the K and V loops
never reassociated, so a sequence's results do not depend on how many steps one call covers (decode and verify
agree bit for bit, as speculative decoding's exactness needs). Against the PyTorch path they agree to float32
rounding (exp and the fused multiply-adds round differently): tests/engine/test_cpu_native.py."""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_native.c")
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-std=c11")
ENABLED = os.environ.get("PDSERVE_CPU_NATIVE", "1") != "0"  # (read on every call: a benchmark may flip it)
# KDA states of at most this many floats per layer call take the C loop (one thread); bigger batches of big
# heads keep PyTorch's ops, which spread over the intra-op threads. Independent of T, so a batch's decode and
# verify take the same path.
KDA_MAX_STATE_FLOATS = 1 << 21

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_tried = False
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


def cache_dir() -> Path:
    configured = os.environ.get("PDSERVE_NATIVE_CACHE")
    if configured:
        return Path(configured)
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(home) / "pdserve" / "native"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise OSError("no C compiler (cc, gcc or $CC) on PATH")
    return compiler


def build() -> Path:
    """The shared library's path, compiled now if this source, these flags and this CPU have none cached."""
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, " ".join(FLAGS).encode(), platform.machine().encode(),
                                     _cpu_flags().encode()])).hexdigest()[:16]
    directory = cache_dir()
    path = directory / f"cpu_native-{key}.so"
    if path.exists():
        return path
    compiler = _compiler()
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=directory, prefix=".build-", suffix=".so", delete=False) as tmp:
        partial = Path(tmp.name)
    try:
        result = subprocess.run([compiler, *FLAGS, "-o", str(partial), str(SOURCE), "-lm"], capture_output=True,
                                text=True, timeout=300, check=False)
        if result.returncode != 0:
            raise OSError(f"{compiler} failed ({result.returncode}): {result.stderr.strip()[-2000:]}")
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def library() -> ctypes.CDLL | None:
    """The loaded kernels, built on first call; None where they cannot be (the reason logged once)."""
    global _library, _tried
    if not ENABLED:
        return None
    if _tried:
        return _library
    with _lock:
        if not _tried:
            try:
                lib = ctypes.CDLL(str(build()))
                lib.pdserve_kda_recurrent.argtypes = [_I64] * 5 + [_PTR] * 3 + [_I64] * 2 + [_PTR, _I64, _I64] + \
                    [_PTR, _I64, _I64] + [_PTR] * 3 + [_I64] * 2
                lib.pdserve_kda_recurrent.restype = None
                lib.pdserve_markov_greedy.argtypes = [_I64] * 5 + [_PTR] * 6
                lib.pdserve_markov_greedy.restype = ctypes.c_int
                _library = lib
            except (OSError, subprocess.SubprocessError) as error:
                logger.warning("native CPU kernels unavailable, using PyTorch ops: %s", error)
            _tried = True
    return _library


def _plain(*tensors: torch.Tensor) -> bool:
    """float32 CPU tensors that autograd does not record."""
    grad = torch.is_grad_enabled()
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and not (grad and t.requires_grad) for t in tensors)


def _token_head_strides(x: torch.Tensor) -> tuple[int, int] | None:
    """x [N, T, H, D] (or [N, T, H] for beta): (stride per token n * T + t, stride per head) when the last dim
    is unit-strided and N, T flatten into one token index; else None."""
    if x.dim() == 4 and x.stride(3) != 1 and x.shape[3] > 1:
        return None
    sequences, steps = x.shape[0], x.shape[1]
    if steps == 1:
        return x.stride(0), x.stride(2)
    if sequences > 1 and x.stride(0) != steps * x.stride(1):
        return None
    return x.stride(1), x.stride(2)


def kda_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor, snapshots: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """engine/layers/kda_ops.kda_recurrent's contract (q, k, g [N, T, H, K]; v [N, T, H, V]; beta [N, T, H];
    state [N, H, K, V]; snapshots [N, >= T, H, K, V] or None, written in place when float32 and laid out
    row-major inside each step, else through a float32 temporary) -> (o [N, T, H, V], final state), all float32;
    None when this path does not apply (the caller runs PyTorch's). Whether it applies depends on the devices,
    autograd and N x H x K x V, never on T or the snapshots: decode and verify of a batch take the same path."""
    n, steps, heads, kd = q.shape
    vd = v.shape[-1]
    tensors = (q, k, v, g, beta, state)
    grad = torch.is_grad_enabled()
    if (n * heads * kd * vd > KDA_MAX_STATE_FLOATS
            or any(t.device.type != "cpu" or (grad and t.requires_grad) for t in tensors)):
        return None
    lib = library()
    if lib is None:
        return None
    q, k, v, g, beta = (_strided(t.float()) for t in (q, k, v, g, beta))
    qkg = _token_head_strides(q)
    if _token_head_strides(k) != qkg or _token_head_strides(g) != qkg:
        q, k, g = q.contiguous(), k.contiguous(), g.contiguous()
        qkg = _token_head_strides(q)
    final = state.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    out = torch.empty((n, steps, heads, vd), dtype=torch.float32)
    scratch = snapshots
    if snapshots is not None and not (snapshots.dtype == torch.float32 and snapshots.stride(4) == 1
                                      and snapshots.stride(3) == vd and snapshots.stride(2) == kd * vd):
        scratch = torch.empty((n, steps, heads, kd, vd), dtype=torch.float32)
    snap_n, snap_t = (scratch.stride(0), scratch.stride(1)) if scratch is not None else (0, 0)
    lib.pdserve_kda_recurrent(n, steps, heads, kd, vd, q.data_ptr(), k.data_ptr(), g.data_ptr(), *qkg,
                              v.data_ptr(), *_token_head_strides(v), beta.data_ptr(), *_token_head_strides(beta),
                              final.data_ptr(), out.data_ptr(), scratch.data_ptr() if scratch is not None else None,
                              snap_n, snap_t)
    if scratch is not snapshots:
        snapshots[:, :steps] = scratch
    return out, final


def _strided(x: torch.Tensor) -> torch.Tensor:
    """x itself when the C loop can walk it (_token_head_strides), else a contiguous copy."""
    return x if _token_head_strides(x) is not None else x.contiguous()


def markov_greedy(base: torch.Tensor, last: torch.Tensor, w1: torch.Tensor, w2t: torch.Tensor) -> torch.Tensor | None:
    """base [N, slots, V] float32, last [N] int64, w1 [rows >= V, R], w2t [R, V] contiguous (the vanilla Markov
    head's W2 transposed) -> the greedy draft tokens [N, slots] int64, or None when this path does not apply.
    A last token outside w1's rows is a ValueError (as the embedding lookup's IndexError in PyTorch)."""
    vocab = base.shape[-1]
    if not (_plain(base, w1, w2t) and last.dtype == torch.int64 and last.device.type == "cpu"):
        return None
    if (w2t.shape[1] != vocab or w1.shape[1] != w2t.shape[0] or w1.shape[0] < vocab
            or not (w1.is_contiguous() and w2t.is_contiguous())):
        return None
    lib = library()
    if lib is None:
        return None
    base, last = base.contiguous(), last.contiguous()
    n, slots, _ = base.shape
    tokens = torch.empty((n, slots), dtype=torch.int64)
    scratch = torch.empty(vocab, dtype=torch.float32)
    if lib.pdserve_markov_greedy(n, slots, vocab, w1.shape[1], w1.shape[0], base.data_ptr(), last.data_ptr(),
                                 w1.data_ptr(), w2t.data_ptr(), scratch.data_ptr(), tokens.data_ptr()) != 0:
        raise ValueError(f"a previous token id is outside the Markov head's {w1.shape[0]} rows: {last.tolist()}")
    return tokens

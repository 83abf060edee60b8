"""Compiles our attention kernels for real GPU targets without a GPU (ahead-of-time, like CI can).

    python -m engine.attention.triton_kernels.compile_check sm90 gfx942 gfx950

Lowers both kernels at DeepSeek-V3 dims with bf16 tensor-core dots to cubin / hsaco, proving they hold
no interpreter-only constructs. Must run in a process where TRITON_INTERPRET is not 1 (Triton builds its
own standard library in interpreter mode when that variable is set at import).
"""
from __future__ import annotations

import argparse
import logging

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from engine.attention.triton_kernels import decode, prefill

logger = logging.getLogger(__name__)

TARGETS = {
    "sm80": GPUTarget("cuda", 80, 32),
    "sm90": GPUTarget("cuda", 90, 32),
    "gfx942": GPUTarget("hip", "gfx942", 64),
    "gfx950": GPUTarget("hip", "gfx950", 64),
}

_I32 = "i32"
PREFILL_SIGNATURE = {
    **dict.fromkeys(("q_ptr", "k_ptr", "v_ptr", "out_ptr"), "*bf16"),
    **dict.fromkeys(("cu_q_ptr", "cu_k_ptr"), "*i32"),
    **dict.fromkeys(("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh",
                     "stride_ot", "stride_oh"), _I32),
    "qk_scale": "fp32",
}
PREFILL_CONSTANTS = dict(DQK=192, DV=128, BLOCK_D1=128, BLOCK_D2=64, BLOCK_DV=128, HEAD_BLOCK=16,
                         BLOCK_M=64, BLOCK_N=32, UPCAST=False)
DECODE_SIGNATURE = {
    **dict.fromkeys(("q_ptr", "cache_ptr", "out_ptr"), "*bf16"),
    "lse_ptr": "*fp32",
    **dict.fromkeys(("cu_q_ptr", "kv_lens_ptr", "block_table_ptr"), "*i32"),
    **dict.fromkeys(("stride_qt", "stride_qh", "stride_cp", "stride_cs", "stride_ot", "stride_oh", "stride_os",
                     "stride_lt", "stride_lh", "stride_bt"), _I32),
    "qk_scale": "fp32",
    "page_size": _I32,
}
DECODE_CONSTANTS = dict(LATENT=512, ROPE=64, BLOCK_L=512, BLOCK_R=64, HEAD_BLOCK=16, BLOCK_N=32, NUM_SPLITS=1,
                        UPCAST=False)
# float32 inputs: exact float32 ("ieee") dots, as the tests on GPUs use
PREFILL_FP32_SIGNATURE = {**PREFILL_SIGNATURE, **dict.fromkeys(("q_ptr", "k_ptr", "v_ptr", "out_ptr"), "*fp32")}
PREFILL_FP32_CONSTANTS = {**PREFILL_CONSTANTS, "UPCAST": True}
# split-KV variant: float32 partial outputs
DECODE_SPLIT_SIGNATURE = {**DECODE_SIGNATURE, "out_ptr": "*fp32"}
DECODE_SPLIT_CONSTANTS = {**DECODE_CONSTANTS, "NUM_SPLITS": 4}


def compile_kernel(kernel: triton.runtime.JITFunction, signature: dict, constants: dict, target: GPUTarget):
    """The compiled kernel (its .asm holds ttir .. cubin / hsaco)."""
    if not isinstance(kernel, triton.runtime.JITFunction):
        raise RuntimeError("kernels were built for the interpreter; run without TRITON_INTERPRET=1")
    full_signature = {**signature, **dict.fromkeys(constants, "constexpr")}
    return triton.compile(ASTSource(kernel, full_signature, constants), target=target)


def compile_all(target_name: str) -> dict[str, list[str]]:
    """{kernel name: stages produced} for one target name from TARGETS."""
    target = TARGETS[target_name]
    stages = {}
    for label, kernel, signature, constants in (
        ("flash_prefill_kernel", prefill.flash_prefill_kernel, PREFILL_SIGNATURE, PREFILL_CONSTANTS),
        ("flash_prefill_kernel[fp32]", prefill.flash_prefill_kernel, PREFILL_FP32_SIGNATURE, PREFILL_FP32_CONSTANTS),
        ("paged_decode_kernel", decode.paged_decode_kernel, DECODE_SIGNATURE, DECODE_CONSTANTS),
        ("paged_decode_kernel[split]", decode.paged_decode_kernel, DECODE_SPLIT_SIGNATURE, DECODE_SPLIT_CONSTANTS),
    ):
        compiled = compile_kernel(kernel, signature, constants, target)
        stages[label] = list(compiled.asm)
        logger.info("%s for %s: %s (shared memory %s bytes)", label, target_name,
                    ", ".join(compiled.asm), compiled.metadata.shared)
    return stages


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("targets", nargs="*", default=["sm90", "gfx942"], choices=sorted(TARGETS))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s compile_check %(message)s")
    for name in args.targets:
        stages = compile_all(name)
        binary = "cubin" if TARGETS[name].backend == "cuda" else "hsaco"
        if not all(binary in produced for produced in stages.values()):
            logger.error("%s: no %s produced: %s", name, binary, stages)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

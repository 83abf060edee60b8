"""Compiles our Triton kernels for real GPU targets without a GPU (ahead-of-time, like CI can).

    python -m engine.attention.triton_kernels.compile_check sm90 gfx942 gfx950 [--dims 32/16/64/16 ...]

Lowers the attention kernels (prefill, paged decode and its split-KV form) at the given head dims and the
matmul kernels (fused MoE, block-FP8 GEMM, MXFP4 GEMM) to cubin / hsaco, with the constexpr arguments the
launchers themselves compute (split_head_dim, block_for, dot_precision, the bucketed split counts), so a
launcher argument a backend refuses (tl.arange(0, 0), tf32 dots on gfx950) fails here, not on a GPU.
Must run in a process where TRITON_INTERPRET is not 1 (Triton builds its own standard library in
interpreter mode when that variable is set at import).
"""
from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from engine.attention.triton_kernels import Tiles, block_for, decode, prefill, split_head_dim
from engine.kernels import dot_precision

logger = logging.getLogger(__name__)

TARGETS = {
    "sm80": GPUTarget("cuda", 80, 32),
    "sm90": GPUTarget("cuda", 90, 32),
    "gfx942": GPUTarget("hip", "gfx942", 64),
    "gfx950": GPUTarget("hip", "gfx950", 64),
}

# Shared memory (LDS) one program may use on each target; Triton compiles past it and the launch fails
# (OutOfResources), so compile_all checks it: H100/H200 227 KiB, A100 163 KiB, MI300 64 KiB, MI355X 160 KiB.
SHARED_MEMORY_LIMIT = {"sm80": 166912, "sm90": 232448, "gfx942": 65536, "gfx950": 163840}


@dataclass(frozen=True)
class AttentionDims:
    """One model's attention head dims: prefill q/k and v head dims, decode latent and rope dims."""

    qk: int
    v: int
    latent: int
    rope: int

    @classmethod
    def parse(cls, text: str) -> AttentionDims:
        """'192/128/512/64' -> AttentionDims(192, 128, 512, 64)."""
        qk, v, latent, rope = (int(part) for part in text.split("/"))
        return cls(qk, v, latent, rope)

    def __str__(self) -> str:
        return f"{self.qk}/{self.v}/{self.latent}/{self.rope}"


DEEPSEEK_V3_DIMS = AttentionDims(192, 128, 512, 64)


@dataclass(frozen=True)
class KernelSpec:
    """One kernel launch's compile-time view: pointer / scalar types and constexpr values."""

    label: str
    kernel: object  # triton.runtime.JITFunction
    signature: dict[str, str]
    constants: dict[str, object]


def _types(names: str, kind: str) -> dict[str, str]:
    return dict.fromkeys(names.split(), kind)


def attention_specs(dims: AttentionDims, dtype: str = "bf16") -> list[KernelSpec]:
    """Prefill, decode and split-KV decode at `dims`, with the constexprs flash_prefill / paged_decode pass on
    a GPU (bf16: tensor-core dots; fp32: upcast, exact)."""
    upcast = dtype == "fp32"
    gpu_tiles = Tiles()
    block_d1, block_d2 = split_head_dim(dims.qk)
    prefill_signature = {**_types("q_ptr k_ptr v_ptr out_ptr", f"*{dtype}"), **_types("cu_q_ptr cu_k_ptr", "*i32"),
                         **_types("stride_qt stride_qh stride_kt stride_kh stride_vt stride_vh stride_ot stride_oh",
                                  "i32"), "qk_scale": "fp32"}
    prefill_constants = dict(DQK=dims.qk, DV=dims.v, BLOCK_D1=block_d1, BLOCK_D2=block_d2, BLOCK_DV=block_for(dims.v),
                             BLOCK_M=64, BLOCK_N=gpu_tiles.block_n or 32, UPCAST=upcast)
    decode_signature = {**_types("q_ptr cache_ptr out_ptr", f"*{dtype}"), "lse_ptr": "*fp32",
                        **_types("cu_q_ptr kv_lens_ptr block_table_ptr", "*i32"),
                        **_types("stride_qt stride_qh stride_cp stride_cs stride_ot stride_oh stride_os stride_lt "
                                 "stride_lh stride_bt", "i32"), "qk_scale": "fp32", "page_size": "i32"}
    decode_constants = dict(LATENT=dims.latent, ROPE=dims.rope, BLOCK_L=block_for(dims.latent),
                            BLOCK_R=block_for(dims.rope) if dims.rope else 16, HEAD_BLOCK=gpu_tiles.head_block,
                            BLOCK_N=gpu_tiles.block_n or 32, NUM_SPLITS=1, UPCAST=upcast)
    split = max(decode.SPLIT_BUCKETS)
    return [
        KernelSpec(f"flash_prefill_kernel[{dims},{dtype}]", prefill.flash_prefill_kernel, prefill_signature,
                   prefill_constants),
        KernelSpec(f"paged_decode_kernel[{dims},{dtype}]", decode.paged_decode_kernel, decode_signature,
                   decode_constants),
        KernelSpec(f"paged_decode_kernel[{dims},{dtype},split{split}]", decode.paged_decode_kernel,
                   {**decode_signature, "out_ptr": "*fp32"}, {**decode_constants, "NUM_SPLITS": split}),
    ]


def matmul_specs() -> list[KernelSpec]:
    """The fused-MoE grouped GEMM (bf16 gated; FP8 weights dequantised in the kernel), the block-FP8 GEMM
    (bf16 activations; FP8 activations) and the MXFP4 GEMM, with the launchers' precision choice."""
    from engine.kernels import fp8_gemm, fused_moe, mxfp4_gemm

    precision = dot_precision(torch.bfloat16)
    moe_signature = {**_types("a_ptr c_ptr", "*bf16"), "b_ptr": "*bf16",
                     **_types("sorted_ids_ptr block_expert_ptr num_padded_ptr", "*i32"),
                     **_types("weight_ptr b_scale_ptr", "*fp32"),
                     **_types("N K num_valid a_row_divisor stride_am stride_ak stride_be stride_bn stride_bk stride_cm "
                              "stride_cn gate_offset stride_se stride_sn stride_sk", "i32")}
    moe_constants = dict(GATED=True, MUL_WEIGHT=True, B_SCALED=False, QUANT_N=128, QUANT_K=128, PRECISION=precision,
                         BLOCK_M=16, BLOCK_N=64, BLOCK_K=64)
    gemm_signature = {"a_ptr": "*bf16", "a_scale_ptr": "*fp32", "b_ptr": "*fp8e4nv", "b_scale_ptr": "*fp32",
                      "c_ptr": "*bf16", **_types("M N K stride_am stride_ak stride_asm stride_ask stride_bn stride_bk "
                                                 "stride_bsn stride_bsk stride_cm stride_cn", "i32")}
    gemm_constants = dict(QUANT_N=128, QUANT_K=128, ACT_FP8=False, PRECISION=precision, BLOCK_M=32, BLOCK_N=64,
                          BLOCK_K=128)
    mxfp4_signature = {"x_ptr": "*bf16", **_types("packed_ptr scale_ptr", "*u8"), "out_ptr": "*fp32",
                       **_types("M N K stride_xm stride_xk stride_pn stride_pk stride_sn stride_sk stride_om stride_on",
                                "i32")}
    return [
        KernelSpec("grouped_gemm_kernel[bf16]", fused_moe.grouped_gemm_kernel, moe_signature, moe_constants),
        KernelSpec("grouped_gemm_kernel[fp8 weights]", fused_moe.grouped_gemm_kernel,
                   {**moe_signature, "b_ptr": "*fp8e4nv"}, {**moe_constants, "B_SCALED": True}),
        KernelSpec("fp8_block_gemm_kernel[bf16 act]", fp8_gemm.fp8_block_gemm_kernel, gemm_signature, gemm_constants),
        KernelSpec("fp8_block_gemm_kernel[fp8 act]", fp8_gemm.fp8_block_gemm_kernel,
                   {**gemm_signature, "a_ptr": "*fp8e4nv"}, {**gemm_constants, "ACT_FP8": True}),
        KernelSpec("mxfp4_gemm_kernel", mxfp4_gemm.mxfp4_gemm_kernel, mxfp4_signature,
                   dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, GROUP=mxfp4_gemm.GROUP_SIZE)),
    ]


def compile_kernel(spec: KernelSpec, target: GPUTarget):
    """The compiled kernel (its .asm holds ttir .. cubin / hsaco)."""
    if not isinstance(spec.kernel, triton.runtime.JITFunction):
        raise RuntimeError("kernels were built for the interpreter; run without TRITON_INTERPRET=1")
    full_signature = {**spec.signature, **dict.fromkeys(spec.constants, "constexpr")}
    return triton.compile(ASTSource(spec.kernel, full_signature, spec.constants), target=target)


def compile_all(target_name: str, specs: list[KernelSpec]) -> dict[str, list[str]]:
    """{label: stages produced} for one target name from TARGETS; raises on the first kernel that fails to
    compile or needs more shared memory than the target has, naming it."""
    target = TARGETS[target_name]
    stages = {}
    for spec in specs:
        try:
            compiled = compile_kernel(spec, target)
        except Exception as error:
            raise RuntimeError(f"{spec.label} for {target_name}: {type(error).__name__}: {error}") from error
        shared = compiled.metadata.shared
        if shared > SHARED_MEMORY_LIMIT[target_name]:
            raise RuntimeError(f"{spec.label} for {target_name}: needs {shared} bytes of shared memory, the target "
                               f"has {SHARED_MEMORY_LIMIT[target_name]} (the launch would fail)")
        stages[spec.label] = list(compiled.asm)
        logger.info("%s for %s: %s (shared memory %s bytes)", spec.label, target_name,
                    ", ".join(compiled.asm), compiled.metadata.shared)
    return stages


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("targets", nargs="*", default=["sm90", "gfx942", "gfx950"], choices=sorted(TARGETS))
    parser.add_argument("--dims", nargs="*", type=AttentionDims.parse, default=[DEEPSEEK_V3_DIMS],
                        help="attention dims qk/v/latent/rope (default: DeepSeek-V3's 192/128/512/64)")
    parser.add_argument("--no-matmul", action="store_true", help="attention kernels only")
    parser.add_argument("--fp32", action="store_true", help="also the float32 (upcast, exact) attention variants")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s compile_check %(message)s")
    specs = [spec for dims in args.dims for dtype in (("bf16", "fp32") if args.fp32 else ("bf16",))
             for spec in attention_specs(dims, dtype)]
    if not args.no_matmul:
        specs += matmul_specs()
    failed = False
    for name in args.targets:
        binary = "cubin" if TARGETS[name].backend == "cuda" else "hsaco"
        try:
            stages = compile_all(name, specs)
        except RuntimeError as error:
            logger.error("%s", error)
            failed = True
            continue
        missing = [label for label, produced in stages.items() if binary not in produced]
        if missing:
            logger.error("%s: no %s produced for %s", name, binary, missing)
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The Triton backend equals the torch reference (prefill and paged decode, padded heads, varlen, chunked
and multi-token decode, odd page fill, non-power-of-two dims); its kernels also compile for real GPUs;
the registry picks, pads and refuses backends as documented."""
from __future__ import annotations

import os

# On CPU the Triton kernels run in the interpreter. Triton picks interpreter vs compiler when a kernel is
# decorated (its own library when triton is imported, ours when our kernel modules are), so this runs
# before either import. PDSERVE_TEST_DEVICE=cuda runs the same comparisons with compiled kernels on a GPU.
DEVICE = os.environ.get("PDSERVE_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from engine.attention.base import VarlenSpans  # noqa: E402
from engine.attention.head_padding import HeadPaddedBackend  # noqa: E402
from engine.attention.registry import get_attention_backend  # noqa: E402
from engine.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from engine.runtime.forward_batch import build_attention_metadata  # noqa: E402

REFERENCE = TorchAttentionBackend()


def _triton_built_for_interpreter() -> bool:
    """Triton also builds its own library (tl.max, tl.sum, ...) in the mode TRITON_INTERPRET selects at
    its import; if something imported triton before this module set the variable, the interpreter
    cannot run our kernels in this process."""
    if "triton" not in sys.modules:
        return True
    from triton.language import standard
    from triton.runtime.jit import JITFunction

    return not isinstance(standard.max, JITFunction)


@pytest.fixture(scope="module")
def triton_backend():
    """The Triton backend behind the registry (which pads 12 -> 16 heads): interpreted on CPU, compiled on GPUs."""
    if DEVICE != "cpu":
        if not torch.cuda.is_available():
            pytest.skip(f"PDSERVE_TEST_DEVICE={DEVICE} but no GPU is visible")
        return lambda heads, **options: _backend(heads, DEVICE, **options)
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("TRITON_INTERPRET is set to something other than 1 in this environment")
    if not _triton_built_for_interpreter():
        result = subprocess.run(
            [sys.executable, "-m", "pytest", __file__, "-q", "-x", "-p", "no:cacheprovider", "-k", "triton"],
            capture_output=True, text=True, timeout=600, env=dict(os.environ, TRITON_INTERPRET="1"),
        )
        assert result.returncode == 0, result.stdout[-6000:]
        pytest.skip("triton was imported before TRITON_INTERPRET was set; these tests passed in a fresh process")
    from engine.attention import triton_kernels
    from engine.attention.triton_kernels import decode, prefill

    if not triton_kernels.kernels_interpreted():  # our modules were imported earlier without the variable
        importlib.reload(prefill)
        importlib.reload(decode)
    assert triton_kernels.kernels_interpreted()
    return lambda heads, **options: _backend(heads, "cpu", **options)


def _backend(heads: int, device: str, **options):
    """The registry's triton backend, or (with options) one built directly and padded the same way."""
    if not options:
        return get_attention_backend("triton", num_heads=heads, device=device)
    from engine.attention.triton_backend import TritonAttentionBackend

    return HeadPaddedBackend(TritonAttentionBackend(**options))


def _varlen_batch(generator, heads, dqk, dv, q_lens, extra_context):
    k_lens = [q + extra for q, extra in zip(q_lens, extra_context)]
    q = torch.randn(sum(q_lens), heads, dqk, generator=generator)
    k = torch.randn(sum(k_lens), heads, dqk, generator=generator)
    v = torch.randn(sum(k_lens), heads, dv, generator=generator)
    q, k, v = (t.to(DEVICE) for t in (q, k, v))
    return q, k, v, VarlenSpans.from_lens(tuple(q_lens), tuple(k_lens), DEVICE)


@pytest.mark.parametrize(
    ("heads", "dqk", "dv", "seed"),
    [(16, 48, 32, 0), (12, 48, 32, 1), (12, 40, 24, 2),
     pytest.param(32, 24, 16, 3, marks=pytest.mark.slow)],  # 32 heads in the interpreter: ~3.5 s of CPU
)
def test_triton_prefill_matches_torch(triton_backend, heads, dqk, dv, seed):
    """Varlen causal prefill (fresh and chunked: k_len > q_len) matches the reference within 1e-3 in fp32,
    for 12 heads padded to 16 and for non-power-of-two head dims."""
    generator = torch.Generator().manual_seed(seed)
    q_lens = torch.randint(1, 41, (3,), generator=generator).tolist()
    extra = [0] + torch.randint(1, 20, (2,), generator=generator).tolist()
    q, k, v, spans = _varlen_batch(generator, heads, dqk, dv, q_lens, extra)
    backend = triton_backend(heads)
    assert isinstance(backend, HeadPaddedBackend) == (heads % 16 != 0)
    out = backend.prefill(q, k, v, spans, dqk**-0.5)
    expected = REFERENCE.prefill(q, k, v, spans, dqk**-0.5)
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, atol=1e-3, rtol=1e-3)


def _paged_case(generator, heads, latent, rope, q_lens, kv_lens, page_size=16):
    """Pages handed out in shuffled order so the block table matters."""
    num_pages = sum(-(-n // page_size) for n in kv_lens) + 2
    order = torch.randperm(num_pages, generator=generator).tolist()
    tables, used = [], 0
    for kv_len in kv_lens:
        count = -(-kv_len // page_size)
        tables.append(order[used : used + count])
        used += count
    attn = build_attention_metadata(list(q_lens), list(kv_lens), tables, page_size, device=DEVICE)
    cache = torch.randn(num_pages, page_size, latent + rope, generator=generator).to(DEVICE)
    q = torch.randn(sum(q_lens), heads, latent + rope, generator=generator).to(DEVICE)
    return q, cache, attn


@pytest.mark.parametrize(
    ("heads", "latent", "rope", "q_lens", "kv_lens"),
    [
        (16, 32, 16, (1, 1, 1), (1, 17, 40)),  # plain decode, 17 and 40 do not divide by the page size
        (12, 32, 16, (4, 1, 3), (37, 16, 5)),  # speculative verification: several queries per sequence
        (12, 24, 8, (2, 5), (33, 5)),  # non-power-of-two latent / rope dims, q_len == kv_len
        (32, 32, 16, (8,), (40,)),
    ],
)
def test_triton_paged_decode_matches_torch(triton_backend, heads, latent, rope, q_lens, kv_lens):
    """Absorbed decode over the paged latent cache (page_size 16) matches the reference within 1e-3."""
    generator = torch.Generator().manual_seed(sum(kv_lens))
    q, cache, attn = _paged_case(generator, heads, latent, rope, q_lens, kv_lens)
    scale = (latent + rope) ** -0.5
    out = triton_backend(heads).decode(q, cache, attn, scale, latent)
    expected = REFERENCE.decode(q, cache, attn, scale, latent)
    assert out.shape == (sum(q_lens), heads, latent)
    torch.testing.assert_close(out, expected, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("splits", [2, 3])
def test_triton_split_kv_decode_matches_torch(triton_backend, splits):
    """Flash-decoding: contexts split into key ranges (some empty for short contexts) and merged by
    log-sum-exp give the same result as the reference."""
    generator = torch.Generator().manual_seed(splits)
    q, cache, attn = _paged_case(generator, 12, 32, 16, (1, 3, 2), (40, 5, 33))
    out = triton_backend(12, decode_splits=splits).decode(q, cache, attn, 0.15, 32)
    torch.testing.assert_close(out, REFERENCE.decode(q, cache, attn, 0.15, 32), atol=1e-3, rtol=1e-3)


def test_triton_bf16_inputs_keep_dtype_and_accuracy(triton_backend):
    """bf16 inputs give bf16 outputs close to the reference (the interpreter upcasts before tl.dot; GPUs
    run bf16 tensor-core dots with float32 accumulation)."""
    generator = torch.Generator().manual_seed(7)
    q, k, v, spans = _varlen_batch(generator, 16, 48, 32, [9, 20], [0, 7])
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    out = triton_backend(16).prefill(q, k, v, spans, 0.15)
    assert out.dtype == torch.bfloat16
    expected = REFERENCE.prefill(q, k, v, spans, 0.15)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)

    q, cache, attn = _paged_case(generator, 16, 32, 16, (2, 1), (19, 30))
    out = triton_backend(16).decode(q.bfloat16(), cache.bfloat16(), attn, 0.14, 32)
    expected = REFERENCE.decode(q.bfloat16(), cache.bfloat16(), attn, 0.14, 32)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(DEVICE == "cpu", reason="GPU-sized shapes; the interpreter would take minutes")
def test_triton_matches_torch_at_deepseek_dims_on_gpu(triton_backend):
    """On a GPU, at DeepSeek-V3 dims in bf16 (q/k 192, v 128; latent 512 + rope 64; several kernel tiles
    per sequence), 12 padded heads match the reference."""
    generator = torch.Generator().manual_seed(11)
    q_lens = torch.randint(200, 700, (3,), generator=generator).tolist()
    q, k, v, spans = _varlen_batch(generator, 12, 192, 128, q_lens, [0, 300, 37])
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    out = triton_backend(12).prefill(q, k, v, spans, 192**-0.5)
    expected = REFERENCE.prefill(q, k, v, spans, 192**-0.5)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)

    q, cache, attn = _paged_case(generator, 12, 512, 64, (1, 4, 1), (3000, 777, 17))
    for splits in (None, 1):
        out = triton_backend(12, decode_splits=splits).decode(q.bfloat16(), cache.bfloat16(), attn, 0.1, 512)
        expected = REFERENCE.decode(q.bfloat16(), cache.bfloat16(), attn, 0.1, 512)
        torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_triton_rejects_unpadded_head_counts(triton_backend):
    """The bare backend declares multiples of 16 only and refuses 12 heads instead of mis-computing."""
    from engine.attention.triton_backend import TritonAttentionBackend

    bare = TritonAttentionBackend()
    assert bare.supports_num_heads(16) and bare.supports_num_heads(48) and not bare.supports_num_heads(12)
    generator = torch.Generator().manual_seed(0)
    q, k, v, spans = _varlen_batch(generator, 12, 16, 16, [3], [0])
    with pytest.raises(ValueError, match="multiple of 16"):
        bare.prefill(q, k, v, spans, 0.25)


def _compile_for(target: str, *options: str) -> subprocess.CompletedProcess:
    """compile_check for one target in a fresh process without TRITON_INTERPRET (the interpreter flag changes
    how Triton builds its own library)."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    return subprocess.run([sys.executable, "-m", "engine.attention.triton_kernels.compile_check", target, *options],
                          capture_output=True, text=True, timeout=1200, env=env)


@pytest.mark.slow  # Triton lowers ~17 kernels for sm90: ~1-2 min of CPU with a cold Triton cache
def test_kernels_compile_for_sm90_at_every_head_dim_in_use():
    """Every Triton kernel lowers to a cubin for an H100/H200 (sm90) with the launchers' own constexprs, at
    every attention head dim the embedded models, the presets and the benchmark checkpoints use (bf16, and
    fp32 at the embedded models' dims as the GPU parity runs use): the tiny models' q/k head dim 32 is a
    power of two, which made split_head_dim's second block 0 and tl.arange(0, 0) refuse to compile."""
    from tests.engine.attention_dims import attention_dims_in_use, distinct_dims

    embedded = sorted({str(d) for name, d in attention_dims_in_use().items() if name.startswith("models/")})
    result = _compile_for("sm90", "--dims", *map(str, distinct_dims()))
    assert result.returncode == 0, result.stderr[-4000:]
    fp32 = _compile_for("sm90", "--no-matmul", "--fp32", "--dims", *embedded)
    assert fp32.returncode == 0, fp32.stderr[-4000:]
    for dims in distinct_dims():
        for kernel in ("flash_prefill_kernel", "paged_decode_kernel"):
            assert f"{kernel}[{dims},bf16] for sm90" in result.stderr
    assert "grouped_gemm_kernel[bf16] for sm90" in result.stderr and "cubin" in result.stderr


@pytest.mark.slow  # ~8 kernels per target: ~30-60 s of CPU each with a cold Triton cache
@pytest.mark.parametrize("target", ["gfx942", "gfx950"])
def test_kernels_compile_for_amd_targets(target):
    """The attention kernels at DeepSeek-V3 dims and every matmul kernel (fused MoE, block-FP8, MXFP4) lower
    to hsaco for MI300 (gfx942) and MI355X (gfx950): the dots' input_precision is one the HIP backend accepts
    on each (it refuses "tf32" on everything but gfx942)."""
    result = _compile_for(target)
    assert result.returncode == 0, result.stderr[-4000:]
    for kernel in ("flash_prefill_kernel", "paged_decode_kernel", "grouped_gemm_kernel[bf16]",
                   "grouped_gemm_kernel[fp8 weights]", "fp8_block_gemm_kernel[bf16 act]", "mxfp4_gemm_kernel"):
        assert kernel in result.stderr and f" for {target}: " in result.stderr
    assert "hsaco" in result.stderr


@pytest.mark.slow  # one kernel compiled for sm90 in a child process: ~5 s of CPU
def test_compile_check_refuses_a_kernel_over_the_targets_shared_memory():
    """Negative control: Triton compiles a kernel whatever shared memory it needs (the launch fails later), so
    compile_check compares it with the target's limit: with sm90's limit set to 1 KiB the fused MoE kernel
    (10 KiB) is refused, naming the kernel and both sizes."""
    script = ("from engine.attention.triton_kernels import compile_check as cc\n"
              "cc.SHARED_MEMORY_LIMIT['sm90'] = 1024\n"
              "try:\n    cc.compile_all('sm90', cc.matmul_specs()[:1])\n"
              "except RuntimeError as error:\n    print(error)\n")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                            env={**env, "TRITON_DEFAULT_FP_FUSION": "1"})
    assert "grouped_gemm_kernel[bf16] for sm90: needs" in result.stdout and "the target has 1024" in result.stdout, \
        result.stdout + result.stderr[-2000:]


def _dims_params():
    from tests.engine.attention_dims import distinct_dims

    return [pytest.param(dims, id=str(dims)) for dims in distinct_dims()]


@pytest.mark.parametrize("dims", _dims_params())
def test_triton_kernels_match_torch_at_every_head_dim_in_use(triton_backend, dims):
    """Prefill (fresh and chunked) and paged decode (one and several queries) match the reference at every
    attention head dim the embedded models, presets and benchmark checkpoints use (16 heads, short contexts:
    the interpreter is slow at DeepSeek-V3's 512-wide latent)."""
    generator = torch.Generator().manual_seed(dims.qk + dims.latent)
    q, k, v, spans = _varlen_batch(generator, 16, dims.qk, dims.v, [5, 3], [0, 4])
    out = triton_backend(16).prefill(q, k, v, spans, dims.qk**-0.5)
    torch.testing.assert_close(out, REFERENCE.prefill(q, k, v, spans, dims.qk**-0.5), atol=1e-3, rtol=1e-3)
    q, cache, attn = _paged_case(generator, 16, dims.latent, dims.rope, (1, 2), (9, 18))
    scale = (dims.latent + dims.rope) ** -0.5
    out = triton_backend(16).decode(q, cache, attn, scale, dims.latent)
    torch.testing.assert_close(out, REFERENCE.decode(q, cache, attn, scale, dims.latent), atol=1e-3, rtol=1e-3)


def test_split_counts_are_bucketed():
    """NUM_SPLITS is a constexpr: as contexts grow the chosen count takes only SPLIT_BUCKETS' few values (one
    compiled variant each), never every value from 1 to 32."""
    from unittest import mock

    from engine.attention.triton_kernels import decode

    properties = mock.Mock(multi_processor_count=132)
    with mock.patch.object(torch.cuda, "get_device_properties", return_value=properties):
        chosen = {decode.choose_num_splits(programs, kv_len, torch.device("cuda", 0))
                  for programs in (1, 4, 16, 64, 256) for kv_len in range(1, 200_000, 97)}
    assert chosen <= set(decode.SPLIT_BUCKETS) and len(chosen) > 1 and max(chosen) == max(decode.SPLIT_BUCKETS)


def test_prefill_grid_gives_every_head_its_own_programs(monkeypatch):
    """Issue 35 item 11: a 2,048-token chunk at TP8 (16 heads of DeepSeek-V3's 128 per rank) must fill an H200's
    132 SMs. The launch grid is sequences x query blocks x heads (one head per program): 1 x 32 x 16 = 512
    programs; the grid (sequences, query blocks, heads / 16) it replaced was 32."""
    from engine.attention.triton_kernels import prefill

    grids = []

    class Recorder:
        def __getitem__(self, grid):
            grids.append(grid)
            return lambda *args, **constexprs: None

    monkeypatch.setattr(prefill, "flash_prefill_kernel", Recorder())
    tokens, heads = 2048, 16
    q = torch.empty(tokens, heads, 192)
    v = torch.empty(tokens, heads, 128)
    cu = torch.tensor([0, tokens], dtype=torch.int32)
    prefill.flash_prefill(q, q, v, cu, cu, tokens, 0.1, block_m=64)
    (grid,) = grids
    assert grid == (1, 32, 16) and grid[0] * grid[1] * grid[2] >= 132


def test_registry_auto_on_cpu_is_torch_and_unpadded():
    """auto on CPU is the torch reference, which runs 12 heads natively (no wrapper)."""
    backend = get_attention_backend("auto", num_heads=12, device="cpu")
    assert isinstance(backend, TorchAttentionBackend)


def test_registry_wraps_triton_only_when_heads_need_padding(triton_backend):
    """12 heads -> HeadPaddedBackend around triton running 16; 32 heads -> the bare triton backend."""
    padded = get_attention_backend("triton", num_heads=12, device=DEVICE)
    assert isinstance(padded, HeadPaddedBackend) and padded.inner.name == "triton"
    assert padded.padded_heads(12, "prefill") == 16 and padded.padded_heads(12, "decode") == 16
    assert get_attention_backend("triton", num_heads=32, device=DEVICE).name == "triton"
    assert not isinstance(get_attention_backend("triton", num_heads=32, device=DEVICE), HeadPaddedBackend)


@pytest.mark.parametrize(("name", "message"), [("flash", "unknown attention backend"), ("aiter", "ROCm")])
def test_registry_refuses_unknown_or_unavailable_backends(name, message):
    """An unknown name, or aiter without a ROCm GPU, is a ValueError that says why."""
    with pytest.raises(ValueError, match=message):
        get_attention_backend(name, num_heads=12, device="cpu")


@pytest.mark.slow  # a child interpreter that imports the engine (torch): ~2.5 s of CPU
def test_importing_engine_attention_loads_neither_triton_nor_aiter():
    """The registry imports kernels lazily: `import engine.attention` pulls in no triton / aiter module."""
    code = (
        "import sys, engine.attention, engine.attention.registry\n"
        "loaded = [m for m in sys.modules if m.split('.')[0] in ('triton', 'aiter')"
        " or m.startswith('engine.attention.triton') or m.startswith('engine.attention.aiter')]\n"
        "assert not loaded, loaded\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_varlen_spans_refuse_fewer_keys_than_queries():
    """A prefill span whose sequence has fewer key rows than query rows (no bottom-right causal alignment) or
    whose length tuples disagree is refused when the spans are built, before any backend runs."""
    with pytest.raises(ValueError, match="k_len >= q_len"):
        VarlenSpans.from_lens((4, 2), (4, 1))
    with pytest.raises(ValueError, match="sequences"):
        VarlenSpans.from_lens((4, 2), (4,))
    spans = VarlenSpans.from_lens((3, 9), (7, 9))
    assert spans.cu_seqlens_q.tolist() == [0, 3, 12] and spans.cu_seqlens_k.tolist() == [0, 7, 16]
    assert (spans.max_q_len, spans.max_k_len) == (9, 9)

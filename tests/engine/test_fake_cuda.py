"""The engine on device "cuda" without a GPU: torch's FakeTensorMode runs prefill, decode and
speculative verify steps (with the draft), graph replays and Kimi K3 decode on fake CUDA tensors. Any op
mixing CPU and CUDA tensors raises; every op whose output shape depends on device values (nonzero, boolean
masks, bincount, unique: FakeTensorMode has no shape environment here, so it raises
DynamicOutputShapeException) fails the step; every device-to-host synchronisation outside
engine.runtime.host_fetch.fetch_to_host (the sampler's single door: .item(), .tolist(), .cpu(), .numpy(), bool(),
.to("cpu")) fails the test, and so does every blocking upload from pageable host memory
(torch.tensor(list, device="cuda"), cpu_tensor.to("cuda")) outside engine/runtime/devices.py's pinned helpers.

A CPU-only torch build has no CUDA device guard, which indexing and copies take even for fake
tensors (torch._C._ensureCUDADeviceGuardSet does not help in 2.13): fake_cuda_guard.cpp registers a
no-op one, compiled with the system C++ compiler (about 10 s) once per machine and cached."""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from engine.runtime import devices, llm_engine, step_results
from engine import engine_config
from engine.spec import spec_decode
from engine.engine_config import EngineConfig
from engine.paths import DSV3_MODEL_DIR as DEFAULT_MODEL_DIR  # the DeepSeek-V3 model + DFlash draft
from engine.runtime.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


class HostSyncError(AssertionError):
    """A device tensor was read on the host outside fetch_to_host."""


def _called_from_devices() -> bool:
    """Whether the guarded call comes from engine/runtime/devices.py (its pinned, non-blocking upload helpers, which
    fall back to a plain tensor under FakeTensorMode on a CPU-only machine)."""
    frame = sys._getframe(2)
    return frame.f_code.co_filename.endswith(os.path.join("engine", "runtime", "devices.py"))


@contextlib.contextmanager
def forbid_host_syncs(monkeypatch: pytest.MonkeyPatch, forbid_uploads: bool = True):
    """Patches the Tensor methods that copy a device tensor to the host so they raise on CUDA tensors
    (`.to("cpu")` included), and (forbid_uploads) the blocking uploads from pageable memory. Yields the list
    of fetches made through fetch_to_host."""
    fetches: list[tuple[int, ...]] = []

    def guard(name):
        original = getattr(torch.Tensor, name)

        def checked(self, *args, **kwargs):
            if self.device.type == "cuda":
                raise HostSyncError(f"Tensor.{name}() on a {self.device} tensor outside the sampler")
            return original(self, *args, **kwargs)

        return checked

    original_to = torch.Tensor.to

    def checked_to(self, *args, **kwargs):
        target = kwargs.get("device", args[0] if args and isinstance(args[0], (str, torch.device)) else None)
        if self.device.type == "cuda" and target is not None and torch.device(target).type == "cpu":
            raise HostSyncError(f"Tensor.to({target!r}) on a {self.device} tensor outside the sampler")
        if forbid_uploads and self.device.type == "cpu" and target is not None \
                and torch.device(target).type == "cuda" and not _called_from_devices():
            raise HostSyncError(f"Tensor.to({target!r}) of a pageable CPU tensor (use engine.runtime.devices.host_to_device)")
        return original_to(self, *args, **kwargs)

    def fake_fetch(tensor: torch.Tensor) -> list:
        if tensor.device.type != "cuda":
            raise HostSyncError(f"fetch_to_host got a {tensor.device} tensor: the step did not stay on the device")
        fetches.append(tuple(tensor.shape))
        zeros: list = [0] * (tensor.shape[-1] if tensor.dim() else 1)
        for size in reversed(tensor.shape[:-1]):
            zeros = [list(zeros) for _ in range(size)]
        return zeros

    original_tensor = torch.tensor

    def checked_tensor(data, *args, **kwargs):
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda" and not isinstance(data, torch.Tensor) \
                and not _called_from_devices():
            raise HostSyncError(f"torch.tensor(<{type(data).__name__}>, device={device!r}): a blocking upload "
                                "from pageable memory (use engine.runtime.devices.host_to_device)")
        return original_tensor(data, *args, **kwargs)

    for name in SYNC_METHODS:
        monkeypatch.setattr(torch.Tensor, name, guard(name))
    monkeypatch.setattr(torch.Tensor, "to", checked_to)
    if forbid_uploads:
        monkeypatch.setattr(torch, "tensor", checked_tensor)
    monkeypatch.setattr(llm_engine, "fetch_to_host", fake_fetch)
    monkeypatch.setattr(spec_decode, "fetch_to_host", fake_fetch)
    monkeypatch.setattr(step_results, "fetch_to_host", fake_fetch)
    yield fetches


def _fake_cuda_like(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="cuda")


def _preload_checkpoints(monkeypatch: pytest.MonkeyPatch) -> None:
    """safetensors cannot map files under FakeTensorMode: read the embedded model and its draft first
    and hand the loaders fake "cuda" tensors of the same shapes (the values do not matter to FakeTensorMode)."""
    from engine.model_configs.model_config import ModelConfig
    from engine.models import deepseek_v3, dflash
    from engine.weights.checkpoint import iter_checkpoint

    config = ModelConfig.from_pretrained(DEFAULT_MODEL_DIR)
    target = list(iter_checkpoint(DEFAULT_MODEL_DIR, config.num_hidden_layers))
    draft = dflash.load_file(str(DEFAULT_MODEL_DIR / "draft" / "model.safetensors"))

    def cached_checkpoint(model_dir, num_layers, skip=None, **options):
        return ((name, _fake_cuda_like(tensor)) for name, tensor in target if skip is None or not skip(name))

    monkeypatch.setattr(deepseek_v3, "iter_checkpoint", cached_checkpoint)
    monkeypatch.setattr(dflash, "load_file", lambda path: {name: _fake_cuda_like(t) for name, t in draft.items()})


def _compiled_guard(compiler: str) -> Path:
    """The guard's shared library, built once per (source, torch, compiler) and kept in the user's cache
    directory (written under a temporary name and renamed, so concurrent sessions never load half a file)."""
    torch_dir = Path(torch.__file__).parent
    source = Path(__file__).with_name("fake_cuda_guard.cpp")
    command = [compiler, "-O0", "-shared", "-fPIC", "-std=c++17", f"-I{torch_dir / 'include'}", str(source),
               f"-L{torch_dir / 'lib'}", "-lc10"]
    key = hashlib.sha256("\0".join([source.read_text(), torch.__version__, str(torch_dir), *command]).encode())
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pdserve-tests"
    library = cache / f"fake_cuda_guard-{key.hexdigest()[:16]}.so"
    if not library.exists():
        cache.mkdir(parents=True, exist_ok=True)
        partial = cache / f"{library.name}.{os.getpid()}.partial"
        subprocess.run([*command, "-o", str(partial)], check=True, timeout=600)
        partial.replace(library)
    return library


@pytest.fixture(scope="session")
def cuda_guard_for_fake_tensors() -> None:
    """Compiles (once per machine) and loads the no-op CUDA device guard (only on a torch without CUDA)."""
    if torch.backends.cuda.is_built():
        return
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("needs a C++ compiler to register a fake CUDA device guard on this CPU-only torch")
    ctypes.CDLL(str(_compiled_guard(compiler)), mode=ctypes.RTLD_GLOBAL)


@pytest.fixture()
def fake_gpu(monkeypatch: pytest.MonkeyPatch, cuda_guard_for_fake_tensors):
    """One pretend GPU for device resolution; tensors on it are FakeTensorMode tensors."""
    monkeypatch.setattr(devices, "gpu_count", lambda: 1)
    monkeypatch.setattr(engine_config, "gpu_count", lambda: 1)
    _preload_checkpoints(monkeypatch)
    with FakeTensorMode(allow_non_fake_inputs=True):
        yield


def _assert_on_cuda(engine: LLMEngine) -> None:
    runner = engine.runner
    for name, tensor in [*runner.model.named_parameters(), *runner.model.named_buffers(),
                         *runner.draft.named_parameters(), ("cache", runner.cache.buffer)]:
        assert tensor.device.type == "cuda", f"{name} is on {tensor.device}"


@pytest.mark.slow  # the whole engine (target + draft) under FakeTensorMode: ~3.5 s of CPU
def test_engine_steps_on_fake_cuda_stay_on_device(fake_gpu, monkeypatch):
    """Prefill, draft, verify (greedy and sampled) and plain decode run on "cuda" with every weight, cache
    page and metadata tensor there, no device mismatch, and the host reads device memory only through
    fetch_to_host: once per prefill step, twice per speculative step (draft tokens, then verdicts)."""
    engine = LLMEngine(EngineConfig(model_dir=str(DEFAULT_MODEL_DIR), device="cuda", attention_backend="torch",
                                    use_graphs=False, kv_memory_bytes=8 * 2**20))
    try:
        assert engine.device.type == "cuda" and engine.has_draft
        assert engine.runner.config.dtype == "bfloat16"  # the GPU default
        _assert_on_cuda(engine)
        greedy = SamplingParams(max_new_tokens=20, ignore_eos=True)
        sampled = SamplingParams(max_new_tokens=20, ignore_eos=True, temperature=0.8, top_k=20, top_p=0.9)
        plain = SamplingParams(max_new_tokens=20, ignore_eos=True, speculative=False, temperature=0.7)
        engine.add_request("greedy", list(range(1, 7)), greedy)
        engine.add_request("sampled", list(range(3, 8)), sampled)
        engine.add_request("plain", [5, 6, 7], plain)
        with forbid_host_syncs(monkeypatch) as fetches:
            engine.step()  # one prefill step for all three prompts (14 tokens)
            assert fetches == [(3,)], fetches
            fetches.clear()
            engine.step()  # draft for two sequences, then one verify + plain-decode forward
            assert len(fetches) == 2, fetches
            assert fetches[0] == (2 * (engine.config.spec_block_size - 1),)  # the draft tokens
            assert fetches[1] == (1 + 2 * 2,)  # plain token + (accept count, final token) x 2 sequences
    finally:
        engine.close()


def test_sampling_batch_on_fake_cuda_has_no_sync(fake_gpu, monkeypatch):
    """The sampler's maths (temperature, top-k, top-p, min-p, exponential race) runs on the device and
    returns device ids: the only host copy is the caller's."""
    from engine.sampling.ops import SamplingBatch

    params = [SamplingParams(temperature=0.9, top_k=5, top_p=0.8, min_p=0.05), SamplingParams()]
    with forbid_host_syncs(monkeypatch) as fetches:
        batch = SamplingBatch.from_params(params, device="cuda")
        ids = batch.repeat_rows([2, 1]).sample(torch.randn(3, 50, device="cuda"))
    assert ids.device.type == "cuda" and tuple(ids.shape) == (3,) and fetches == []


def test_cuda_without_gpu_is_a_clear_error():
    """device="cuda" on a machine with no GPU: ValueError naming the problem (the CLI prints it, exit 2)."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match="no GPU is visible"):
        EngineConfig(model_dir=str(DEFAULT_MODEL_DIR), device="cuda")


def test_a_hidden_sync_is_caught(fake_gpu, monkeypatch):
    """Negative control: a step that reads a device tensor with .tolist() outside fetch_to_host fails."""
    engine = LLMEngine(EngineConfig(model_dir=str(DEFAULT_MODEL_DIR), device="cuda", attention_backend="torch",
                                    use_graphs=False, kv_memory_bytes=8 * 2**20, draft_model_dir=""))
    try:
        original = step_results.sample_on_device
        for module in (llm_engine, step_results):  # the decode path and the prefill path (sample_tokens)
            monkeypatch.setattr(module, "sample_on_device", lambda *args: original(*args).tolist())
        engine.add_request("r", [1, 2, 3], SamplingParams(max_new_tokens=4, ignore_eos=True))
        with forbid_host_syncs(monkeypatch), pytest.raises(HostSyncError, match="outside the sampler"):
            engine.step()
    finally:
        engine.close()


def test_shared_weights_on_fake_cuda_fall_back_to_a_private_copy(fake_gpu):
    """share_weights on "cuda" with no usable device IPC (FakeTensorMode: no real GPU behind it) loads a
    private copy on the device: the engine starts, holds no weight share and every weight is on cuda."""
    engine = LLMEngine(EngineConfig(model_dir=str(DEFAULT_MODEL_DIR), device="cuda", attention_backend="torch",
                                    use_graphs=False, kv_memory_bytes=8 * 2**20, share_weights=True))
    try:
        assert engine.runner._shared_weights == []
        _assert_on_cuda(engine)
    finally:
        engine.close()


def _decode_until_prefilled(engine: LLMEngine, request_ids: list[str]) -> None:
    started: set[str] = set()
    while len(started) < len(request_ids):
        started.update(out.request_id for out in engine.step() if out.new_token_ids)


def test_plain_greedy_decode_step_has_one_host_sync(fake_gpu, monkeypatch):
    """A plain greedy decode step of three sequences (no draft) on "cuda": no dynamic-shape op, no blocking
    upload, no host read but the one fetch of the sampled ids (the goal: <= 1 host sync per plain step)."""
    engine = LLMEngine(EngineConfig(model_dir=str(DEFAULT_MODEL_DIR), device="cuda", attention_backend="torch",
                                    use_graphs=False, kv_memory_bytes=8 * 2**20, draft_model_dir=""))
    try:
        for i in range(3):
            engine.add_request(f"r{i}", [2 + i, 5, 9], SamplingParams(max_new_tokens=8, ignore_eos=True))
        with forbid_host_syncs(monkeypatch) as fetches:
            _decode_until_prefilled(engine, ["r0", "r1", "r2"])
            fetches.clear()
            engine.step()
            engine.step()
        assert fetches == [(3,), (3,)], fetches
    finally:
        engine.close()


class _FakeCudaGraph:
    """torch.cuda.CUDAGraph stand-in: capture runs the step once (eagerly, on fake tensors); replay counts."""

    replays = 0

    def replay(self) -> None:
        _FakeCudaGraph.replays += 1

    def pool(self) -> None:
        return None


def _fake_graph_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    """Streams, graphs and memory queries of torch.cuda, enough for CudaGraphRunner.capture without a GPU."""
    import types

    stream = types.SimpleNamespace(wait_stream=lambda other: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeCudaGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool=None: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (0, 0))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)


def test_graph_replay_step_on_fake_cuda_has_one_host_sync(fake_gpu, monkeypatch):
    """With captured graphs, a decode step's host side (padding, the block-table deltas, the packed input
    upload, the replay) adds no host sync, no blocking upload and no dynamic-shape op: one fetch per step,
    and the replay is used (not the eager path)."""
    from engine.runtime.cuda_graphs import CudaGraphRunner

    engine = LLMEngine(EngineConfig(model_dir=str(DEFAULT_MODEL_DIR), device="cuda", attention_backend="torch",
                                    use_graphs=False, kv_memory_bytes=8 * 2**20, draft_model_dir=""))
    try:
        _fake_graph_runtime(monkeypatch)
        runner = engine.runner
        for i in range(3):
            engine.add_request(f"g{i}", [4 + i, 1, 8], SamplingParams(max_new_tokens=8, ignore_eos=True))
        with forbid_host_syncs(monkeypatch) as fetches:  # the capture too: a GPU refuses a sync in one
            runner.graphs = CudaGraphRunner(runner, 4, (1,), max_pages=8)
            runner.graphs.capture(write_draft=False)
            assert set(runner.graphs.steps) == {(1, 1), (2, 1), (4, 1)}
            _decode_until_prefilled(engine, ["g0", "g1", "g2"])
            fetches.clear()
            before = _FakeCudaGraph.replays
            engine.step()
            engine.step()
        assert _FakeCudaGraph.replays == before + 2 and fetches == [(3,), (3,)], fetches
    finally:
        engine.close()


def _preload_k3(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Kimi K3 tiny checkpoint as fake "cuda" tensors (safetensors cannot map under FakeTensorMode), and
    its MXFP4 expert GEMM as a shape-only stand-in (a Triton launch needs real device memory)."""
    from engine.kernels import mxfp4_gemm
    from engine.layers import kda
    from engine.models import causal_lm
    from engine.paths import K3_MODEL_DIR
    from engine.weights.checkpoint import iter_checkpoint

    tensors = list(iter_checkpoint(K3_MODEL_DIR, None))

    def cached_checkpoint(model_dir, num_layers, skip=None, **options):
        return ((name, _fake_cuda_like(tensor)) for name, tensor in tensors if skip is None or not skip(name))

    monkeypatch.setattr(causal_lm, "iter_checkpoint", cached_checkpoint)
    monkeypatch.setattr(mxfp4_gemm, "mxfp4_gemm", lambda x, packed, scale: torch.empty(
        x.shape[0], packed.shape[0], dtype=torch.float32, device=x.device))
    # prefill's KDA (the chunked form groups deep-decay chunks with nonzero): fla's kernel's shapes stand in;
    # the decode step under test runs the recurrent form
    monkeypatch.setattr(kda, "fla_chunked_kda", lambda device: lambda q, k, v, g, beta, state: (
        torch.empty(v.shape, dtype=torch.float32, device=v.device), state))


@contextlib.contextmanager
def _fake_k3(monkeypatch: pytest.MonkeyPatch, use_graphs: bool):
    """The Kimi K3 tiny engine on one pretend GPU (no draft), under FakeTensorMode. use_graphs: the runner
    reserves the graphs' scratch state slot (no graph is captured: torch.cuda is not available)."""
    from engine.paths import K3_MODEL_DIR

    monkeypatch.setattr(devices, "gpu_count", lambda: 1)
    monkeypatch.setattr(engine_config, "gpu_count", lambda: 1)
    _preload_k3(monkeypatch)
    with FakeTensorMode(allow_non_fake_inputs=True):
        engine = LLMEngine(EngineConfig(model_dir=str(K3_MODEL_DIR), device="cuda", attention_backend="torch",
                                        use_graphs=use_graphs, kv_memory_bytes=8 * 2**20, draft_model_dir=""))
        try:
            yield engine
        finally:
            engine.close()


@pytest.fixture()
def fake_k3_engine(monkeypatch, cuda_guard_for_fake_tensors):
    """The Kimi K3 tiny engine on one pretend GPU (no draft, eager), under FakeTensorMode."""
    with _fake_k3(monkeypatch, use_graphs=False) as engine:
        yield engine


@pytest.mark.slow  # the K3 tiny model under FakeTensorMode: ~3 s of CPU
def test_k3_decode_step_on_fake_cuda_has_one_host_sync(fake_k3_engine, monkeypatch):
    """Kimi K3 (KDA state slots, LatentMoE over MXFP4 experts) decodes on "cuda" with no dynamic-shape op
    (LatentMoE's nonzero / bincount were), no blocking upload and one fetch per plain decode step."""
    engine = fake_k3_engine
    for i in range(2):
        engine.add_request(f"k{i}", [3 + i, 6, 2], SamplingParams(max_new_tokens=8, ignore_eos=True))
    with forbid_host_syncs(monkeypatch, forbid_uploads=False):  # prefill is not under test here
        _decode_until_prefilled(engine, ["k0", "k1"])
    with forbid_host_syncs(monkeypatch) as fetches:
        engine.step()
    assert fetches == [(2,)], fetches


def test_a_blocking_upload_is_caught(fake_gpu, monkeypatch):
    """Negative control: a decode step that uploads a Python list with torch.tensor(..., device="cuda")
    (a blocking copy from pageable memory) fails."""
    engine = LLMEngine(EngineConfig(model_dir=str(DEFAULT_MODEL_DIR), device="cuda", attention_backend="torch",
                                    use_graphs=False, kv_memory_bytes=8 * 2**20, draft_model_dir=""))
    try:
        engine.add_request("u", [1, 2, 3], SamplingParams(max_new_tokens=8, ignore_eos=True))
        original = llm_engine.sample_on_device

        def uploads_a_list(params, generators, logits):
            return original(params, generators, logits) + torch.tensor([0], device=logits.device)

        with forbid_host_syncs(monkeypatch):
            _decode_until_prefilled(engine, ["u"])
            monkeypatch.setattr(llm_engine, "sample_on_device", uploads_a_list)
            with pytest.raises(HostSyncError, match="blocking upload"):
                engine.step()
    finally:
        engine.close()


def test_a_dynamic_shape_op_is_caught(fake_gpu, monkeypatch):
    """Negative control: a decode step with an op whose output shape depends on device values (nonzero, as
    LatentMoE's expert grouping had) fails under FakeTensorMode."""
    from torch._subclasses.fake_tensor import DynamicOutputShapeException

    engine = LLMEngine(EngineConfig(model_dir=str(DEFAULT_MODEL_DIR), device="cuda", attention_backend="torch",
                                    use_graphs=False, kv_memory_bytes=8 * 2**20, draft_model_dir=""))
    try:
        engine.add_request("d", [1, 2, 3], SamplingParams(max_new_tokens=8, ignore_eos=True))
        original = llm_engine.sample_on_device
        with forbid_host_syncs(monkeypatch):
            _decode_until_prefilled(engine, ["d"])
            monkeypatch.setattr(llm_engine, "sample_on_device",
                                lambda *args: original(*args)[(original(*args) >= 0).nonzero().squeeze(1)])
            with pytest.raises(DynamicOutputShapeException):
                engine.step()
    finally:
        engine.close()


@pytest.mark.parametrize("paged", [True, False])
def test_aiter_decode_on_fake_cuda_is_graph_safe(fake_gpu, monkeypatch, paged):
    """The AITER decode path on "cuda" (uniform q_len, as a captured graph has it), page-level and token-level
    indices: no boolean-mask indexing or other dynamic-shape op, no host read, no blocking upload, and
    mla_decode_fwd gets index arrays whose shapes depend on the batch's shape only."""
    import types

    from engine.attention.aiter_backend import AiterAttentionBackend
    from engine.runtime.forward_batch import build_attention_metadata

    shapes = []

    def mla_decode_fwd(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q,
                       sm_scale=None, **options):
        shapes.append(tuple(kv_indices.shape))
        return o, None

    if paged:
        def paged_decode(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q,
                         page_size=1, sm_scale=None, **options):
            return mla_decode_fwd(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q)
        decode = paged_decode
    else:
        decode = mla_decode_fwd
    backend = AiterAttentionBackend(types.SimpleNamespace(flash_attn_varlen_func=None),
                                    types.SimpleNamespace(mla_decode_fwd=decode))
    attn = build_attention_metadata([1, 1, 1], [5, 17, 33], [[3], [4, 5], [6, 7, 8]], 16, device="cuda")
    q = torch.empty(3, 16, 48, dtype=torch.bfloat16, device="cuda")
    cache = torch.empty(10, 16, 48, dtype=torch.bfloat16, device="cuda")
    with forbid_host_syncs(monkeypatch):
        out = backend.decode(q, cache, attn, 0.1, 32)
        backend.decode(q, cache, attn, 0.1, 32)  # a second layer of the same step reuses the indices
    width = 3 if paged else 3 * 16
    assert tuple(out.shape) == (3, 16, 32) and shapes == [(3 * width + 1,)] * 2


@pytest.mark.slow  # the K3 tiny model under FakeTensorMode, graphs captured: ~5 s of CPU
def test_k3_graph_replay_step_on_fake_cuda(fake_k3_engine, monkeypatch):
    """Kimi K3's plain decode steps replay captured graphs (state slots read from the packed buffer, padding
    rows on a scratch slot) with one fetch per step and no host sync, blocking upload or dynamic-shape op."""
    from engine.runtime.cuda_graphs import CudaGraphRunner

    engine = fake_k3_engine
    _fake_graph_runtime(monkeypatch)
    runner = engine.runner
    scratch = runner.config.num_state_slots - 1  # not handed out to the two requests below
    for i in range(2):
        engine.add_request(f"kg{i}", [3 + i, 6, 2], SamplingParams(max_new_tokens=8, ignore_eos=True))
    with forbid_host_syncs(monkeypatch, forbid_uploads=False):  # prefill is not under test here
        _decode_until_prefilled(engine, ["kg0", "kg1"])
    assert scratch not in {seq.state_slot for seq in engine.scheduler.running}
    before = _FakeCudaGraph.replays
    with forbid_host_syncs(monkeypatch) as fetches:  # the capture too: a GPU refuses a sync in the middle of one
        runner.graphs = CudaGraphRunner(runner, 2, (1,), max_pages=8, scratch_state_slot=scratch)
        runner.graphs.capture(write_draft=False)
        assert set(runner.graphs.steps) == {(1, 1), (2, 1)}
        engine.step()
        engine.step()
    assert _FakeCudaGraph.replays == before + 2 and fetches == [(2,), (2,)], fetches


@pytest.mark.slow  # the K3 tiny model under FakeTensorMode, graphs captured: ~5 s of CPU
def test_k3_verify_graph_replay_on_fake_cuda(fake_k3_engine, monkeypatch):
    """Kimi K3's speculative verify steps replay captured graphs too (state slots from the packed buffer, the state
    after every position into the snapshot scratch fixed at start-up), and the commit that follows keeps the
    accepted positions: no host sync, blocking upload or dynamic-shape op, and the replay is used. Without a fixed
    scratch no verify graph is captured (none could replay)."""
    from engine.runtime.cuda_graphs import CudaGraphRunner
    from engine.runtime.step_plan import CommitStatePlan, DecodeItem, decode_plan, with_state_slots

    from torch._subclasses import fake_tensor

    engine = fake_k3_engine
    _fake_graph_runtime(monkeypatch)
    # FakeTensorMode keeps one-element tensors built from host values as real constants, which a CPU-only torch
    # cannot place on "cuda" (the torch backend's verify layout uploads the lengths of a batch of one)
    monkeypatch.setattr(fake_tensor, "CONSTANT_NUMEL_LIMIT", 0)
    runner = engine.runner
    scratch = runner.config.num_state_slots - 1  # not handed out to the two requests below
    runner.graphs = CudaGraphRunner(runner, 2, (1, 3), max_pages=8, scratch_state_slot=scratch)
    runner.graphs.capture(write_draft=False)
    assert set(runner.graphs.steps) == {(1, 1), (2, 1)}  # no snapshot scratch fixed yet: no verify graph
    runner.graphs = None
    for i in range(2):
        engine.add_request(f"kv{i}", [3 + i, 6, 2], SamplingParams(max_new_tokens=8, ignore_eos=True))
    with forbid_host_syncs(monkeypatch, forbid_uploads=False):  # prefill is not under test here
        _decode_until_prefilled(engine, ["kv0", "kv1"])
    runner.cache.state.reserve_snapshots(2, 3)  # what an engine with a draft allocates at start-up
    graphs = CudaGraphRunner(runner, 2, (1, 3), max_pages=8, scratch_state_slot=scratch)
    seqs = list(engine.scheduler.running)
    plan = decode_plan([DecodeItem([seq.last_token, 5, 7], seq.num_cached, seq.page_table.pages) for seq in seqs],
                       snapshot_state=True)
    plan = with_state_slots(plan, [seq.state_slot for seq in seqs], ())
    before = _FakeCudaGraph.replays
    with forbid_host_syncs(monkeypatch):  # the capture too: a GPU refuses a sync in the middle of one
        graphs.capture(write_draft=False)
        assert set(graphs.steps) == {(1, 1), (2, 1), (1, 3), (2, 3)}
        runner.graphs = graphs
        logits = engine.leader.execute(plan)
        engine.leader.execute(CommitStatePlan([seq.state_slot for seq in seqs], [2, 0]))
    assert _FakeCudaGraph.replays == before + 1 and logits.shape[0] == 6 and logits.device.type == "cuda"


@pytest.mark.slow  # the K3 tiny model under FakeTensorMode: ~3 s of CPU
def test_k3_graph_scratch_slot_is_never_handed_out(monkeypatch, cuda_guard_for_fake_tensors):
    """With graphs on a GPU, K3's state pool has one slot more than the engine's: the scratch slot padding rows
    read and write. The engine never hands it out (it was the last free slot before: a sequence holding it would
    have its state overwritten by every padded replay) and does not count it."""
    from engine.cache.state_pool import OutOfStateSlots

    with _fake_k3(monkeypatch, use_graphs=True) as engine:
        scratch = engine.runner.graph_state_slot
        pool = engine.state_pool
        assert scratch is not None and pool.shape.num_slots == scratch + 1
        assert engine.num_state_slots == scratch == engine.runner.config.num_state_slots
        handed = []
        with pytest.raises(OutOfStateSlots):
            while True:
                handed.append(pool.alloc())
        assert sorted(handed) == list(range(scratch))


def test_stateful_graphs_need_a_gpu_and_a_cache_of_the_engines_own():
    """Which runners capture graphs holding state: on a GPU, with a local cache or the engine's own device pool
    (a decode worker's), not on the CPU, not for a model without linear attention or without graphs."""
    from engine.runtime.model_runner import RunnerConfig, graph_state_slot

    def config(**options) -> RunnerConfig:
        base = dict(model_dir="m", draft_dir=None, dtype="bfloat16", attention_backend="triton", page_size=16,
                    num_pages=8, kv_pool="local", device="cuda", use_graphs=True, num_state_slots=5)
        return RunnerConfig(**{**base, **options})

    assert graph_state_slot(config(), True, "cuda") == 5
    assert graph_state_slot(config(kv_pool="device", page_pools=object()), True, "cuda") == 5
    assert graph_state_slot(config(), False, "cuda") is None
    assert graph_state_slot(config(use_graphs=False), True, "cuda") is None
    assert graph_state_slot(config(device="cpu"), True, "cpu") is None

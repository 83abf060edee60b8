"""Kimi Delta Attention layer (Kimi Linear / Kimi K3), heads split over tensor-parallel ranks.

x -> q|k|v projections -> depthwise causal conv (width W, state = last W-1 inputs) + SiLU -> per-head
L2 norm of q and k (q scaled by K^-1/2) -> delta-rule recurrence with per-channel decay g and
beta = sigmoid(b_proj(x)) -> per-head RMSNorm(o_norm) * sigmoid(output gate) -> o_proj (all-reduced).

State (engine/cache/state_pool.py): cache.state.conv[kda_index] [slots, W-1, 3*P_local] (q|k|v blocks) and
cache.state.recurrent[kda_index] [slots, H_local, K, V], at batch.state_slots. EXTEND runs the chunked
form and DECODE the recurrent form, each over all sequences of one length at once (kda_ragged); both continue from the slot.
On CUDA with fla importable (and agreeing with the reference), prefill uses fla's chunk_kda instead.
Parameter names are the on-disk ones (q_conv1d, f_a_proj, A_log, ...). Conv weights stay float32.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.runtime.distributed import TPGroup
from engine.runtime.forward_batch import ForwardBatch, ForwardMode
from engine.layers.kda_fla import fla_chunked_kda
from engine.layers.kda_ops import kda_gate, kda_recurrent, l2_normalize
from engine.layers.kda_ragged import conv_group, kda_chunked_group, kda_recurrent_group, length_groups, token_rows
from engine.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from engine.model_configs.kimi_linear import KimiLinearConfig
from engine.weights.sharding import shard_weight

CHUNK_SIZE = 16  # the torch prefill chunk: K3's safe gate (g >= -5) keeps every chunk factored (kda_ops)


def kda_weight_shapes(hidden: int, heads: int, head_dim: int, conv_width: int,
                      full_rank_gate: bool) -> dict[str, tuple[int, ...]]:
    """A KDA layer's tensors: name under self_attn. -> full on-disk shape. A_log is listed as [H] (its other
    accepted layouts: KimiDeltaAttention.accepts_shape). Pure: the capacity planner counts parameters with it."""
    proj, dim = heads * head_dim, head_dim
    shapes = {
        "q_proj.weight": (proj, hidden), "k_proj.weight": (proj, hidden), "v_proj.weight": (proj, hidden),
        "q_conv1d.weight": (proj, 1, conv_width), "k_conv1d.weight": (proj, 1, conv_width),
        "v_conv1d.weight": (proj, 1, conv_width), "f_a_proj.weight": (dim, hidden),
        "f_b_proj.weight": (proj, dim), "dt_bias": (proj,), "A_log": (heads,), "b_proj.weight": (heads, hidden),
        "o_norm.weight": (dim,), "o_proj.weight": (hidden, proj),
    }
    if full_rank_gate:
        shapes["g_proj.weight"] = (proj, hidden)
    else:
        shapes.update({"g_a_proj.weight": (dim, hidden), "g_b_proj.weight": (proj, dim)})
    return shapes


class KimiDeltaAttention(nn.Module):
    """x [T, hidden] -> [T, hidden]; linear_attn.num_heads / tp heads on this rank."""

    def __init__(self, config: KimiLinearConfig, layer_index: int, kda_index: int, tp: TPGroup, dtype: torch.dtype) -> None:
        super().__init__()
        lac = config.linear_attn
        if lac.num_heads % tp.size:
            raise ValueError(f"linear_attn_config.num_heads={lac.num_heads} is not divisible by tp_size={tp.size}")
        self.layer_index, self.kda_index, self.tp = layer_index, kda_index, tp
        self.total_heads = lac.num_heads
        self.num_heads = lac.num_heads // tp.size
        self.head_dim = lac.head_dim
        self.lower_bound = lac.gate_lower_bound
        self.eps = config.rms_norm_eps
        hidden, width, proj = config.hidden_size, lac.short_conv_kernel_size, lac.num_heads * lac.head_dim
        self.hidden_size, self.conv_width = hidden, width
        local = self.num_heads * self.head_dim
        self.q_proj = ColumnParallelLinear(hidden, proj, tp, dtype)
        self.k_proj = ColumnParallelLinear(hidden, proj, tp, dtype)
        self.v_proj = ColumnParallelLinear(hidden, proj, tp, dtype)
        for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
            conv = nn.Module()
            conv.weight = nn.Parameter(torch.zeros(local, 1, width, dtype=torch.float32), requires_grad=False)
            self.add_module(name, conv)
        self.f_a_proj = ReplicatedLinear(hidden, self.head_dim, dtype)
        self.f_b_proj = ColumnParallelLinear(self.head_dim, proj, tp, dtype)
        self.dt_bias = nn.Parameter(torch.zeros(local, dtype=torch.float32), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32), requires_grad=False)
        self.b_proj = ColumnParallelLinear(hidden, lac.num_heads, tp, dtype)
        self.full_rank_gate = lac.use_full_rank_gate
        if self.full_rank_gate:
            self.g_proj = ColumnParallelLinear(hidden, proj, tp, dtype)
        else:
            self.g_a_proj = ReplicatedLinear(hidden, self.head_dim, dtype)
            self.g_b_proj = ColumnParallelLinear(self.head_dim, proj, tp, dtype)
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(self.head_dim, dtype=dtype), requires_grad=False)
        self.o_proj = RowParallelLinear(proj, hidden, tp, dtype)

    # ---- weights ----
    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Local name -> full on-disk shape (kda_weight_shapes)."""
        return kda_weight_shapes(self.hidden_size, self.total_heads, self.head_dim, self.conv_width,
                                 self.full_rank_gate)

    def accepts_shape(self, local_name: str, shape: tuple[int, ...]) -> bool:
        """A_log: [H], transformers' [1, 1, H, 1] or K3's zero-padded [n >= H]; every other tensor its exact shape."""
        if local_name == "A_log":
            return shape in ((self.total_heads,), (1, 1, self.total_heads, 1)) or (
                len(shape) == 1 and shape[0] >= self.total_heads)
        return self.expected_shapes().get(local_name) == tuple(shape)

    def load_weight(self, local_name: str, tensor: torch.Tensor) -> None:
        """Copies this rank's piece of one full checkpoint tensor (local_name as in expected_shapes, or "A_log").

        A_log may be [H], transformers' [1, 1, H, 1] or K3's zero-padded [>= H]: the first H entries
        are the per-head values."""
        if not self.accepts_shape(local_name, tuple(tensor.shape)):
            raise ValueError(f"layer {self.layer_index} self_attn.{local_name}: shape {tuple(tensor.shape)}, "
                             f"expected {self.expected_shapes().get(local_name)}")
        if local_name == "A_log":
            values = tensor.reshape(-1)
            start = self.tp.rank * self.num_heads
            self.A_log.data.copy_(values[start : start + self.num_heads])
            return
        _, piece = shard_weight(f"model.layers.{self.layer_index}.self_attn.{local_name}", tensor, self.tp, 1)
        dict(self.named_parameters())[local_name].data.copy_(piece)

    # ---- forward ----
    def conv_weight(self) -> torch.Tensor:
        """[3P_local, W] float32: the q | k | v depthwise conv taps, concatenated once and kept (rebuilt when a
        tap tensor is written again)."""
        sources = (self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight)
        key = tuple((id(weight), weight._version) for weight in sources)
        if getattr(self, "_conv_key", None) != key:
            self._conv_weight = torch.cat(sources, dim=0).squeeze(1).float()
            self._conv_key, self._conv_sources = key, sources  # the sources kept: their ids stay theirs
        return self._conv_weight

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache) -> torch.Tensor:
        if batch.state_slots is None or cache.state is None:
            raise ValueError("a KDA layer needs batch.state_slots and cache.state (a model with linear attention)")
        num_tokens, heads, dim = x.shape[0], self.num_heads, self.head_dim
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)  # [T, 3P]
        conv_pool = cache.state.conv[self.kda_index]
        ssm_pool = cache.state.recurrent[self.kda_index]
        slots, lengths = batch.state_slots, batch.attn.q_lens_cpu
        snapshot = batch.snapshot_state
        uniform = batch.mode == ForwardMode.DECODE and len(set(lengths)) == 1
        if uniform:  # decode / verify: every sequence at once
            conv_out = self._conv_uniform(mixed, conv_pool, slots, len(lengths), lengths[0], cache, snapshot)
        else:
            conv_out = self._conv_each(mixed, conv_pool, batch.host_state_slots(), lengths, cache, snapshot)
        q, k, v = conv_out.view(num_tokens, 3, heads, dim).unbind(1)
        q, k = l2_normalize(q) * dim ** -0.5, l2_normalize(k)
        forget = self.f_b_proj(self.f_a_proj(x)).view(num_tokens, heads, dim)
        g = kda_gate(forget, self.dt_bias.view(heads, dim), self.A_log, self.lower_bound)
        beta = torch.sigmoid(self.b_proj(x).float())
        if uniform:
            n, t = len(lengths), lengths[0]
            snap = cache.state.snapshot_recurrent[self.kda_index, :n] if snapshot else None
            out, state = kda_recurrent(*(z.view(n, t, *z.shape[1:]) for z in (q, k, v, g, beta)),
                                       ssm_pool.index_select(0, slots), snap)
            if not snapshot:
                ssm_pool.index_copy_(0, slots, state.to(ssm_pool.dtype))
            out = out.view(num_tokens, *out.shape[2:])
        else:
            out = self._recur(q, k, v, g, beta, ssm_pool, batch.host_state_slots(), lengths, batch.mode, snapshot,
                              cache.state.snapshot_recurrent)
        gate = self.g_proj(x) if self.full_rank_gate else self.g_b_proj(self.g_a_proj(x))
        normed = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps) * self.o_norm.weight.float()
        gated = normed * torch.sigmoid(gate.float().view(num_tokens, heads, dim))
        return self.o_proj(gated.reshape(num_tokens, heads * dim).to(x.dtype))

    def _conv_uniform(self, mixed, conv_pool, slots, n: int, t: int, cache, snapshot: bool) -> torch.Tensor:
        """n sequences of t tokens each: one batched conv. Verify (snapshot): the window after each position
        goes to the snapshot scratch, the slots untouched; otherwise the slots take their new windows."""
        conv_out, window, after = conv_group(mixed.view(n, t, -1), conv_pool.index_select(0, slots), self.conv_weight())
        if snapshot:
            cache.state.snapshot_conv[self.kda_index, :n, :t] = after
        else:
            conv_pool.index_copy_(0, slots, window.to(conv_pool.dtype))
        return conv_out.view(n * t, -1)

    def _conv_each(self, mixed, conv_pool, slots: tuple[int, ...], lengths: tuple[int, ...], cache,
                   snapshot: bool) -> torch.Tensor:
        """Sequences of different lengths (prefill, mixed verify): one batched conv per length."""
        conv_out = torch.empty(mixed.shape, dtype=torch.float32, device=mixed.device)
        for length, members in length_groups(lengths):
            rows = token_rows(lengths, members, mixed.device)
            index = torch.tensor([slots[i] for i in members], dtype=torch.long, device=mixed.device)
            out, window, after = conv_group(mixed.index_select(0, rows).view(len(members), length, -1),
                                            conv_pool.index_select(0, index), self.conv_weight())
            conv_out.index_copy_(0, rows, out.view(len(members) * length, -1))
            if snapshot:  # verify: the window after each position, the slots untouched
                cache.state.snapshot_conv[self.kda_index, list(members), :length] = after.to(cache.state.snapshot_conv.dtype)
            else:
                conv_pool.index_copy_(0, index, window.to(conv_pool.dtype))
        return conv_out

    def _recur(self, q, k, v, g, beta, ssm_pool, slots: tuple[int, ...], lengths: tuple[int, ...], mode, snapshot: bool,
               snapshots) -> torch.Tensor:
        """Sequences of different lengths, one batched call per length (kda_ragged) -> o [T, H, V] float32.
        Prefill: the chunked form (fla's, one sequence at a time, where it runs); decode (and a MIXED step's
        one-token rows): the recurrent form;
        both advance the slots. Verify (snapshot): the recurrent form, the state after every position into
        snapshots[kda_index, i], the slots untouched."""
        out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
        fla = fla_chunked_kda(v.device) if mode != ForwardMode.DECODE else None
        for length, members in length_groups(lengths):
            rows = token_rows(lengths, members, v.device)
            index = torch.tensor([slots[i] for i in members], dtype=torch.long, device=v.device)
            parts = [z.index_select(0, rows).view(len(members), length, *z.shape[1:]) for z in (q, k, v, g, beta)]
            state = ssm_pool.index_select(0, index)
            if mode == ForwardMode.DECODE or (mode == ForwardMode.MIXED and length == 1):
                scratch = snapshots[self.kda_index] if snapshot else None
                o, state = kda_recurrent_group(*parts, state, scratch, members)
            elif fla is not None:
                pieces = [fla(*(part[i] for part in parts), state[i]) for i in range(len(members))]
                o, state = torch.stack([p[0] for p in pieces]), torch.stack([p[1] for p in pieces])
            else:
                o, state = kda_chunked_group(*parts, state, CHUNK_SIZE)
            out.index_copy_(0, rows, o.reshape(len(members) * length, *o.shape[2:]))
            if not snapshot:
                ssm_pool.index_copy_(0, index, state.to(ssm_pool.dtype))
        return out

"""Kimi Delta Attention maths, the torch reference: pure functions on plain tensors.

Per head, with state S in R^{K x V} (K-major, S[k, v]), log-decay g_t in R^K (<= 0), beta_t in (0, 1):
    S <- diag(exp(g_t)) S;   u_t = beta_t (v_t - S^T k_t);   S <- S + k_t u_t^T;   o_t = S^T q_t
(q and k already L2-normalised, q scaled by K^-1/2). Two forms of the same recurrence:

recurrent: token by token (decode; any batch of sequences advancing one step together).
chunked:   chunks of C tokens. Inside a chunk, with G_t = g_1 + ... + g_t (cumulative log-decay from
    the chunk start) and S_0 the state entering the chunk,
        S_t = diag(e^{G_t}) S_0 + sum_{s<=t} diag(e^{G_t - G_s}) k_s u_s^T,
    so u solves the unit-lower-triangular system (I + diag(beta) A) U = diag(beta) (V - (K * e^G) S_0)
    with A[t, s] = sum_c k_t[c] k_s[c] e^{G_t[c] - G_s[c]} for s < t, and
        o_t = S_0^T (q_t * e^{G_t}) + sum_{s<=t} (sum_c q_t[c] k_s[c] e^{G_t[c] - G_s[c]}) u_s,
        S_C = diag(e^{G_C}) S_0 + sum_s (k_s * e^{G_C - G_s}) u_s^T.
    kda_chunked forms every chunk's A and scores at once as matmuls, e^{G_t - G_s} = e^{G_t} e^{-G_s}, exact
    while a chunk's deepest log-decay stays <= MAX_FACTORED_DECAY (always, for K3's safe gate at chunk 16);
    deeper chunks use the pairwise form, which exponentiates only differences G_t - G_s with s <= t. U = U_0 - W S_0 needs no state, so only S_0 -> S_C is sequential.
Everything is computed in float32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels import cpu_native

L2_NORM_EPS = 1e-6
MAX_FACTORED_DECAY = 80.0  # deepest log-decay in a chunk factored into matmuls (e^{-G} <= e^80 < float32 max)
SOFTPLUS_THRESHOLD = 20.0


def l2_normalize(x: torch.Tensor, eps: float = L2_NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in float32."""
    x = x.float()
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def kda_gate(forget: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor, lower_bound: float | None) -> torch.Tensor:
    """forget: [T, H, K] (f_b_proj(f_a_proj(x))), dt_bias: [H, K], a_log: [H] -> log-decay g [T, H, K] float32.

    lower_bound None (Kimi Linear): g = -exp(A_log) * softplus(z); else (K3 "safe gate"):
    g = lower_bound * sigmoid(exp(A_log) * z); z = forget + dt_bias."""
    z = forget.float() + dt_bias.float()
    rate = torch.exp(a_log.float())[None, :, None]
    if lower_bound is None:
        softplus = torch.where(z > SOFTPLUS_THRESHOLD, z, torch.log1p(torch.exp(z.clamp(max=SOFTPLUS_THRESHOLD))))
        return -rate * softplus
    return lower_bound * torch.sigmoid(rate * z)


def causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of one sequence continuing from its window, then SiLU.

    x: [T, C] new pre-conv inputs; state: [W-1, C] the previous W-1 inputs (oldest first, zero at start);
    weight: [C, W] (tap W-1 multiplies the current input). -> (silu(conv) [T, C] float32, new state [W-1, C])."""
    out, window = causal_conv_batch(x[None], state[None], weight)
    return out[0], window[0, -(weight.shape[1] - 1):]


def causal_conv_batch(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """causal_conv for N sequences of T new inputs each: x [N, T, C], state [N, W-1, C], weight [C, W]
    -> (silu(conv) [N, T, C] float32, the whole window [N, W-1+T, C]: its last W-1 rows are the new state,
    rows t+1 .. t+W-1 the state after input t)."""
    width = weight.shape[1]
    window = torch.cat([state.to(x.dtype), x], dim=1)  # [N, W-1+T, C]
    frames = window.float().unfold(1, width, 1)  # [N, T, C, W]
    out = (frames * weight.float()).sum(dim=-1)
    return F.silu(out), window


def conv_windows(x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """The conv state after each of x's T inputs: x [T, C], state [W-1, C] -> [T, W-1, C] (row t = the
    window causal_conv would leave after input t; speculative verify keeps one per position)."""
    window = torch.cat([state.to(x.dtype), x], dim=0)  # [W-1+T, C]
    return window.unfold(0, state.shape[0], 1)[1:].transpose(1, 2)


def kda_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
    snapshots: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k, g: [N, T, H, K]; v: [N, T, H, V]; beta: [N, T, H]; state: [N, H, K, V]
    -> (o [N, T, H, V], final state [N, H, K, V]), all float32. N sequences advance together.
    snapshots [N, >= T, H, K, V]: also receives the state after every step t (speculative verify); a float32
    scratch is written in place (the step's state is computed straight into it), another dtype by a copy.

    On the CPU, float32 and without autograd, one C loop (engine/kernels/cpu_native.py); otherwise five
    tensor ops per step (decay, k^T S, the delta, the rank-1 update, S^T q), the per-step slices taken once
    up front. Each step's arithmetic does not depend on T, so a sequence's outputs and states
    are the same whether its tokens come one per call (decode) or several in one call (verify)."""
    fused = cpu_native.kda_recurrent(q, k, v, g, beta, state, snapshots) if q.device.type == "cpu" else None
    if fused is not None:  # the same loop in C (engine/kernels/cpu_native.py), bit-identical across T
        return fused
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    decay = torch.exp(g).unsqueeze(-1).unbind(1)  # [N, H, K, 1] per step
    k_cols, k_rows = k.unsqueeze(-1).unbind(1), k.unsqueeze(-2).unbind(1)  # [N, H, K, 1], [N, H, 1, K]
    q_rows, v_rows = q.unsqueeze(-2).unbind(1), v.unsqueeze(-2).unbind(1)  # [N, H, 1, K], [N, H, 1, V]
    betas = beta[..., None, None].unbind(1)  # [N, H, 1, 1]
    in_place = snapshots is not None and snapshots.dtype == torch.float32
    s = state.float()
    outs = []
    for t in range(q.shape[1]):
        s = s * decay[t]
        u = (v_rows[t] - torch.matmul(k_rows[t], s)) * betas[t]  # [N, H, 1, V]
        if in_place:
            s = torch.addcmul(s, k_cols[t], u, out=snapshots[:, t])
        else:
            s = torch.addcmul(s, k_cols[t], u)
            if snapshots is not None:
                snapshots[:, t] = s
        outs.append(torch.matmul(q_rows[t], s))  # [N, H, 1, V]
    return torch.stack(outs, dim=1).squeeze(3), s


def _pairwise_decay_scores(left: torch.Tensor, k: torch.Tensor, cum: torch.Tensor, diagonal: int) -> torch.Tensor:
    """[M, C, C]: entry [t, s] = sum_c left_t[c] k_s[c] e^{G_t[c] - G_s[c]}, kept where s <= t + diagonal
    (tril(diagonal)); exact for any decay. left, k, cum: [M, C, K]. Materialises [M, C, C, K]: used only for
    chunks whose decay is too deep to factor (_intra_chunk)."""
    size = cum.shape[1]
    causal = torch.ones(size, size, dtype=torch.bool, device=cum.device).tril()
    diff = (cum.unsqueeze(2) - cum.unsqueeze(1)).masked_fill(~causal[None, :, :, None], float("-inf"))
    return torch.einsum("mtc,msc,mtsc->mts", left, k, torch.exp(diff)).tril(diagonal)


def _intra_chunk(q: torch.Tensor, k: torch.Tensor, cum: torch.Tensor, decayed: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The within-chunk products of every chunk at once: q, k, cum [M, C, K], decayed = e^cum -> (A [M, C, C]
    strictly lower, scores [M, C, C] lower incl. the diagonal), A[t, s] = sum_c k_t k_s e^{G_t - G_s}, scores
    the same with q_t.

    e^{G_t - G_s} = e^{G_t} e^{-G_s}, so both are batched matmuls: row t needs e^{-G_s} for s <= t only,
    <= e^{depth_t} (depth_t: the deepest |G_s|, s <= t), safe in float32 while depth_t <= MAX_FACTORED_DECAY,
    which K3's safe gate guarantees for chunk * |lower_bound| <= 80. Deeper rows are recomputed in the exact
    pairwise form. Either way row t depends on tokens <= t only, bit for bit."""
    k_down = (k * torch.exp(-cum)).transpose(1, 2)
    a = ((k * decayed) @ k_down).tril(-1)  # (entries above the diagonal may overflow: tril drops them)
    scores = ((q * decayed) @ k_down).tril()
    deep = torch.cummax(cum.abs().amax(dim=2), dim=1).values > MAX_FACTORED_DECAY  # [M, C]
    chunks = deep.any(dim=1).nonzero().flatten()
    if chunks.numel():  # (one host sync per call)
        rows = deep[chunks, :, None]
        a[chunks] = torch.where(rows, _pairwise_decay_scores(k[chunks], k[chunks], cum[chunks], -1), a[chunks])
        scores[chunks] = torch.where(rows, _pairwise_decay_scores(q[chunks], k[chunks], cum[chunks], 0), scores[chunks])
    return a, scores


def kda_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
    chunk_size: int = 16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence. q, k, g: [T, H, K]; v: [T, H, V]; beta: [T, H]; state: [H, K, V]
    -> (o [T, H, V], final state [H, K, V]), float32; same result as kda_recurrent.

    Every chunk's local work runs at once (U = U_0 - W S_0 with U_0, W from one triangular solve, independent
    of the state entering the chunk); only the state hand-over S_0 -> S_C runs chunk after chunk."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    length, heads = q.shape[0], q.shape[1]
    pad = (-length) % chunk_size  # zero tail tokens (k = v = beta = g = 0) change neither outputs nor state
    chunks = (length + pad) // chunk_size

    def split(x: torch.Tensor) -> torch.Tensor:  # [T, H, D] -> [H * chunks, C, D]
        x = F.pad(x.float(), (0, 0, 0, 0, 0, pad)) if x.dim() == 3 else F.pad(x.float(), (0, 0, 0, pad))[..., None]
        return x.transpose(0, 1).reshape(heads * chunks, chunk_size, x.shape[-1])

    q, k, v, g, beta = split(q), split(k), split(v), split(g), split(beta)
    cum = torch.cumsum(g, dim=1)  # G_t from each chunk's start
    decayed = torch.exp(cum)
    a, scores = _intra_chunk(q, k, cum, decayed)
    system = torch.eye(chunk_size, device=q.device) + beta * a
    solved = torch.linalg.solve_triangular(system, beta * torch.cat([v, k * decayed], dim=-1), upper=False,
                                           unitriangular=True)
    u0, w = solved.split([v.shape[-1], k.shape[-1]], dim=-1)  # U = U_0 - W S_0

    def per_chunk(x: torch.Tensor) -> tuple[torch.Tensor, ...]:  # [H * chunks, ...] -> chunks x [H, ...]
        return x.view(heads, chunks, *x.shape[1:]).unbind(1)

    tail = (k * torch.exp(cum[:, -1:] - cum)).transpose(1, 2)  # (k_s e^{G_C - G_s})^T
    last = decayed[:, -1].unsqueeze(-1)  # e^{G_C}
    s = state.float()
    outs = []
    for u0_c, w_c, q_c, scores_c, tail_c, last_c in zip(*map(per_chunk, (u0, w, q * decayed, scores, tail, last))):
        u = u0_c - w_c @ s
        outs.append(q_c @ s + scores_c @ u)
        s = last_c * s + tail_c @ u
    out = torch.stack(outs, dim=1).reshape(heads, chunks * chunk_size, -1)[:, :length]
    return out.transpose(0, 1), s

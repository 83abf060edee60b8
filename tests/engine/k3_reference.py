"""A straightforward token-by-token Kimi K3 forward from the raw checkpoint (K3_SPEC section 3), written
apart from the engine's layers: plain float64 torch on the state dict, one token at a time, each KDA
layer with its own conv window and delta-rule state, each MLA layer with the list of every previous
token's (c_kv, k_pe), MXFP4 decoded by table here. Used as the test oracle for engine/models/kimi_k3.py.
"""
from __future__ import annotations

import math
from typing import Any

import torch

P = "language_model.model."
_FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def decode_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[out, in/2] + [out, in/32] uint8 -> [out, in] float64, byte by nibble (low nibble = even column)."""
    rows, half = packed.shape
    out = torch.empty(rows, 2 * half, dtype=torch.float64)
    table = torch.tensor(_FP4, dtype=torch.float64)
    for nibble, shift in ((0, 0), (1, 4)):
        code = (packed.long() >> shift) & 15
        value = table[code & 7] * torch.where(code >= 8, -1.0, 1.0)
        out[:, nibble::2] = value
    return out * (2.0 ** (scale.double() - 127)).repeat_interleave(32, dim=1)


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def situ(g: torch.Tensor, u: torch.Tensor, beta: float, lbeta: float) -> torch.Tensor:
    return beta * torch.tanh(g / beta) * torch.sigmoid(g) * lbeta * torch.tanh(u / lbeta)


class K3Reference:
    """feed(token) -> logits [vocab] float64 of that position, keeping every layer's state."""

    def __init__(self, config: dict[str, Any], state_dict: dict[str, torch.Tensor], dtype: torch.dtype = torch.float64) -> None:
        self.c = config["text_config"]
        self.dtype = dtype
        self.w = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
        c = self.c
        self.lin = c["linear_attn_config"]
        self.eps = c["rms_norm_eps"]
        self.is_mla = [(i + 1) in self.lin["full_attn_layers"] for i in range(c["num_hidden_layers"])]
        heads, dim = self.lin["num_heads"], self.lin["head_dim"]
        width = self.lin["short_conv_kernel_size"]
        self.conv = {i: torch.zeros(width - 1, 3 * heads * dim, dtype=dtype)
                     for i in range(c["num_hidden_layers"]) if not self.is_mla[i]}
        self.state = {i: torch.zeros(heads, dim, dim, dtype=dtype) for i in self.conv}
        self.kv: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {i: [] for i, m in enumerate(self.is_mla) if m}
        self.experts: dict[tuple[str, int, str], torch.Tensor] = {}

    def _agg(self, bank: list[torch.Tensor], partial: torch.Tensor, proj: str, norm: str) -> torch.Tensor:
        rows = bank + [partial]
        scores = torch.stack([(rms(v, self.w[norm], self.eps) * self.w[proj][0]).sum() for v in rows])
        p = torch.softmax(scores, dim=0)
        return sum(p[j] * rows[j] for j in range(len(rows)))

    def _kda(self, i: int, x: torch.Tensor) -> torch.Tensor:
        a = f"{P}layers.{i}.self_attn."
        w, lin = self.w, self.lin
        heads, dim = lin["num_heads"], lin["head_dim"]
        pre = torch.cat([w[a + "q_proj.weight"] @ x, w[a + "k_proj.weight"] @ x, w[a + "v_proj.weight"] @ x])
        window = torch.cat([self.conv[i], pre.unsqueeze(0)])  # [width, C], oldest first
        self.conv[i] = window[1:]
        kernel = torch.cat([w[a + f"{n}_conv1d.weight"][:, 0, :] for n in "qkv"])  # [C, width]
        mixed = (window.t() * kernel).sum(dim=1)
        mixed = mixed * torch.sigmoid(mixed)
        q, k, v = mixed.view(3, heads, dim)
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * dim ** -0.5
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        z = (w[a + "f_b_proj.weight"] @ (w[a + "f_a_proj.weight"] @ x) + w[a + "dt_bias"]).view(heads, dim)
        a_log = w[a + "A_log"].reshape(-1)[:heads].unsqueeze(1)
        if lin.get("gate_lower_bound") is not None:
            g = lin["gate_lower_bound"] * torch.sigmoid(torch.exp(a_log) * z)
        else:
            g = -torch.exp(a_log) * torch.nn.functional.softplus(z)
        beta = torch.sigmoid(w[a + "b_proj.weight"] @ x)
        if lin.get("use_full_rank_gate"):
            gate = w[a + "g_proj.weight"] @ x
        else:
            gate = w[a + "g_b_proj.weight"] @ (w[a + "g_a_proj.weight"] @ x)
        gate = gate.view(heads, dim)
        outs = []
        for h in range(heads):
            s = torch.exp(g[h]).unsqueeze(1) * self.state[i][h]  # decay rows (the k index)
            u = beta[h] * (v[h] - s.t() @ k[h])
            s = s + torch.outer(k[h], u)
            self.state[i][h] = s
            o = s.t() @ q[h]
            outs.append(rms(o, w[a + "o_norm.weight"], self.eps) * torch.sigmoid(gate[h]))
        return w[a + "o_proj.weight"] @ torch.cat(outs)

    def _mla(self, i: int, x: torch.Tensor) -> torch.Tensor:
        a = f"{P}layers.{i}.self_attn."
        w, c = self.w, self.c
        heads, nope, rope, vd = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
        q = w[a + "q_b_proj.weight"] @ rms(w[a + "q_a_proj.weight"] @ x, w[a + "q_a_layernorm.weight"], self.eps)
        q = q.view(heads, nope + rope)
        ckv = w[a + "kv_a_proj_with_mqa.weight"] @ x
        self.kv[i].append((rms(ckv[: c["kv_lora_rank"]], w[a + "kv_a_layernorm.weight"], self.eps), ckv[c["kv_lora_rank"]:]))
        kvb = w[a + "kv_b_proj.weight"].view(heads, nope + vd, c["kv_lora_rank"])
        gate = torch.sigmoid(w[a + "g_proj.weight"] @ x).view(heads, vd)
        outs = []
        for h in range(heads):
            scores, values = [], []
            for latent, k_pe in self.kv[i]:
                kv = kvb[h] @ latent
                scores.append((q[h, :nope] @ kv[:nope] + q[h, nope:] @ k_pe) / math.sqrt(nope + rope))
                values.append(kv[nope:])
            p = torch.softmax(torch.stack(scores), dim=0)
            outs.append(sum(p[j] * values[j] for j in range(len(values))) * gate[h])
        return w[a + "o_proj.weight"] @ torch.cat(outs)

    def _expert(self, m: str, e: int, name: str) -> torch.Tensor:
        key = (m, e, name)
        if key not in self.experts and f"{m}experts.{e}.{name}.weight" in self.w:  # unquantised experts
            self.experts[key] = self.w[f"{m}experts.{e}.{name}.weight"]
        if key not in self.experts:
            self.experts[key] = decode_mxfp4(self.w[f"{m}experts.{e}.{name}.weight_packed"],
                                             self.w[f"{m}experts.{e}.{name}.weight_scale"]).to(self.dtype)
        return self.experts[key]

    def _mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        w, c = self.w, self.c
        beta, lbeta = c["activation_situ_beta"], c["activation_situ_linear_beta"]
        if i < c["first_k_dense_replace"]:
            m = f"{P}layers.{i}.mlp."
            return w[m + "down_proj.weight"] @ situ(w[m + "gate_proj.weight"] @ x, w[m + "up_proj.weight"] @ x, beta, lbeta)
        m = f"{P}layers.{i}.block_sparse_moe."
        s = torch.sigmoid(w[m + "gate.weight"] @ x)
        chosen = torch.topk(s + w[m + "gate.e_score_correction_bias"], c["num_experts_per_token"]).indices.tolist()
        weights = s[chosen]
        if c["moe_renormalize"]:
            weights = weights / (weights.sum() + 1e-20)
        weights = weights * c["routed_scaling_factor"]
        u = w[m + "routed_expert_down_proj.weight"] @ x
        latent = torch.zeros_like(u)
        for weight, e in zip(weights, chosen):
            hidden = situ(self._expert(m, e, "w1") @ u, self._expert(m, e, "w3") @ u, beta, lbeta)
            latent = latent + weight * (self._expert(m, e, "w2") @ hidden)
        if c.get("latent_moe_use_norm"):
            latent = rms(latent, w[m + "routed_expert_norm.weight"], self.eps)
        y = w[m + "routed_expert_up_proj.weight"] @ latent
        sh = m + "shared_experts."
        return y + w[sh + "down_proj.weight"] @ situ(w[sh + "gate_proj.weight"] @ x, w[sh + "up_proj.weight"] @ x, beta, lbeta)

    def feed(self, token: int) -> torch.Tensor:
        w, c = self.w, self.c
        partial = w[P + "embed_tokens.weight"][token].clone()
        bank: list[torch.Tensor] = []
        for i in range(c["num_hidden_layers"]):
            L = f"{P}layers.{i}."
            mix = self._agg(bank, partial, L + "self_attention_res_proj.weight", L + "self_attention_res_norm.weight")
            x_a = rms(mix, w[L + "input_layernorm.weight"], self.eps)
            if i % c["attn_res_block_size"] == 0:
                bank.append(partial)
                partial = torch.zeros_like(partial)
            partial = partial + (self._mla(i, x_a) if self.is_mla[i] else self._kda(i, x_a))
            mix = self._agg(bank, partial, L + "mlp_res_proj.weight", L + "mlp_res_norm.weight")
            partial = partial + self._mlp(i, rms(mix, w[L + "post_attention_layernorm.weight"], self.eps))
        mix = self._agg(bank, partial, P + "output_attn_res_proj.weight", P + "output_attn_res_norm.weight")
        return w["language_model.lm_head.weight"] @ rms(mix, w[P + "norm.weight"], self.eps)

    def run(self, tokens: list[int]) -> torch.Tensor:
        """logits [len(tokens), vocab] float64, one token at a time."""
        return torch.stack([self.feed(t) for t in tokens])

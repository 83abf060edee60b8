"""Presenting a CapacityPlan: a readable two-column table, or JSON."""
from __future__ import annotations

import json

from pdserve.plan.gpus import GB
from pdserve.plan.heads import HeadPlan
from pdserve.plan.result import CapacityPlan


def _gb(value: float) -> str:
    return f"{value / GB:,.1f} GB"


def _params(count: int) -> str:
    return f"{count / 1e12:.2f}T" if count >= 1e12 else f"{count / 1e9:.1f}B"


_SHORT_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float8_e4m3fn": "fp8",
                 "float8_e4m3fnuz": "fp8 (fnuz)"}


def _padding_note(heads: HeadPlan) -> str:
    if heads.padded_heads is None:
        return ", more than AITER MLA decode runs (triton / torch backend decodes it)"
    if heads.padding_applies:
        return (f" -> padded to {heads.padded_heads} for AITER MLA decode "
                f"(+{heads.padding_overhead:.0%} attention compute)")
    return ", no padding needed"


def _hybrid_note(model: dict, kv: dict) -> str:
    if not model["kda_layers"]:
        return ""
    return f" ({model['kda_layers']} KDA with {model['kda_heads']} heads + {kv['mla_layers']} MLA)"


def _rows(plan: CapacityPlan) -> list[tuple[str, str]]:
    model, gpu, deploy, weights, kv, scale, cost = (plan.model, plan.gpu, plan.deployment, plan.weights,
                                                     plan.kv, plan.scale, plan.cost)
    heads = plan.heads
    params_note = "computed from the config's shapes" if model["params_total"] == model["params_computed"] \
        else f"--params (computed: {_params(model['params_computed'])})"
    rows = [
        ("model", f"{model['name']} ({model['source']})"),
        ("parameters", f"{_params(model['params_total'])}, {params_note}"),
        ("shape", f"{model['layers']} layers{_hybrid_note(model, kv)}, {model['attention_heads']} heads, "
                  f"{model['routed_experts']} routed experts top-{model['experts_per_token']}"
                  + (f" (LatentMoE, width {model['latent_moe_width']})" if model["latent_moe_width"] else "")
                  + f", MLA latent {model['kv_lora_rank']} + {model['rope_dim']}"),
        ("GPU", f"{gpu['name']}, {_gb(gpu['memory_bytes'])} each"),
        ("deployment", f"{deploy['gpus']} GPUs = {deploy['replicas']} x TP{deploy['tp_size']} on "
                       f"{deploy['nodes']} node(s) of {deploy['gpus_per_node']}"
                       + (" (TP all-reduce crosses nodes)" if deploy["tp_spans_nodes"] else "")),
        ("weight format", weights["linear_format"] if weights["linear_format"] == weights["expert_format"]
         else f"{weights['linear_format']}; routed experts {weights['expert_format']}"),
        ("weights", f"{_gb(weights['total_bytes'])} in all ({weights['bits_per_weight']:.2f} bits/weight), "
                    f"{_gb(weights['per_gpu_bytes'])} per GPU"),
        ("reserve", f"{_gb(weights['reserve_bytes_per_gpu'])} per GPU (activations, draft, fragmentation)"),
        ("KV budget", f"{_gb(kv['budget_bytes_per_gpu'])} per GPU"
                      + ("" if weights["fit_per_gpu"] else "  <- weights + reserve exceed the GPU")),
        ("KV per token", f"{kv['bytes_per_token']:,} bytes ({kv['dtype']}: {kv['mla_layers']} MLA layers x "
                         f"{model['kv_lora_rank'] + model['rope_dim']} latent values)"),
        ("KV tokens", f"{kv['tokens_per_gpu']:,} per GPU (= per replica: every TP rank holds the whole latent)"),
        ("state / sequence", f"{kv['state_bytes_per_request']:,} bytes per GPU ({kv['state_bytes_per_request'] / 2**20:.1f} MiB"
                             ", KDA conv + recurrent state)" if kv["state_bytes_per_request"] else "none (no linear-attention layers)"),
        ("state checkpoints", f"{kv['checkpoints_per_gpu']:,} per GPU ({_gb(kv['checkpoint_bytes_per_gpu'])}: the prefix "
                              f"cache's, {kv['checkpoint_fraction']:g} of the KV budget; pages and slots get the rest)"
         if kv["state_bytes_per_request"] else "none (no linear-attention layers)"),
        ("sequences", f"{kv['concurrent_sequences']:,} concurrent at {kv['context_len']:,} tokens of context"),
        ("heads / rank", f"{heads.heads_per_rank} ({heads.heads} / TP{heads.tp_size})" + _padding_note(heads)),
    ]
    for kernel in heads.kernels:
        runs = "unsupported" if kernel.runs_heads is None else (
            f"runs {kernel.runs_heads} heads" + (" (zero-padded)" if kernel.padded else " (native)"))
        dtypes = "/".join(_SHORT_DTYPES.get(dtype, dtype) for dtype in kernel.dtypes)
        rows.append(("", f"{kernel.name} [{kernel.role}; heads {kernel.supported}; {dtypes}]: {runs}"))
    if scale["min_gpus"] is None:
        rows.append(("smallest fit", "does not fit at any TP size the model can be split over"))
    else:
        verdict = "one node suffices" if scale["one_node_suffices"] else f"needs {scale['min_nodes']} nodes"
        rows.append(("smallest fit", f"{scale['min_gpus']} GPUs (TP{scale['min_gpus']}): {verdict}"))
    share = plan.sharing
    rows.append(("one node", f"prefill + decode TP{share['gpus']} on the same {share['gpus']} GPUs, one shared "
                             f"weight copy: {_gb(share['per_gpu_shared_bytes'])} per GPU, "
                             f"{_gb(share['kv_budget_shared_bytes'])} left for KV -> "
                             + ("fits" if share["fits_shared"] else "does NOT fit")))
    split = ("fits" if share["fits_split"] else "does NOT fit") if share["split_per_gpu_bytes"] is not None else "n/a"
    rows.append(("", f"a copy per worker: {_gb(share['per_gpu_per_worker_bytes'])} per GPU -> "
                     + ("fits" if share["fits_per_worker"] else "does NOT fit")
                     + f"; or split {share['split_gpus_per_worker']} + {share['split_gpus_per_worker']} GPUs "
                     + (f"({_gb(share['split_per_gpu_bytes'])} per GPU) -> {split}"
                        if share["split_per_gpu_bytes"] is not None else "-> n/a")))
    rows.append(("price", f"${cost['price_per_gpu_hour']:.2f}/GPU-hour ({cost['price_source']}) x "
                          f"{cost['gpus']} = ${cost['dollars_per_hour']:.2f}/hour"))
    if cost["throughput_tok_s"] is not None:
        rows.append(("tok/s per $", f"{cost['tok_s_per_dollar']:.1f} ({cost['throughput_tok_s']:g} tok/s / "
                                    f"${cost['dollars_per_hour']:.2f}/hour; "
                                    f"${cost['dollars_per_million_tokens']:.2f} per million tokens)"))
    rows.append(("verdict", "FITS" if plan.fits else "DOES NOT FIT"))
    return rows


def format_table(plan: CapacityPlan) -> str:
    rows = _rows(plan)
    width = max(len(key) for key, _ in rows)
    return "\n".join(f"{key:<{width}}  {value}" for key, value in rows) + "\n"


def format_json(plan: CapacityPlan) -> str:
    return json.dumps(plan.to_dict(), indent=2) + "\n"

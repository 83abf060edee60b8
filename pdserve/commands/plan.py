"""`pdserve plan`: does a model fit a GPU node, how much KV is left, and what a token costs."""
from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, NoReturn

from pdserve.plan.dtypes import KV_DTYPE_BYTES, WEIGHT_DTYPES, Quantization, WeightFormat, weight_format
from pdserve.plan.gpus import CATALOG, lookup_gpu
from pdserve.plan.presets import PRESETS

if TYPE_CHECKING:  # the planning itself reads the engine's tables (torch): imported when a plan is made,
    from pdserve.plan.result import CapacityPlan  # not by every `pdserve` command that builds the parser

_SUFFIXES = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parameter_count(text: str) -> int:
    """'671B', '2.8T', '6.71e11' or '671000000000' -> an int."""
    clean = text.strip().replace(",", "").replace("_", "")
    factor = _SUFFIXES.get(clean[-1:].lower(), 1.0)
    value = float(clean[:-1] if factor != 1.0 else clean) * factor
    return int(round(value))


def _fail(prog: str, message: str) -> NoReturn:
    sys.stderr.write(f"{prog}: error: {' '.join(str(message).split())}\n")
    raise SystemExit(2)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.error = lambda message: _fail(parser.prog, message)  # type: ignore[method-assign]  # one line, no usage dump
    parser.add_argument("--model", default="kimi-k3",
                        help=f"a preset ({', '.join(PRESETS)}) or an HF config.json / model folder (default kimi-k3)")
    parser.add_argument("--params", type=parameter_count, default=None,
                        help="total parameters, e.g. 2.8T or 671B (default: computed from the config's shapes)")
    parser.add_argument("--gpu", default="MI355X", help=f"GPU: {', '.join(CATALOG)} (default MI355X)")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs in the deployment (default 8)")
    parser.add_argument("--tp-size", type=int, default=None, help="tensor-parallel size (default: --gpus)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    parser.add_argument("--gpu-memory-gb", type=float, default=None, help="override the GPU's memory (GB)")
    parser.add_argument("--gpu-price", type=float, default=None, help="override the $/GPU-hour")
    parser.add_argument("--weight-dtype", default=None,
                        help=f"{' | '.join(WEIGHT_DTYPES)} for all linear weights (default: as the model ships)")
    parser.add_argument("--expert-dtype", default=None,
                        help="format of the routed experts only (default: --weight-dtype, else as shipped)")
    parser.add_argument("--int4-group-size", type=int, default=None, help="weights per int4 scale (default 32)")
    parser.add_argument("--int4-scale-dtype", default=None, help="bf16 | fp16 | fp32 (default bf16)")
    parser.add_argument("--kv-dtype", default="bf16", help=f"{' | '.join(KV_DTYPE_BYTES)} (default bf16)")
    parser.add_argument("--context-len", type=int, default=8192, help="tokens per sequence (default 8192)")
    parser.add_argument("--reserve-fraction", type=float, default=0.10,
                        help="fraction of GPU memory kept free for activations etc. (default 0.10)")
    parser.add_argument("--reserve-gb", type=float, default=0.0, help="GB kept free on top of it (default 0)")
    parser.add_argument("--throughput", type=float, default=None,
                        help="measured tok/s of the deployment, for tok/s per $ (= tok/s / (GPUs x $/GPU-hour))")
    parser.add_argument("--checkpoint-memory-fraction", type=float, default=0.125,
                        help="KDA models: the prefix cache's state checkpoints' share of the KV budget (default 0.125, "
                             "the engine's)")
    parser.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                        help="plan for workers run with --no-prefix-cache (no state checkpoints)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _format(name: str | None, shipped: WeightFormat, group: int | None, scale: str | None) -> WeightFormat:
    name = name or shipped.name
    if name == shipped.name and group is None and scale is None:
        return shipped
    shipped_group = shipped.group_size if shipped.name == "int4" else 32
    return weight_format(name, group if group is not None else shipped_group, scale or "bf16")


def make_plan(args: argparse.Namespace) -> CapacityPlan:
    """Builds and runs the request the arguments describe; ValueError on any bad input."""
    from pdserve.plan.capacity import PlanRequest
    from pdserve.plan.model_source import load_model
    from pdserve.plan.params import count_parameters
    from pdserve.plan.result import build_plan

    model = load_model(args.model)
    computed = count_parameters(model.config)
    if args.params is not None and args.params <= 0:
        raise ValueError(f"--params must be positive, got {args.params}")
    params = computed if args.params is None else computed.scaled_to(args.params)
    if args.gpu_memory_gb is not None and not args.gpu_memory_gb > 0:
        raise ValueError(f"--gpu-memory-gb must be positive, got {args.gpu_memory_gb}")
    if args.gpu_price is not None and not args.gpu_price > 0:
        raise ValueError(f"--gpu-price must be positive, got {args.gpu_price}")
    quantization = Quantization(
        _format(args.weight_dtype, model.quantization.linear, args.int4_group_size, args.int4_scale_dtype),
        _format(args.expert_dtype or args.weight_dtype, model.quantization.experts, args.int4_group_size,
                args.int4_scale_dtype),
    )
    request = PlanRequest(
        model=model.config, params=params, quantization=quantization,
        gpu=lookup_gpu(args.gpu, args.gpu_memory_gb, args.gpu_price), gpus=args.gpus,
        tp_size=args.gpus if args.tp_size is None else args.tp_size, kv_dtype=args.kv_dtype,
        gpus_per_node=args.gpus_per_node, context_len=args.context_len, reserve_fraction=args.reserve_fraction,
        reserve_gb=args.reserve_gb, throughput=args.throughput, hybrid=model.hybrid,
        checkpoint_fraction=args.checkpoint_memory_fraction if args.prefix_cache else 0.0,
    )
    return build_plan(request, model.name, model.source, computed.total)


def run(args: argparse.Namespace) -> int:
    from pdserve.plan.report import format_json, format_table

    try:
        plan = make_plan(args)
    except (ValueError, OSError) as error:
        sys.stderr.write(f"pdserve plan: error: {' '.join(str(error).split())}\n")
        return 2
    sys.stdout.write(format_json(plan) if args.json else format_table(plan))
    return 0

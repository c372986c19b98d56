"""``splitserve advise``: should this model and workload disaggregate, with what ratio and
what tensor parallelism per pool?

    splitserve advise --model llama-3.1-8b --gpu h100 --link roce400 \\
        --slo-ttft 2 --slo-tpot 0.012 --rate 4 --prompt-len 4000 --output-len 256

Thin: parses arguments, calls :mod:`splitserve_operator.sim.advise` and prints its
answer with the InferenceService it recommends (YAML). Reads only the model's
``config.json`` (never loads torch or weights).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        required=True,
        help="a config.json, a checkpoint folder, or a known name (smollm2-135m, llama-3.1-8b, "
        "llama-3.1-70b, qwen2.5-7b, llama-2-7b, llama-2-70b)",
    )
    p.add_argument("--gpu", default=None, help="GPU kind for both pools: h100, h200, a100, l40s")
    p.add_argument("--prefill-gpu", default=None, help="GPU kind of the prefill pool")
    p.add_argument("--decode-gpu", default=None, help="GPU kind of the decode pool")
    p.add_argument("--link", required=True, help="KV link: pcie4, pcie5, roce400, nvlink")
    p.add_argument("--slo-ttft", type=float, required=True, help="TTFT target, seconds")
    p.add_argument("--slo-tpot", type=float, required=True, help="TPOT target, seconds")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", default=None, help="Mooncake .jsonl or Azure .csv trace")
    src.add_argument("--rate", type=float, default=None, help="Poisson arrival rate, req/s")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (with --rate)")
    p.add_argument("--output-len", type=int, default=None, help="output tokens (with --rate)")
    p.add_argument(
        "--gpus",
        type=int,
        default=8,
        help="GPU budget: the most GPUs the rate is sized with, and where goodput per GPU "
        "at scale is measured (default 8)",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=None,
        help="tensor parallelism of every pool (default: each pool's searched, from the "
        "smallest that holds the weights up to 8)",
    )
    p.add_argument("--prefill-tp", type=int, default=None, help="the prefill pool's only")
    p.add_argument(
        "--decode-tp",
        type=int,
        default=None,
        help="the decode pool's only",
    )
    p.add_argument("--no-layerwise", action="store_true", help="send KV only after prefill ends")
    p.add_argument("--chunk-size", type=int, action="append", default=None,
                   help="colocated chunk size to try (repeatable; default 128..2048)")  # fmt: skip
    p.add_argument("--requests", type=int, default=1000, help="requests simulated per probe")
    p.add_argument(
        "--dtype-bytes", type=int, default=2, help="bytes per weight/KV element (2: bf16)"
    )
    p.add_argument("--json", action="store_true", help="print JSON")


def run(args: argparse.Namespace) -> int:
    from splitserve_operator.sim.advise import CHUNK_SIZES, advise, workload_for_advice
    from splitserve_operator.sim.config import ConfigError, Slo
    from splitserve_operator.sim.hardware import HardwareError, get_gpu, get_link
    from splitserve_operator.sim.model_spec import ModelSpecError, load_model_spec
    from splitserve_operator.sim.traces import load_trace
    from splitserve_operator.sim.workload import WorkloadError

    try:
        pg_name = args.prefill_gpu or args.gpu
        if pg_name is None:
            raise HardwareError("give --gpu (or --prefill-gpu and --decode-gpu)")
        prefill_gpu = get_gpu(pg_name)
        decode_gpu = get_gpu(args.decode_gpu or args.gpu or pg_name)
        link = get_link(args.link)
        model = load_model_spec(args.model, dtype_bytes=args.dtype_bytes)
        if args.trace:
            workload = load_trace(Path(args.trace))
        else:
            if args.prompt_len is None or args.output_len is None:
                raise WorkloadError("--rate needs --prompt-len and --output-len")
            workload = workload_for_advice(
                args.rate, args.prompt_len, args.output_len, n=args.requests
            )
        advice = advise(
            model,
            prefill_gpu,
            link,
            Slo(args.slo_ttft, args.slo_tpot),
            workload,
            decode_gpu=decode_gpu,
            gpus=args.gpus,
            tp=args.tp,
            prefill_tp=args.prefill_tp,
            decode_tp=args.decode_tp,
            layerwise=not args.no_layerwise,
            chunk_sizes=tuple(args.chunk_size) if args.chunk_size else CHUNK_SIZES,
            max_requests=args.requests,
        )
    except (HardwareError, ModelSpecError, WorkloadError, ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(advice.as_dict(), indent=2))
    else:
        import yaml

        print(advice.render())
        print("\nInferenceService (set the model's source, the image and resources):")
        print(yaml.safe_dump(advice.inference_service(), sort_keys=False).rstrip())
    return 0

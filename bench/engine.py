"""Engine throughput against transformers' own continuous batching, and against the
hardware's roofline.

Runs a model through this engine and through ``model.generate_batch`` (transformers'
``ContinuousBatchingManager`` with its paged cache) on the same prompts, on the same
device, in the same process, one after the other, and prints:

- decode tokens/s per batch size: tokens produced after every request of the batch has
  its first token, divided by the time from then to the last token (the same per-token
  timestamps are used for both engines). On the CPU at batch 1, 8 and 16 with 64-token
  prompts (SmolLM2-135M in float32 by default); on CUDA at batch 1, 16 and 64 with
  1,024-token prompts (bfloat16 by default);
- prefill tokens/s (CPU): prompt tokens divided by the time until every request of a
  batch of long prompts has its first token;
- this engine's fraction of the roofline at batch 16: the step time the hardware allows,
  the larger of (weights + KV bytes read per step / measured copy bandwidth) and (FLOPs
  per step / measured matmul throughput, same device, dtype and threads), divided by the
  measured step time (16 / decode tokens/s).

Greedy outputs of both are compared (they must agree on the first tokens; float32).
Ends with ``RESULT engine_vs_transformers_decode_b16=<ratio> decode_b16_vs_roofline=<f>``.

Each measurement runs ``--rounds`` times, alternating the two engines, and the best
rate of each is kept, so a burst of load from other processes on a shared machine
does not decide the ratio.

    .venv/bin/python bench/engine.py [--device cpu|cuda] [--threads 2] [--new-tokens 16]
        [--rounds 2] [--attention-backend auto] [--no-cuda-graphs] [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from splitserve.sampling import SamplingParams
from splitserve_worker.engine.async_engine import AsyncEngine
from splitserve_worker.engine.config import ATTENTION_BACKENDS, EngineConfig
from splitserve_worker.engine.engine import Engine
from splitserve_worker.models import BUILTIN_MODEL, LoadedModel, load_model

PREFILL_PROMPT_LEN = 256
PREFILL_BATCH = 4
ROOFLINE_BATCH = 16


@dataclass(frozen=True)
class Plan:
    """What one device measures."""

    batches: tuple[int, ...]
    prompt_len: int
    new_tokens: int
    num_blocks: int
    max_batch_tokens: int
    prefill: bool


CPU_PLAN = Plan((1, 8, 16), 64, 16, 512, 2048, prefill=True)
CUDA_PLAN = Plan((1, 16, 64), 1024, 64, 8192, 8192, prefill=False)


@dataclass
class Timed:
    """Per request: when it was submitted, and the time each generated token appeared."""

    start: float
    stamps: dict[str, list[float]]
    tokens: dict[str, list[int]]

    def decode_rate(self) -> float:
        begin = max(s[0] for s in self.stamps.values())
        end = max(s[-1] for s in self.stamps.values())
        n = sum(1 for s in self.stamps.values() for t in s if t > begin)
        return n / (end - begin) if end > begin else float("nan")

    def prefill_rate(self, prompt_tokens: int) -> float:
        return prompt_tokens / (max(s[0] for s in self.stamps.values()) - self.start)


# ---- the roofline ----
@dataclass(frozen=True)
class Hardware:
    copy_bytes_per_s: float
    """Bytes moved (read plus written) per second by one large copy."""
    matmul_flops_per_s: float


@dataclass(frozen=True)
class ModelCost:
    weight_bytes: int
    """Bytes of every matmul weight (the LM head included), each read once per step."""
    linear_params: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    elem_bytes: int

    def step_bytes(self, batch: int, context: float) -> float:
        """Weights plus every sequence's K and V read by one decode step."""
        kv = batch * context * self.num_layers * 2 * self.num_kv_heads * self.head_dim
        return self.weight_bytes + kv * self.elem_bytes

    def step_flops(self, batch: int, context: float) -> float:
        """Matmuls (2 per weight per row) plus attention (scores and values)."""
        attention = 4 * batch * context * self.num_layers * self.num_heads * self.head_dim
        return 2 * batch * self.linear_params + attention


def model_cost(model: Any) -> ModelCost:
    weights = {id(m.weight): m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)}
    cfg = model.config
    heads = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    elem = next(iter(weights.values())).element_size()
    return ModelCost(
        weight_bytes=sum(w.numel() * w.element_size() for w in weights.values()),
        linear_params=sum(w.numel() for w in weights.values()),
        num_layers=int(cfg.num_hidden_layers),
        num_heads=heads,
        num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
        head_dim=head_dim,
        elem_bytes=elem,
    )


def roofline_step_s(cost: ModelCost, hw: Hardware, batch: int, context: float) -> float:
    """The step time the hardware allows: bound by memory or by arithmetic."""
    return max(
        cost.step_bytes(batch, context) / hw.copy_bytes_per_s,
        cost.step_flops(batch, context) / hw.matmul_flops_per_s,
    )


def measure_hardware(device: torch.device, dtype: torch.dtype) -> Hardware:
    """Best of a few: one large copy (bytes read plus written per second) and one large
    square matmul in ``dtype`` (2 n^3 FLOPs per second), on the torch threads set."""
    cuda = device.type == "cuda"
    copy_n = (1 << 30) if cuda else (128 << 20)  # bytes, well past the caches
    src = torch.ones(copy_n // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    n = 8192 if cuda else 2048
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)

    def best(fn: Callable[[], object], times: int) -> float:
        fn()
        out = float("inf")
        for _ in range(times):
            if cuda:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize(device)
            out = min(out, time.perf_counter() - t0)
        return out

    copy_s = best(lambda: dst.copy_(src), 10 if cuda else 5)
    mm_s = best(lambda: torch.mm(a, b), 10 if cuda else 3)
    return Hardware(2 * copy_n / copy_s, 2 * n**3 / mm_s)


# ---- the runs ----
def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def fresh(n: int, length: int, vocab: int, base: int) -> Callable[[int], list[list[int]]]:
    """Prompts for round ``r``: new ones every round."""
    return lambda r: prompts(n, length, vocab, seed=base + r)


def run_engine(engine: AsyncEngine, batch: list[list[int]], new_tokens: int) -> Timed:
    """Through the asyncio front, as a server drives it: the step loop runs on the
    engine's own thread (as transformers' manager runs its loop on a thread of its own)."""
    return asyncio.run(_run_engine(engine, batch, new_tokens))


async def _run_engine(engine: AsyncEngine, batch: list[list[int]], new_tokens: int) -> Timed:
    sp = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    stamps: dict[str, list[float]] = {f"req_{i}": [] for i in range(len(batch))}
    tokens: dict[str, list[int]] = {f"req_{i}": [] for i in range(len(batch))}

    async def one(rid: str, prompt: list[int]) -> None:
        async for o in engine.generate(rid, prompt, sp):
            now = time.perf_counter()
            for t in o.new_token_ids:
                stamps[rid].append(now)
                tokens[rid].append(t)

    start = time.perf_counter()
    await asyncio.gather(*(one(f"req_{i}", p) for i, p in enumerate(batch)))
    return Timed(start, stamps, tokens)


def run_transformers(lm: LoadedModel, batch: list[list[int]], new_tokens: int, plan: Plan) -> Timed:
    from transformers import GenerationConfig

    gen = GenerationConfig(
        do_sample=False, max_new_tokens=new_tokens, eos_token_id=-1, pad_token_id=0
    )
    kwargs: dict[str, Any] = {}
    try:  # transformers >= 5.20 takes the paged cache's settings on their own
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        kwargs["continuous_batching_config"] = ContinuousBatchingConfig(
            num_blocks=plan.num_blocks, max_batch_tokens=plan.max_batch_tokens, page_size=16
        )
    except ImportError:  # older ones read them from the generation config
        for name, value in (("num_blocks", plan.num_blocks), ("block_size", 16),
                            ("max_batch_tokens", plan.max_batch_tokens)):  # fmt: skip
            setattr(gen, name, value)
    res = lm.model.generate_batch(batch, generation_config=gen, record_timestamps=True, **kwargs)
    start = min(r.created_time for r in res.values())
    stamps = {k: list(r.timestamps or []) for k, r in res.items()}
    tokens = {k: list(r.generated_tokens) for k, r in res.items()}
    return Timed(start, stamps, tokens)


def best_of(
    rounds: int,
    engine: AsyncEngine,
    lm: LoadedModel,
    make: Callable[[int], list[list[int]]],
    new_tokens: int,
    plan: Plan,
) -> tuple[list[Timed], list[Timed]]:
    """Alternate the engines ``rounds`` times; each round has fresh prompts (no prefix
    cache hit from an earlier round), the same for both engines."""
    ours, theirs = [], []
    for r in range(rounds):
        batch = make(r)
        t0 = time.perf_counter()
        ours.append(run_engine(engine, batch, new_tokens))
        t1 = time.perf_counter()
        theirs.append(run_transformers(lm, batch, new_tokens, plan))
        t2 = time.perf_counter()
        log(f"batch {len(batch)} x {new_tokens} tokens: engine {t1 - t0:.1f} s, "
            f"transformers {t2 - t1:.1f} s")  # fmt: skip
    return ours, theirs


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def agree(a: Timed, b: Timed, first: int = 8) -> float:
    keys = sorted(a.tokens)
    same = sum(a.tokens[k][:first] == b.tokens.get(k, [])[:first] for k in keys)
    return same / len(keys)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--dtype", default=None, help="default: float32 on the CPU, bfloat16 on CUDA")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default=BUILTIN_MODEL)
    ap.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto")
    ap.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false")
    ap.add_argument("--profile", action="store_true", help="profile the engine's b16 decode")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but torch sees no CUDA device")
    torch.set_num_threads(args.threads)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    plan = CUDA_PLAN if args.device == "cuda" else CPU_PLAN
    new_tokens = args.new_tokens or plan.new_tokens
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    lm = load_model(args.model, dtype=dtype, device=args.device)
    vocab = lm.config.vocab_size
    cfg = EngineConfig(
        num_blocks=plan.num_blocks,
        max_num_seqs=max(32, *plan.batches),
        max_batch_tokens=plan.max_batch_tokens,
        prefill_chunk_tokens=512,
        attention_backend=args.attention_backend,
        cuda_graphs=args.cuda_graphs,
    )
    inner = Engine(lm, cfg)
    print(f"engine: {inner.describe()}")
    engine = AsyncEngine(inner).start()
    for b in plan.batches:  # warm up both: compiled kernels, captured graphs, allocators
        run_engine(engine, prompts(b, 16, vocab, 0), 4)
    run_transformers(lm, prompts(2, 16, vocab, 0), 4, plan)

    rows: list[tuple[str, float, float, float]] = []
    b16: tuple[float, float] = (0.0, 0.0)
    for b in plan.batches:
        make = fresh(b, plan.prompt_len, vocab, base=100 * b)
        ours, theirs = best_of(args.rounds, engine, lm, make, new_tokens, plan)
        a, t = max(r.decode_rate() for r in ours), max(r.decode_rate() for r in theirs)
        rows.append((f"decode b{b}", a, t, agree(ours[0], theirs[0])))
        if b == ROOFLINE_BATCH:
            b16 = (a, t)
    if plan.prefill:
        total = PREFILL_BATCH * PREFILL_PROMPT_LEN
        make = fresh(PREFILL_BATCH, PREFILL_PROMPT_LEN, vocab, base=9000)
        ours, theirs = best_of(args.rounds, engine, lm, make, 1, plan)
        a = max(r.prefill_rate(total) for r in ours)
        t = max(r.prefill_rate(total) for r in theirs)
        rows.append(
            (f"prefill {PREFILL_BATCH}x{PREFILL_PROMPT_LEN}", a, t, agree(ours[0], theirs[0], 1))
        )

    where = f"{args.threads} threads" if args.device == "cpu" else torch.cuda.get_device_name()
    print(f"model {lm.name}, {dtype}, {where}, prompts of {plan.prompt_len}, "
          f"{new_tokens} new tokens")  # fmt: skip
    print(f"{'':18}{'engine tok/s':>14}{'transformers':>14}{'ratio':>8}{'greedy agree':>14}")
    for name, a, b_, ag in rows:
        print(f"{name:18}{a:14.1f}{b_:14.1f}{a / b_:8.2f}{ag:14.0%}")

    hw = measure_hardware(torch.device(args.device), lm.dtype)
    cost = model_cost(lm.model)
    context = plan.prompt_len + new_tokens / 2  # the mean context over the decode steps
    bound = roofline_step_s(cost, hw, ROOFLINE_BATCH, context)
    step = ROOFLINE_BATCH / b16[0]
    print(f"roofline at b{ROOFLINE_BATCH}, context {context:g}: copy "
          f"{hw.copy_bytes_per_s / 1e9:.1f} GB/s, matmul {hw.matmul_flops_per_s / 1e12:.3f} "
          f"TFLOP/s; {cost.step_bytes(ROOFLINE_BATCH, context) / 1e6:.0f} MB and "
          f"{cost.step_flops(ROOFLINE_BATCH, context) / 1e9:.1f} GFLOP per step; "
          f"allowed {bound * 1e3:.2f} ms, measured {step * 1e3:.2f} ms")  # fmt: skip
    if args.profile:
        batch = prompts(16, plan.prompt_len, vocab, seed=7)
        print(asyncio.run(engine.call(profile_decode, engine.engine, batch, 8)))
    asyncio.run(engine.close())
    print(f"RESULT engine_vs_transformers_decode_b16={b16[0] / b16[1]:.2f} "
          f"decode_b16_vs_roofline={bound / step:.3f}")  # fmt: skip


def profile_decode(engine: Engine, batch: list[list[int]], steps: int) -> str:
    """On the engine's thread: prefill ``batch``, then profile ``steps`` decode steps."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    sp = SamplingParams(max_tokens=steps + 2, ignore_eos=True)
    for i, p in enumerate(batch):
        engine.add_request(f"prof_{i}", p, sp)
    while engine.num_waiting or any(s.remaining > 1 for s in engine.scheduler.running):
        engine.step()
    activities = [ProfilerActivity.CPU]
    if engine.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with torch_profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
    for i in range(len(batch)):
        engine.abort(f"prof_{i}")
    engine.step()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
    return f"profile of {steps} decode steps at batch {len(batch)}:\n{table}"


if __name__ == "__main__":
    main()

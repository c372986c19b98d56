"""Engine throughput on the CPU against transformers' own continuous batching.

Runs the built-in model (SmolLM2-135M, float32) through this engine and through
``model.generate_batch`` (transformers' ``ContinuousBatchingManager`` with its paged
cache) on the same prompts, in the same process, one after the other, and prints:

- decode tokens/s at batch 1, 8 and 16: tokens produced after every request of the
  batch has its first token, divided by the time from then to the last token (the same
  per-token timestamps are used for both engines);
- prefill tokens/s: prompt tokens divided by the time until every request of a batch of
  long prompts has its first token.

Greedy outputs of both are compared (they must agree on the first tokens; float32).
Ends with ``RESULT engine_vs_transformers_decode_b16=<ratio>``.

Each measurement runs ``--rounds`` times, alternating the two engines, and the best
rate of each is kept, so a burst of load from other processes on a shared machine
does not decide the ratio.

    .venv/bin/python bench/engine.py [--threads 2] [--new-tokens 16] [--rounds 2] [--profile]
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

import torch
from splitserve.sampling import SamplingParams
from splitserve_worker.engine.async_engine import AsyncEngine
from splitserve_worker.engine.config import EngineConfig
from splitserve_worker.engine.engine import Engine
from splitserve_worker.models import BUILTIN_MODEL, LoadedModel, load_model

DECODE_PROMPT_LEN = 64
PREFILL_PROMPT_LEN = 256
PREFILL_BATCH = 4
BATCHES = (1, 8, 16)


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


def run_transformers(lm: LoadedModel, batch: list[list[int]], new_tokens: int) -> Timed:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(
        do_sample=False, max_new_tokens=new_tokens, eos_token_id=-1, pad_token_id=0
    )
    cb = ContinuousBatchingConfig(num_blocks=256, max_batch_tokens=2048, page_size=16)
    res = lm.model.generate_batch(
        batch, generation_config=gen, continuous_batching_config=cb, record_timestamps=True
    )
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
) -> tuple[list[Timed], list[Timed]]:
    """Alternate the engines ``rounds`` times; each round has fresh prompts (no prefix
    cache hit from an earlier round), the same for both engines."""
    ours, theirs = [], []
    for r in range(rounds):
        batch = make(r)
        t0 = time.perf_counter()
        ours.append(run_engine(engine, batch, new_tokens))
        t1 = time.perf_counter()
        theirs.append(run_transformers(lm, batch, new_tokens))
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
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default=BUILTIN_MODEL)
    ap.add_argument("--profile", action="store_true", help="profile the engine's b16 decode")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    lm = load_model(args.model, dtype="float32", device="cpu")
    vocab = lm.config.vocab_size
    cfg = EngineConfig(
        num_blocks=512, max_num_seqs=32, max_batch_tokens=2048, prefill_chunk_tokens=512
    )
    engine = AsyncEngine(Engine(lm, cfg)).start()
    run_engine(engine, prompts(2, 16, vocab, 0), 4)  # warm up both
    run_transformers(lm, prompts(2, 16, vocab, 0), 4)

    rows: list[tuple[str, float, float, float]] = []
    b16: tuple[float, float] = (0.0, 0.0)
    for b in BATCHES:
        ours, theirs = best_of(
            args.rounds,
            engine,
            lm,
            fresh(b, DECODE_PROMPT_LEN, vocab, base=100 * b),
            args.new_tokens,
        )
        a, t = max(r.decode_rate() for r in ours), max(r.decode_rate() for r in theirs)
        rows.append((f"decode b{b}", a, t, agree(ours[0], theirs[0])))
        if b == 16:
            b16 = (a, t)
    total = PREFILL_BATCH * PREFILL_PROMPT_LEN
    ours, theirs = best_of(
        args.rounds,
        engine,
        lm,
        fresh(PREFILL_BATCH, PREFILL_PROMPT_LEN, vocab, base=9000),
        1,
    )
    a, t = max(r.prefill_rate(total) for r in ours), max(r.prefill_rate(total) for r in theirs)
    rows.append(
        (f"prefill {PREFILL_BATCH}x{PREFILL_PROMPT_LEN}", a, t, agree(ours[0], theirs[0], 1))
    )

    print(f"model {lm.name}, float32, {args.threads} threads, {args.new_tokens} new tokens")
    print(f"{'':18}{'engine tok/s':>14}{'transformers':>14}{'ratio':>8}{'greedy agree':>14}")
    for name, a, b_, ag in rows:
        print(f"{name:18}{a:14.1f}{b_:14.1f}{a / b_:8.2f}{ag:14.0%}")
    if args.profile:
        batch = prompts(16, DECODE_PROMPT_LEN, vocab, seed=7)
        print(asyncio.run(engine.call(profile_decode, engine.engine, batch, 8)))
    asyncio.run(engine.close())
    print(f"RESULT engine_vs_transformers_decode_b16={b16[0] / b16[1]:.2f}")


def profile_decode(engine: Engine, batch: list[list[int]], steps: int) -> str:
    """On the engine's thread: prefill ``batch``, then profile ``steps`` decode steps."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    sp = SamplingParams(max_tokens=steps + 2, ignore_eos=True)
    for i, p in enumerate(batch):
        engine.add_request(f"prof_{i}", p, sp)
    while engine.num_waiting or any(s.remaining > 1 for s in engine.scheduler.running):
        engine.step()
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    for i in range(len(batch)):
        engine.abort(f"prof_{i}")
    engine.step()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
    return f"profile of {steps} decode steps at batch {len(batch)}:\n{table}"


if __name__ == "__main__":
    main()

"""Routing speed: decisions per second and p99 decision latency.

64 workers (32 prefill, 32 decode), 100,000 cached blocks spread over them as
shared prompt prefixes, prompts of 256 to 2,048 tokens of which a random
share starts with a cached prefix. One decision = prefix lookup, prefill and
decode scoring, and the disaggregation decision. The prompt's block hashes
are computed once per request when it is tokenized; their cost is printed
separately (``hash_us_per_1k_tokens``).

    .venv/bin/python bench/router.py

Ends with ``RESULT route_p99_us=<x> routes_per_s=<y>`` (targets <= 100, >= 10,000):
the p99 of the median of five rounds, and decisions per second of wall-clock time.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from splitserve.prefix_hash import block_hashes
from splitserve.roles import Role
from splitserve_worker.router.config import RouterConfig
from splitserve_worker.router.planner import RoutePlanner
from splitserve_worker.router.scoring import WorkerView

BLOCK = 16


def build(
    num_workers: int, num_blocks: int, seed: int
) -> tuple[RoutePlanner, tuple[WorkerView, ...], list[list[int]]]:
    rng = random.Random(seed)
    cfg = RouterConfig(block_size=BLOCK)
    planner = RoutePlanner(cfg)
    workers = tuple(
        WorkerView(
            name=f"w{i}",
            role=Role.PREFILL if i % 2 == 0 else Role.DECODE,
            free_blocks=rng.randint(100, 10_000),
            total_blocks=10_000,
            running=rng.randint(0, 60),
            waiting=rng.randint(0, 4),
            tokens_in_flight=rng.randint(0, 20_000),
            assigned=rng.randint(0, 8),
        )
        for i in range(num_workers)
    )
    # shared prefixes ("system prompts" and documents), 64 blocks each, each on a few workers
    prefixes: list[list[int]] = []
    stored = 0
    while stored < num_blocks:
        toks = [rng.randrange(49_152) for _ in range(64 * BLOCK)]
        prefixes.append(toks)
        hashes = block_hashes(toks, BLOCK)
        for w in rng.sample(workers, 3):
            planner.index.stored(w.name, hashes)
        stored += len(hashes)
    return planner, workers, prefixes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=100_000)
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    planner, workers, prefixes = build(args.workers, args.blocks, args.seed)
    rng = random.Random(args.seed + 1)
    prompts: list[tuple[int, list[int]]] = []
    hash_s = 0.0
    hashed_tokens = 0
    for _ in range(min(args.requests, 2000)):
        n = rng.randint(256, 2048)
        if rng.random() < 0.7:
            base = rng.choice(prefixes)[: rng.randint(1, 64) * BLOCK]
            toks = base + [rng.randrange(49_152) for _ in range(max(0, n - len(base)))]
        else:
            toks = [rng.randrange(49_152) for _ in range(n)]
        t0 = time.perf_counter()
        hashes = block_hashes(toks, BLOCK)
        hash_s += time.perf_counter() - t0
        hashed_tokens += len(toks)
        prompts.append((len(toks), hashes))

    print(f"index: {len(planner.index)} distinct cached blocks on {len(workers)} workers")
    for n, h in prompts[:200]:  # warm up
        planner.plan(n, h, workers)
    # several rounds: on a shared machine one round can be hit by another process's burst;
    # the median round is reported, every round is printed
    rounds = 5
    per_round = max(1, args.requests // rounds)
    p99s: list[float] = []
    all_lat: list[float] = []
    remote = 0
    wall = cpu = 0.0
    load = os.getloadavg()[0]
    for r in range(rounds):
        lat: list[float] = []
        w0, c0 = time.perf_counter(), time.process_time()
        for i in range(per_round):
            n, h = prompts[(r * per_round + i) % len(prompts)]
            t0 = time.perf_counter_ns()
            plan = planner.plan(n, h, workers)
            lat.append((time.perf_counter_ns() - t0) / 1000)
            remote += plan.remote
        wall += time.perf_counter() - w0
        cpu += time.process_time() - c0
        lat.sort()
        p99s.append(lat[int(len(lat) * 0.99)])
        all_lat += lat
        print(f"round {r + 1}: p50 {lat[len(lat) // 2]:.1f} us  p99 {p99s[-1]:.1f} us")
    all_lat.sort()
    total = rounds * per_round
    p99 = statistics.median(p99s)
    print(f"decisions: {total}, remote prefill in {remote}")
    print(
        f"latency us: p50 {all_lat[total // 2]:.1f}  p99 (all rounds) "
        f"{all_lat[int(total * 0.99)]:.1f}  mean {statistics.fmean(all_lat):.1f}"
    )
    print(
        f"rate: {total / wall:.0f}/s by wall clock, {total / cpu:.0f}/s by this process's CPU "
        f"time (machine load average {load:.1f} on {os.cpu_count()} CPUs)"
    )
    print(f"hash_us_per_1k_tokens: {hash_s / hashed_tokens * 1e9:.1f} (once per request)")
    print(f"RESULT route_p99_us={p99:.1f} routes_per_s={total / wall:.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

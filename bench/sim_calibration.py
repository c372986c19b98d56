"""The simulator, calibrated on this machine, against the real local stack.

1. Time the real engine in this process (same model and dtype, one torch
   thread, as the workers of ``splitserve up`` run): prefill of single prompts
   at several lengths, decode steps at several batch sizes; fit a
   :class:`~splitserve_operator.sim.MeasuredCost` (before the replay and again
   after it; the fit uses both).
2. Start the real stack (``splitserve up --model M --prefill 1 --decode 1``)
   and send probes one at a time, before and after the replay: on an idle
   stack (the router prefills them on the decode worker) and beside a
   background decode (the router sends them to the prefill worker); and six at
   once, timed once all six decode (what streaming adds per sequence). What their
   TTFT and TPOT exceed the engine's own times by is the stack's overhead
   (router, HTTP, gRPC streaming), and what a remote handoff adds. Replay a
   Poisson workload against ``/v1/completions`` with streaming, timing TTFT
   and TPOT per request.
3. Simulate the same workload (same arrival times and lengths) with the
   engine's costs plus those overheads (the handoff as the link's latency)
   and the router's local-or-remote prefill rule (``SimConfig.local_prefill``);
   compare the p90s.

Nothing in step 3 is fitted to the workload's own timings: the costs come
from step 1 and the overheads from the probes.

Noise: these shared two-core machines carry other sessions' load (load
averages of 7-12 were seen), which moves the engine's speed by 2-3x within
minutes; timing the engine before and after the replay averages some of it
out. A CPU gauge (a fixed numpy job timed every 0.5 s in its own process) is
printed to show how far the machine's speed moved during the replay. Tried
and dropped: rescaling costs by the gauge, timing the engine beside a process
keeping one core busy, and scaling costs by the probes instead of adding
overheads; each made some runs much worse.

    .venv/bin/python bench/sim_calibration.py [--model tiny|smollm2-135m|PATH] [--requests 100]

The default model is a small random Llama made here (8 layers, hidden 256):
big enough that compute shows, small enough for two busy cores. The built-in
SmolLM2-135M works too, but on two shared cores one prefill takes seconds.

Ends with ``RESULT tpot_p90_error=<e> ttft_p90_error=<e>`` (relative errors;
target <= 0.25 each).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from splitserve_operator.sim import (
    LinkSpec,
    MeasuredCost,
    PoolConfig,
    Role,
    SimConfig,
    Simulator,
    Workload,
    load_model_spec,
)
from splitserve_operator.sim.config import LocalPrefill

ROOT = Path(__file__).resolve().parents[1]
THREADS = 1
"""Torch threads per worker: what ``splitserve up`` gives each worker."""
GRPC_LOOPBACK_BYTES_PER_S = 1.7e9
"""gRPC streaming on loopback, 1 MiB messages, measured on these machines (TESTING.md)."""


# ---------------------------------------------------------------- CPU weather


GAUGE_CODE = """
import sys, time
import numpy as np
a = np.random.default_rng(0).standard_normal((160, 160))
interval = float(sys.argv[1])
while True:
    t0 = time.monotonic()
    x = a
    for _ in range(8):
        x = np.tanh(x @ a)
    t1 = time.monotonic()
    print(f"{t0:.4f} {t1 - t0:.6f}", flush=True)
    time.sleep(interval)
"""


class CpuGauge:
    """How fast one thread computes right now: a separate process times a fixed
    small numpy job every ``interval_s`` (a diagnostic: how much the machine's
    other load moved between timing the engine and replaying)."""

    def __init__(self, interval_s: float = 0.5) -> None:
        self.interval_s = interval_s
        self.samples: list[tuple[float, float]] = []
        self._proc: subprocess.Popen[str] | None = None
        self._thread: threading.Thread | None = None

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            t, d = line.split()
            self.samples.append((float(t), float(d)))

    def __enter__(self) -> CpuGauge:
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self._proc = subprocess.Popen(
            [sys.executable, "-c", GAUGE_CODE, str(self.interval_s)],
            stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(10)

    def mean(self, since: float = 0.0, until: float = float("inf")) -> float:
        xs = [d for t, d in self.samples if since <= t <= until]
        return float(np.mean(xs)) if xs else float("nan")


# ---------------------------------------------------------------- 1. the engine


TINY: dict[str, Any] = dict(
    hidden_size=256, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
    num_key_value_heads=4,
)  # fmt: skip


def measure_engine(model: str, seed: int) -> tuple[list, list, int]:
    """Time prefill and decode on the real engine; returns the prefill samples
    (tokens, s), the decode samples (batch, context sum, s per step) and the
    engine's KV capacity in tokens."""
    import torch
    from splitserve_worker.engine import Engine, EngineConfig, SamplingParams
    from splitserve_worker.models import load_model

    torch.set_num_threads(THREADS)
    lm = load_model(model, dtype="auto", device="cpu")
    engine = Engine(lm, EngineConfig(num_threads=THREADS, enable_prefix_cache=False))
    capacity = engine.kv.blocks.free_blocks * engine.block_size  # all free before any request
    vocab = lm.config.vocab_size
    rng = random.Random(seed)
    ids = iter(range(10**9))

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    def run(prompts: list[list[int]], new_tokens: int) -> list[tuple[bool, float]]:
        """Step until done; returns (pure decode?, seconds) of each step that produced
        tokens. A step is pure decode when every request already had its first token
        (a batch of prompts larger than ``max_batch_tokens`` prefills over several steps)."""
        sp = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
        names = [f"r{next(ids)}" for _ in prompts]
        for name, p in zip(names, prompts, strict=True):
            engine.add_request(name, p, sp)
        seen: set[str] = set()
        times = []
        while engine.has_work():
            decoding = len(seen) == len(names)
            t0 = time.perf_counter()
            out = engine.step()
            if out:
                times.append((decoding, time.perf_counter() - t0))
                seen.update(o.request_id for o in out)
        return times

    run([prompt(32)], 4)  # warm up
    pre: list[tuple[int, float]] = []
    for n in (16, 64, 128, 256, 384):
        for _ in range(3):
            pre.append((n, run([prompt(n)], 1)[0][1]))
    dec: list[tuple[int, float, float]] = []
    steps = 8
    for b in (1, 4, 8, 16):
        for ctx in (64, 256):
            times = run([prompt(ctx) for _ in range(b)], steps + 1)
            j = 0
            for decoding, t in times:
                if decoding:  # every sequence decodes one token; context grows by one
                    j += 1
                    dec.append((b, float(b * (ctx + j)), t))
    return pre, dec, capacity


# ---------------------------------------------------------------- 2. the stack


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def stack(model: str, port: int, timeout_s: float = 600.0) -> Iterator[str]:
    """``splitserve up --model M --prefill 1 --decode 1 --port P`` as a subprocess."""
    cmd = [
        sys.executable, "-m", "splitserve_worker.cli", "up", "--model", model,
        "--prefill", "1", "--decode", "1", "--port", str(port), "--threads", str(THREADS),
    ]  # fmt: skip
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
        start_new_session=True,
    )  # fmt: skip
    ready = threading.Event()
    tail: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line.rstrip())
            del tail[:-30]
            if "router: OpenAI API on" in line:
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        if not ready.wait(timeout_s) or proc.poll() is not None:
            raise RuntimeError("splitserve up did not become ready:\n" + "\n".join(tail))
        yield f"http://127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


@dataclass
class Timing:
    ttft: float
    tpot: float
    tokens: int
    stamps: list[float] = field(default_factory=list)
    """When each streamed chunk with tokens arrived (``time.perf_counter``)."""


async def complete(client, base: str, prompt: list[int], max_tokens: int) -> Timing:  # type: ignore[no-untyped-def]
    body = {
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "stream": True, "return_token_ids": True,
    }  # fmt: skip
    t0 = time.perf_counter()
    first, last, n = None, t0, 0
    stamps: list[float] = []
    async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"completion failed: {r.status_code} {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"completion failed: {chunk['error']}")
            for c in chunk.get("choices", []):
                k = len(c.get("token_ids") or [])
                if k:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    n += k
                    stamps.append(now)
    if first is None:
        raise RuntimeError("no tokens streamed")
    return Timing(first - t0, (last - first) / (n - 1) if n > 1 else 0.0, n, stamps)


PROBE_PROMPT, PROBE_OUTPUT = 160, 17
PROBE_BATCH, PROBE_BATCH_OUTPUT = 6, 48


async def probe(base: str, vocab: int, seed: int) -> tuple[list[Timing], list[Timing], float]:
    """Requests sent one at a time: on an idle stack (the router prefills them on
    the decode worker), and beside one long background decode (it hands them to
    the prefill worker: a local prefill would stall that sequence)."""
    import httpx

    rng = random.Random(seed)

    def prompt() -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(PROBE_PROMPT)]

    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
        await complete(client, base, prompt(), 4)  # warm up both paths' connections
        idle = [await complete(client, base, prompt(), PROBE_OUTPUT) for _ in range(5)]
        remote: list[Timing] = []
        for _ in range(3):
            bg = asyncio.create_task(complete(client, base, prompt(), 200))
            await asyncio.sleep(1.0)
            remote.append(await complete(client, base, prompt(), 4))
            await bg
        batch = await asyncio.gather(
            *(complete(client, base, prompt(), PROBE_BATCH_OUTPUT) for _ in range(PROBE_BATCH))
        )
    return idle, remote, batch_tpot(list(batch))


def batch_tpot(batch: list[Timing]) -> float:
    """Median time per token once every request of the batch is decoding: the tokens
    before the batch's last first token also wait for the others' prefills."""
    start = max(t.stamps[0] for t in batch)
    per: list[float] = []
    for t in batch:
        after = [x for x in t.stamps if x >= start]
        if len(after) > 1:
            per.append((after[-1] - after[0]) / (len(after) - 1))
    return float(np.median(per)) if per else float("nan")


@dataclass(frozen=True)
class Overheads:
    """What the stack adds to the engine's own compute, from the probes (medians,
    never below zero)."""

    first_token_s: float
    """Router, HTTP and gRPC on top of a prefill: added to every first token."""
    decode_step_s: float
    """Streaming each token through the worker, the router and HTTP: added to
    every decode step."""
    handoff_s: float
    """What a remote prefill adds to a local one (Reserve, Prefill, the push,
    Commit): the link's latency."""
    decode_per_seq_s: float = 0.0
    """What each further sequence in the batch adds (the batch probe)."""


def overheads(
    idle: list[Timing], remote: list[Timing], batch: list[float], cost: MeasuredCost
) -> Overheads:
    p = PROBE_PROMPT
    prefill = cost.step_time(p, p * (p + 1) / 2, 1, 0, 0)
    step = cost.step_time(0, 0, 0, 1, p + PROBE_OUTPUT / 2)
    first = max(0.0, float(np.median([t.ttft for t in idle])) - prefill)
    per_step = max(0.0, float(np.median([t.tpot for t in idle])) - step)
    handoff = max(0.0, float(np.median([t.ttft for t in remote])) - prefill - first)
    b = PROBE_BATCH
    # the steady part of the batch: contexts from about half to all of the output
    step_b = cost.step_time(0, 0, 0, b, b * (p + 0.75 * PROBE_BATCH_OUTPUT))
    per_step_b = max(0.0, float(np.median(batch)) - step_b)
    per_seq = max(0.0, (per_step_b - per_step) / (b - 1))
    return Overheads(first, per_step, handoff, per_seq)


async def replay(base: str, w: Workload, prompts: list[list[int]]) -> list[Timing]:
    import httpx

    limits = httpx.Limits(max_connections=len(w) + 4, max_keepalive_connections=len(w) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        t0 = time.perf_counter()

        async def one(i: int) -> Timing:
            delay = float(w.arrival[i]) - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            return await complete(client, base, prompts[i], int(w.output[i]))

        return list(await asyncio.gather(*(one(i) for i in range(len(w)))))


# ---------------------------------------------------------------- 3. the simulator


def simulate(
    model: str,
    w: Workload,
    cost: MeasuredCost,
    capacity: int,
    over: Overheads,
) -> tuple[np.ndarray, np.ndarray, float]:
    stack_cost = MeasuredCost(
        prefill_base_s=cost.prefill_base_s,
        prefill_per_token_s=cost.prefill_per_token_s,
        prefill_per_pair_s=cost.prefill_per_pair_s,
        decode_base_s=cost.decode_base_s + max(0.0, over.decode_step_s - over.decode_per_seq_s),
        decode_per_seq_s=cost.decode_per_seq_s + over.decode_per_seq_s,
        decode_per_ctx_s=cost.decode_per_ctx_s,
    )
    pool = PoolConfig(cost=stack_cost, kv_capacity_tokens=capacity, max_seqs=64, gpu="cpu")
    speed = 1.0 / (cost.prefill_per_token_s + cost.prefill_base_s / 200)  # ~200-token prompts
    cfg = SimConfig(
        model=load_model_spec(model),
        pools={Role.PREFILL: pool, Role.DECODE: pool},
        replicas={Role.PREFILL: 1, Role.DECODE: 1},
        link=LinkSpec(
            "grpc-loopback", "gRPC on 127.0.0.1", GRPC_LOOPBACK_BYTES_PER_S, over.handoff_s
        ),
        layerwise=True,
        chunk_size=512,  # the engine's prefill chunk while sequences decode
        max_prefill_tokens=2048,  # the engine's max_batch_tokens
        prefix_caching=False,
        router_overhead_s=over.first_token_s,
        # the router's rule with the speed it learns from the prefill workers' answers
        local_prefill=LocalPrefill(prefill_tokens_per_s=speed, decode_prefill_tokens_per_s=speed),
    )
    sim = Simulator(cfg, w)
    res = sim.run()
    return res.ttft, res.tpot, sim.local_prefills / max(1, len(w))


# ---------------------------------------------------------------- main


def p90(a: np.ndarray | list[float]) -> float:
    return float(np.percentile(np.asarray(a), 90))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", help="tiny, smollm2-135m or a checkpoint folder")
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--load", type=float, default=0.15,
                    help="offered load as a fraction of one worker's prefill capacity")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dump", default=None, help="write per-request real and simulated timings")
    args = ap.parse_args()

    # a SIGTERM still stops the stack (the finally blocks run)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="sim-calibration-") as tmp:
        run(args, tmp)


def run(args: argparse.Namespace, tmp: str) -> None:
    from splitserve_worker.models import resolve_model, save_tiny_llama

    if args.model == "tiny":
        path = str(save_tiny_llama(Path(tmp) / "tiny", seed=args.seed, **TINY))
    else:
        path = str(resolve_model(args.model))
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    gauge = CpuGauge()
    with gauge:
        m0 = time.monotonic()
        pre, dec, capacity = measure_engine(path, args.seed)
        m1 = time.monotonic()
        gc.collect()  # the measuring engine is gone before the stack starts
        first = MeasuredCost.fit(pre, dec)
        print(f"engine ({args.model}, {THREADS} thread), measured in {m1 - m0:.0f} s: {first}")
        print(f"  KV capacity {capacity:,} tokens")

        # the workload: Poisson, prompts long enough to go remote when decode is busy
        rng = np.random.default_rng(args.seed)
        n = args.requests
        prompt = rng.integers(96, 321, size=n)
        output = rng.integers(16, 49, size=n)
        mean_prefill = first.step_time(int(prompt.mean()), prompt.mean() ** 2 / 2, 1, 0, 0)
        rate = args.load / mean_prefill
        gaps = rng.exponential(1.0 / rate, size=n)
        gaps[0] = 0.0
        w = Workload(np.cumsum(gaps), prompt, output, name="calibration")
        vocab = load_model_spec(path).vocab
        prng = random.Random(args.seed + 1)
        prompts = [[prng.randrange(100, vocab) for _ in range(int(p))] for p in prompt]
        print(f"workload: {n} requests at {rate:.2f} req/s, prompts 96-320, outputs 16-48 tokens")

        with stack(path, free_port()) as base:
            p0 = time.monotonic()
            idle, remote, batch = asyncio.run(probe(base, vocab, args.seed + 2))
            r0 = time.monotonic()
            real = asyncio.run(replay(base, w, prompts))
            r1 = time.monotonic()
            print(f"replayed in {r1 - r0:.0f} s")
            idle2, remote2, batch2 = asyncio.run(probe(base, vocab, args.seed + 4))
            p1 = time.monotonic()
            print(f"probed in {r0 - p0 + p1 - r1:.0f} s")
        # the engine again, after: fit on both, so drift in the machine's load averages out
        m2 = time.monotonic()
        pre2, dec2, _ = measure_engine(path, args.seed + 3)
        m3 = time.monotonic()
    print(f"load average {os.getloadavg()[0]:.1f}")
    measured = MeasuredCost.fit(pre + pre2, dec + dec2)
    print(f"engine, before and after together: {measured}")
    g_measure = float(np.mean([d for t, d in gauge.samples if m0 <= t <= m1 or m2 <= t <= m3]))
    print(
        f"CPU gauge (how slow one thread was, vs while timing the engine): "
        f"x{gauge.mean(p0, r0) / g_measure:.2f} while probing, "
        f"x{gauge.mean(r0, r1) / g_measure:.2f} while replaying"
    )
    over = overheads(idle + idle2, remote + remote2, [batch, batch2], measured)
    print(
        f"stack overheads (probes before and after): first token "
        f"+{over.first_token_s * 1000:.1f} ms, decode step +{over.decode_step_s * 1000:.1f} ms "
        f"(+{over.decode_per_seq_s * 1000:.2f} ms per further sequence), "
        f"remote handoff +{over.handoff_s * 1000:.1f} ms"
    )
    r_ttft = np.array([t.ttft for t in real])
    r_tpot = np.array([t.tpot for t in real])
    s_ttft, s_tpot, local = simulate(path, w, measured, capacity, over)
    if args.dump:
        rows = [
            {"arrival": float(w.arrival[i]), "prompt": int(w.prompt[i]), "output": int(w.output[i]),
             "real_ttft": float(r_ttft[i]), "real_tpot": float(r_tpot[i]),
             "sim_ttft": float(s_ttft[i]), "sim_tpot": float(s_tpot[i])}
            for i in range(len(w))
        ]  # fmt: skip
        Path(args.dump).write_text(json.dumps({"cost": str(measured), "overheads": str(over),
                                               "requests": rows}, indent=1))  # fmt: skip
    print(f"simulated: {local:.0%} of prompts prefilled on the decode worker")
    print(f"{'':10}{'real p50':>10}{'sim p50':>10}{'real p90':>10}{'sim p90':>10}")
    for name, r, s in (("TTFT ms", r_ttft, s_ttft), ("TPOT ms", r_tpot, s_tpot)):
        print(
            f"{name:10}{np.median(r) * 1e3:10.1f}{np.median(s) * 1e3:10.1f}"
            f"{p90(r) * 1e3:10.1f}{p90(s) * 1e3:10.1f}"
        )
    tpot_err = abs(p90(s_tpot) - p90(r_tpot)) / p90(r_tpot)
    ttft_err = abs(p90(s_ttft) - p90(r_ttft)) / p90(r_ttft)
    print(f"RESULT tpot_p90_error={tpot_err:.3f} ttft_p90_error={ttft_err:.3f}")


if __name__ == "__main__":
    main()

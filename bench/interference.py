"""Prefill/decode interference: colocated vs disaggregated on the same two cores.

Both setups get the same two CPU cores and the same Poisson arrival trace mixing
short and long prompts, one after the other in this run:

- colocated: two ``both`` workers (chunked prefill in the decode batch), one thread each;
- disaggregated: one ``prefill`` and one ``decode`` worker, one thread each.

Each worker is pinned to one torch thread (``--threads 1``). For each setup it prints
p50/p90/p99 of TTFT and TPOT, and goodput: requests per second that met the SLO
(TTFT <= --slo-ttft and TPOT <= --slo-tpot; by default twice what the colocated
stack does for one request alone, measured at the start of the run). It writes a
CDF plot (PNG) and ends with

    RESULT tpot_p99_disagg_vs_colocated=<r> goodput_disagg_vs_colocated=<r>

(targets: <= 0.5 and >= 1.5).

    .venv/bin/python bench/interference.py            # built-in model, ~3 minutes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
from splitserve_worker.commands.router import load_tokenizer
from splitserve_worker.commands.up import WorkerProcs
from splitserve_worker.router.config import RouterConfig
from splitserve_worker.router.discovery import StaticDiscovery
from splitserve_worker.router.local import RouterThread
from splitserve_worker.router.scoring import Role
from splitserve_worker.router.service import RouterService


@dataclass(frozen=True)
class Arrival:
    at: float
    prompt: list[int]
    max_tokens: int
    long: bool


@dataclass
class Outcome:
    arrival: Arrival
    ttft: float | None = None
    tpot: float | None = None
    tokens: int = 0
    error: str | None = None


def make_trace(args: argparse.Namespace, vocab: int) -> list[Arrival]:
    rng = random.Random(args.seed)
    t = 0.0
    out = []
    while t < args.duration:
        t += rng.expovariate(args.rate)
        long = rng.random() < args.long_fraction
        n = args.long_tokens if long else args.short_tokens
        # distinct prompts: no prefix cache hits between requests
        prompt = [rng.randrange(100, vocab - 100) for _ in range(n)]
        out.append(Arrival(t, prompt, args.long_output if long else args.short_output, long))
    return out


async def one(client: httpx.AsyncClient, base: str, a: Arrival, t0: float) -> Outcome:
    await asyncio.sleep(max(0.0, t0 + a.at - time.monotonic()))
    sent = time.monotonic()
    out = Outcome(a)
    body = {
        "prompt": a.prompt,
        "max_tokens": a.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    first = last = None
    try:
        async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}"
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.error = chunk["error"]["message"]
                    return out
                ids = chunk["choices"][0].get("token_ids") or []
                if ids:
                    now = time.monotonic()
                    first = first or now
                    last = now
                    out.tokens += len(ids)
    except httpx.HTTPError as e:
        out.error = repr(e)
        return out
    if first is not None and last is not None:
        out.ttft = first - sent
        out.tpot = (last - first) / (out.tokens - 1) if out.tokens > 1 else 0.0
    return out


async def drive(base: str, trace: list[Arrival]) -> tuple[list[Outcome], float]:
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        t0 = time.monotonic()
        outs = await asyncio.gather(*(one(client, base, a, t0) for a in trace))
        return list(outs), time.monotonic() - t0


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


def run_setup(
    name: str, roles: list[Role], args: argparse.Namespace, tokenizer: Any, trace: list[Arrival]
) -> tuple[list[Outcome], float, tuple[float, float]]:
    token = secrets.token_hex(8)
    print(f"\n== {name}: workers {[r.value for r in roles]}, 1 thread each", flush=True)
    with WorkerProcs(args.model, roles, token, threads=1, echo=False) as procs:
        eps = procs.start(timeout_s=600)
        cfg = RouterConfig(model_name=args.model, worker_token=token)
        with RouterThread(RouterService(cfg, tokenizer, StaticDiscovery(eps))) as base:
            # alone on an idle stack: one short and one long request (also warms up)
            short = next(a for a in trace if not a.long)
            long = next((a for a in trace if a.long), short)
            alone_s = asyncio.run(drive(base, [replace(short, at=0.0)]))[0][0]
            alone_l = asyncio.run(drive(base, [replace(long, at=0.0)]))[0][0]
            print(
                f"  alone: short TPOT {(alone_s.tpot or 0) * 1e3:.1f} ms, "
                f"long TTFT {alone_l.ttft or 0:.3f} s"
            )
            load0 = os.getloadavg()[0]
            outs, wall = asyncio.run(drive(base, trace))
            print(
                f"  machine load average (1 min) {load0:.1f} before, "
                f"{os.getloadavg()[0]:.1f} after, on {os.cpu_count()} CPUs"
            )
            text = httpx.get(f"{base}/metrics").text
    decisions = [ln for ln in text.splitlines() if ln.startswith("splitserve_disagg")]
    print("  " + "; ".join(decisions))
    return outs, wall, (alone_l.ttft or 0.0, alone_s.tpot or 0.0)


def summarize(
    name: str, outs: list[Outcome], wall: float, args: argparse.Namespace
) -> dict[str, float]:
    ok = [o for o in outs if o.error is None and o.ttft is not None]
    errs = [o for o in outs if o.error is not None]
    ttft = [o.ttft for o in ok if o.ttft is not None]
    tpot = [o.tpot for o in ok if o.tpot is not None and o.tokens > 1]
    good = [o for o in ok if (o.ttft or 0) <= args.slo_ttft and (o.tpot or 0) <= args.slo_tpot]
    res = {
        "ttft_p50": pct(ttft, 50),
        "ttft_p90": pct(ttft, 90),
        "ttft_p99": pct(ttft, 99),
        "tpot_p50": pct(tpot, 50),
        "tpot_p90": pct(tpot, 90),
        "tpot_p99": pct(tpot, 99),
        "goodput": len(good) / wall,
        "throughput": len(ok) / wall,
        "slo_met": len(good) / max(1, len(outs)),
    }
    short_tpot = [o.tpot for o in ok if not o.arrival.long and o.tpot is not None]
    long_ttft = [o.ttft for o in ok if o.arrival.long and o.ttft is not None]
    print(f"\n{name}: {len(ok)}/{len(outs)} ok, {len(errs)} errors, wall {wall:.1f} s")
    if errs:
        print(f"  first error: {errs[0].error}")
    t50, t90, t99 = res["ttft_p50"], res["ttft_p90"], res["ttft_p99"]
    print(f"  TTFT s   p50 {t50:.3f}  p90 {t90:.3f}  p99 {t99:.3f}")
    print(f"  TPOT ms  p50 {res['tpot_p50'] * 1e3:.1f}  p90 {res['tpot_p90'] * 1e3:.1f}  "
          f"p99 {res['tpot_p99'] * 1e3:.1f}")  # fmt: skip
    if short_tpot and long_ttft:
        print(f"  short-prompt TPOT mean {statistics.fmean(short_tpot) * 1e3:.1f} ms; "
              f"long-prompt TTFT mean {statistics.fmean(long_ttft):.3f} s")  # fmt: skip
    print(f"  goodput {res['goodput']:.3f} req/s ({res['slo_met']:.0%} of requests met the SLO), "
          f"throughput {res['throughput']:.3f} req/s")  # fmt: skip
    return res


def plot(results: dict[str, list[Outcome]], path: Path, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, outs in results.items():
        for ax, key, scale in ((axes[0], "ttft", 1.0), (axes[1], "tpot", 1e3)):
            xs = sorted(getattr(o, key) * scale for o in outs if getattr(o, key) is not None)
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=name)
    axes[0].axvline(args.slo_ttft, color="grey", ls="--", lw=0.8)
    axes[1].axvline(args.slo_tpot * 1e3, color="grey", ls="--", lw=0.8)
    axes[0].set(xlabel="TTFT (s)", ylabel="fraction of requests", title="time to first token")
    axes[1].set(xlabel="TPOT (ms)", title="time per output token")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{args.model}: Poisson {args.rate}/s, {args.long_fraction:.0%} long prompts")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"\nCDF plot: {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per setup")
    ap.add_argument("--rate", type=float, default=0.3, help="Poisson arrivals per second")
    ap.add_argument("--long-fraction", type=float, default=0.3)
    ap.add_argument("--short-tokens", type=int, default=32)
    ap.add_argument("--long-tokens", type=int, default=1024)
    ap.add_argument("--short-output", type=int, default=32)
    ap.add_argument("--long-output", type=int, default=8)
    ap.add_argument(
        "--slo-ttft",
        type=float,
        default=None,
        help="seconds (default: 2x the colocated stack's long-prompt TTFT alone)",
    )
    ap.add_argument(
        "--slo-tpot",
        type=float,
        default=None,
        help="seconds (default: 2x the colocated stack's short-prompt TPOT alone)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", default="bench/out/interference_cdf.png")
    args = ap.parse_args()

    tokenizer = load_tokenizer(args.model)
    trace = make_trace(args, len(tokenizer))
    n_long = sum(a.long for a in trace)
    print(f"trace: {len(trace)} requests over {args.duration:g} s ({n_long} long: "
          f"{args.long_tokens} prompt tokens -> {args.long_output}; short: {args.short_tokens} "
          f"-> {args.short_output})")  # fmt: skip
    setups = {
        "colocated": [Role.BOTH, Role.BOTH],
        "disaggregated": [Role.PREFILL, Role.DECODE],
    }
    outs: dict[str, list[Outcome]] = {}
    res: dict[str, dict[str, float]] = {}
    walls: dict[str, float] = {}
    for name, roles in setups.items():
        o, wall, alone = run_setup(name, roles, args, tokenizer, trace)
        outs[name], walls[name] = o, wall
        if name == "colocated":
            # the SLO, unless given: twice what the colocated stack does with nothing else to do
            args.slo_ttft = args.slo_ttft or round(2 * alone[0], 2)
            args.slo_tpot = args.slo_tpot or round(2 * alone[1], 3)
    print(f"\nSLO: TTFT <= {args.slo_ttft:g} s and TPOT <= {args.slo_tpot * 1e3:g} ms")
    for name, o in outs.items():
        res[name] = summarize(name, o, walls[name], args)
    plot(outs, Path(args.plot), args)
    c, d = res["colocated"], res["disaggregated"]
    tpot_ratio = d["tpot_p99"] / c["tpot_p99"] if c["tpot_p99"] > 0 else float("nan")
    if c["goodput"] > 0:
        good_ratio = d["goodput"] / c["goodput"]
    else:  # nothing met the SLO colocated: a ratio means nothing unless disaggregated did
        good_ratio = float("inf") if d["goodput"] > 0 else float("nan")
    print(f"RESULT tpot_p99_disagg_vs_colocated={tpot_ratio:.3f} "
          f"goodput_disagg_vs_colocated={good_ratio:.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

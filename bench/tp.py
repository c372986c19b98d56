"""Tensor parallelism on this host's CPU, measured side by side in one run.

- decode tokens/s at batch 16: one engine over one rank with two threads, against one
  engine over two ranks (rank 0 here, rank 1 a process of its own) with one thread each,
  with each all-reduce kind (gloo over loopback sockets, and the ranks' shared memory);
  with each, the share of rank 0's decode time spent in all-reduces and the cost of one;
- the handoff of a 2,000-token prompt: a ``splitserve worker --role prefill`` over two
  ranks (one thread each) against one over one rank (two threads), each pushing its KV
  over tcp (or ``--kv-backend grpc``) to the same one-rank decode worker: the Prefill
  call's time, its prefill compute and the transfer still exposed after it (the best of
  ``--rounds``); and the same two pushing to a decode worker over two ranks (one thread
  each), each of whose ranks receives its own KV heads (from each prefill rank
  directly, over two ranks).

The model is a random Llama built in place of SmolLM2-135M's size (30 layers, hidden
576, an MLP of 1,536, vocabulary 49,152), with 8 query heads and 2 KV heads, which split
over two ranks (SmolLM2's 9 heads do not). float32.

Between the decode rounds' figures, each all-reduce kind is also timed alone (200
back-to-back all-reduces of 576, 9,216 and 65,536 floats on both ranks): the cost of the
transport itself, without the wait for a slower rank that a decode step's share holds.

Ends with ``RESULT tp2_vs_tp1_decode=<ratio> hetero_vs_same_handoff=<ratio>
p1d2_vs_same_handoff=<ratio> p2d2_vs_same_handoff=<ratio>`` (the decode ratio over the
all-reduce that decoded faster; targets: >= 0.7 and <= 1.2 for the first two; the last
two are P(TP1)->D(TP2) and P(TP2)->D(TP2) against P(TP1)->D(TP1)).

    .venv/bin/python bench/tp.py [--steps 24] [--rounds 2] [--prompt-len 2000]
                                 [--kv-backend tcp|grpc]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from splitserve.roles import Role
from splitserve.sampling import SamplingParams
from splitserve_worker.engine.config import EngineConfig
from splitserve_worker.engine.engine import Engine
from splitserve_worker.models import load_model
from splitserve_worker.server.ranks import start_ranked_engine
from support_path import use_test_support

BATCH = 16
KINDS = ("gloo", "shm")
PROBE_ELEMS = (576, BATCH * 576, 65536)
"""One decode row's hidden state, a batch-16 step's, and a long prefill chunk's share."""
PROBE_COUNT = 200
PROMPT = 64
SHAPE: dict[str, Any] = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
             num_attention_heads=8, num_key_value_heads=2, vocab_size=49152)  # fmt: skip


def build_model(folder: Path) -> Path:
    use_test_support()
    from tiny_models import save_tiny_llama

    return save_tiny_llama(folder, initializer_range=0.02, **SHAPE)


def decode_rate(engine: Engine, steps: int) -> tuple[float, float]:
    """(decode tokens/s at batch 16, seconds of decode measured), after every request
    has its first token."""
    for i in range(BATCH):
        prompt = [3 + (i * 31 + j * 7) % 250 for j in range(PROMPT)]
        engine.add_request(f"b{i}-{time.monotonic_ns()}", prompt,
                           SamplingParams(max_tokens=steps + 2, ignore_eos=True))  # fmt: skip
    while engine.num_waiting or any(s.num_output == 0 for s in engine.scheduler.running):
        engine.step()
    engine.step()  # one plain decode step first
    group = engine.group
    before = group.stats.all_reduce_s if group is not None else 0.0
    t0 = time.perf_counter()
    made = 0
    for _ in range(steps):
        made += len(engine.step())
    dt = time.perf_counter() - t0
    while engine.has_work():
        engine.step()
    reduce_s = (group.stats.all_reduce_s - before) if group is not None else 0.0
    return made / dt, reduce_s / dt


def bench_decode(path: Path, steps: int, rounds: int) -> dict[str, Any]:
    """Each round measures TP=1 (two threads), TP=2 over gloo and TP=2 over shared memory
    one right after the other (the host's load from other processes changes by the
    minute): each TP=2 rate is compared with its own round's TP=1 rate."""
    cfg1 = EngineConfig(num_blocks=512, dtype="float32", num_threads=2)
    cfg2 = EngineConfig(num_blocks=512, dtype="float32", num_threads=1)
    tp1 = Engine(load_model(str(path)), cfg1)
    torch.set_num_threads(1)
    out: dict[str, Any] = {"tp1_one_thread": decode_rate(tp1, steps)[0], "tp1": []}
    ranked = {k: start_ranked_engine(str(path), 2, cfg2, allreduce=k) for k in KINDS}
    try:
        for kind in KINDS:
            out[kind] = []
        for r in range(rounds):
            torch.set_num_threads(2)
            rate1, _ = decode_rate(tp1, steps)
            out["tp1"].append(rate1)
            torch.set_num_threads(1)
            line = f"  round {r}: TP=1 (2 threads) {rate1:.1f} tok/s"
            for kind in KINDS:
                g = ranked[kind].engine.group
                assert g is not None
                n0, s0 = g.stats.all_reduces, g.stats.all_reduce_s
                rate2, share = decode_rate(ranked[kind].engine, steps)
                cost = (g.stats.all_reduce_s - s0) / max(1, g.stats.all_reduces - n0)
                out[kind].append((rate2 / rate1, rate2, share, cost))
                line += (f"; TP=2 over {kind} {rate2:.1f} tok/s ({rate2 / rate1:.2f}x), "
                         f"all-reduce {share:.0%} of it, {cost * 1e3:.2f} ms each")  # fmt: skip
            print(line, flush=True)
        group = ranked["shm"].engine.group
        assert group is not None
        out["probe"] = {}
        for elems in PROBE_ELEMS:
            costs = {path: group.probe(path, elems, PROBE_COUNT) for path in KINDS}
            out["probe"][elems] = costs
            said = ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in costs.items())
            print(f"  one all-reduce of {elems} floats alone: {said}", flush=True)
    finally:
        for e in ranked.values():
            e.close()
    return out


async def _handoff(p_addr: str, d_addr: str, token: str, prompt_len: int, rounds: int,
                   tag: str, backend: str) -> tuple[float, float, float]:  # fmt: skip
    from splitserve.v1 import worker_pb2 as pb
    from splitserve_worker.client import WorkerClient

    p, d = WorkerClient(p_addr, token), WorkerClient(d_addr, token)
    sp = pb.SamplingParams(max_tokens=2, ignore_eos=True)
    best = (float("inf"), 0.0, 0.0)
    try:
        for i in range(rounds + 1):  # the first is a warm-up
            prompt = [3 + (i * 7919 + j * 31) % 250 for j in range(prompt_len)]
            rid = f"{tag}-{i}-{secrets.token_hex(4)}"
            compat = (await p.health()).compat
            handle = await d.reserve(rid, len(prompt), compat, kv_backend=backend,
                                     lease_seconds=600)  # fmt: skip
            gen = d.generate(rid, prompt, sp, expect_remote_kv=True)

            async def drain(g: Any = gen) -> None:
                async for _ in g:
                    pass

            task = asyncio.ensure_future(drain())
            t0 = time.perf_counter()
            r = await p.prefill(rid, prompt, sp, handle, timeout=600)
            wall = time.perf_counter() - t0
            await task
            if i and wall < best[0]:
                best = (wall, r.prefill_seconds, r.exposed_transfer_seconds)
    finally:
        await p.close()
        await d.close()
    return best


def bench_handoff(
    path: Path, prompt_len: int, rounds: int, backend: str
) -> dict[str, tuple[float, float, float]]:
    """``tp<p>`` (to a one-rank decode worker) and ``tp<p>-d2`` (to one over two ranks,
    each receiving its own KV heads; from two prefill ranks each pushes its own)."""
    from splitserve_worker.commands.up import WorkerProcs

    token = secrets.token_hex(8)
    out = {}
    for d_tp, suffix in ((1, ""), (2, "-d2")):
        with WorkerProcs(str(path), [Role.DECODE], token, threads=1, echo=False,
                         extra_args=["--kv-backend", backend],
                         tensor_parallel={Role.DECODE: d_tp}) as dec:  # fmt: skip
            (d_ep,) = dec.start(timeout_s=300)
            for label, tp, threads in (("tp1", 1, 2), ("tp2", 2, 1)):
                with WorkerProcs(str(path), [Role.PREFILL], token, threads=threads, echo=False,
                                 extra_args=["--kv-backend", backend],
                                 tensor_parallel={Role.PREFILL: tp}) as pre:  # fmt: skip
                    (p_ep,) = pre.start(timeout_s=300)
                    key = label + suffix
                    out[key] = asyncio.run(
                        _handoff(
                            p_ep.address, d_ep.address, token, prompt_len, rounds, key, backend
                        )
                    )
                    wall, comp, exposed = out[key]
                    print(f"  P(TP{tp}, {threads} thread(s) per rank) -> D(TP{d_tp}): Prefill "
                          f"call {wall:.2f} s, prefill compute {comp:.2f} s, transfer exposed "
                          f"{exposed * 1e3:.0f} ms", flush=True)  # fmt: skip
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=24, help="decode steps measured per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=2000)
    ap.add_argument("--kv-backend", choices=("tcp", "grpc"), default="tcp",
                    help="what the handoffs push over")  # fmt: skip
    args = ap.parse_args()
    if "OMP_WAIT_POLICY" not in os.environ:
        # OpenMP threads that spin at barriers stall one another on a shared host (a
        # two-thread decode step took seconds under load): threads sleep instead, in
        # this process and the ranks it starts
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        os.execv(sys.executable, [sys.executable, *sys.argv])
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with tempfile.TemporaryDirectory(prefix="bench-tp-") as tmp:
        path = build_model(Path(tmp) / "model")
        print(f"decode at batch {BATCH} ({PROMPT}-token prompts), float32:", flush=True)
        dec = bench_decode(path, args.steps, args.rounds)
        tp1 = statistics.median(dec["tp1"])
        print(f"  TP=1: {tp1:.1f} tok/s on 2 threads, {dec['tp1_one_thread']:.1f} on 1 (medians)")
        summary = {}
        for kind in KINDS:
            ratio = statistics.median(x[0] for x in dec[kind])
            share = statistics.median(x[2] for x in dec[kind])
            cost = statistics.median(x[3] for x in dec[kind])
            summary[kind] = (ratio, cost)
            print(f"  TP=2 over {kind}: {ratio:.2f}x TP=1 in the same round, all-reduce "
                  f"{share:.0%} of decode time, {cost * 1e3:.3f} ms each (medians)")  # fmt: skip
        pick = max(KINDS, key=lambda k: summary[k][0])
        print(f"  the faster TP=2 decode measured here: over {pick}")
        print(f"handoff of a {args.prompt_len}-token prompt over {args.kv_backend}:", flush=True)
        hand = bench_handoff(path, args.prompt_len, args.rounds, args.kv_backend)
    decode_ratio = summary[pick][0]
    handoff_ratio = hand["tp2"][0] / hand["tp1"][0]
    split = {k: hand[f"{k}-d2"][0] / hand["tp1"][0] for k in ("tp1", "tp2")}
    print(f"  against P(TP1) -> D(TP1): P(TP1) -> D(TP2) {split['tp1']:.2f}x, "
          f"P(TP2) -> D(TP2) {split['tp2']:.2f}x the Prefill call")  # fmt: skip
    print(
        f"RESULT tp2_vs_tp1_decode={decode_ratio:.2f} hetero_vs_same_handoff={handoff_ratio:.2f} "
        f"p1d2_vs_same_handoff={split['tp1']:.2f} p2d2_vs_same_handoff={split['tp2']:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

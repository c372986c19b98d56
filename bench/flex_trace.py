"""The client side of ``bench/flex.py``: the trace's requests, and the static split's
capacity that sets their rates.

One streamed completion is an :class:`Outcome` (its TTFT, TPOT, or why it failed); a
trace is phases of Poisson arrivals of long prompts (short answers) or long answers
(short prompts); :func:`calibrate` measures, closed loop, what a stack serves of each.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

LONG_PROMPT, SHORT_ANSWER = 768, 8
SHORT_PROMPT, LONG_ANSWER = 16, 96


@dataclass
class Outcome:
    ok: bool = False
    ttft: float = math.inf
    tpot: float = math.inf
    phase: str = ""
    """The trace phase it was sent in (prompts or answers)."""
    error: str = ""
    """Why it failed (not ok): the HTTP status and body, the stream's error, the
    transport's."""


async def one(client: Any, base: str, prompt: list[int], max_tokens: int) -> Outcome:
    """One streamed completion; a refused or broken one is a miss."""
    import httpx

    try:
        return await _one(client, base, prompt, max_tokens)
    except httpx.HTTPError as e:
        return Outcome(error=f"{type(e).__name__}: {e}")


async def _one(client: Any, base: str, prompt: list[int], max_tokens: int) -> Outcome:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}  # fmt: skip
    out, t0 = Outcome(), time.monotonic()
    first = last = None
    n = 0
    async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        if r.status_code != 200:
            out.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            return out
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out.error = f"stream error: {event['error']}"
            for c in event.get("choices", []):
                ids = c.get("token_ids") or []
                if ids:
                    last = time.monotonic()
                    first = first or last
                    n += len(ids)
    if first is None or last is None or n < max_tokens:
        out.error = out.error or f"{n} of {max_tokens} tokens"
        return out
    out.ok, out.ttft = True, first - t0
    out.tpot = (last - first) / (n - 1) if n > 1 else 0.0
    return out


def prompt(rng: random.Random, n: int) -> list[int]:
    return [1] + [rng.randrange(3, 250) for _ in range(n - 1)]


async def sent_in(phase: str, job: Any) -> Outcome:
    out: Outcome = await job
    out.phase = phase
    return out


async def drive(base: str, phases: list[tuple[str, float, float]], seed: int) -> list[Outcome]:
    """Poisson arrivals, phase by phase: (kind, seconds, rate)."""
    import httpx

    rng = random.Random(seed)
    tasks: list[asyncio.Task[Outcome]] = []
    limits = httpx.Limits(max_connections=512)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
        t0 = time.monotonic()
        end = 0.0
        for kind, seconds, rate in phases:
            end += seconds
            while True:
                await asyncio.sleep(rng.expovariate(rate))
                if time.monotonic() - t0 >= end:
                    break
                if kind == "prompts":
                    job = one(client, base, prompt(rng, LONG_PROMPT), SHORT_ANSWER)
                else:
                    job = one(client, base, prompt(rng, SHORT_PROMPT), LONG_ANSWER)
                tasks.append(asyncio.create_task(sent_in(kind, job)))
        return list(await asyncio.gather(*tasks))


@dataclass(frozen=True)
class Calibration:
    ttft: float
    """One long prompt alone: TTFT (s)."""
    tpot: float
    """One long answer alone: TPOT (s)."""
    prompts_per_s: float
    """Long prompts the static split completes per second, closed loop (the better of
    two windows)."""
    answers_per_s: float
    """Long answers the static split completes per second at ``streams`` in flight."""
    streams: int
    """The concurrent long answers (of 2, 4, 8, 16, 24, 32, 48, up to the first whose
    TPOT left the objective) that completed the most per second."""

    @property
    def slo(self) -> tuple[float, float]:
        return 3 * self.ttft, 3 * self.tpot


async def closed_loop(
    client: Any, base: str, callers: int, seconds: float, job: Any
) -> tuple[list[Outcome], float]:
    """``callers`` each sending one request after another until ``seconds`` passed;
    the outcomes and the time until the last finished."""
    t0 = time.monotonic()
    out: list[Outcome] = []

    async def caller() -> None:
        while time.monotonic() - t0 < seconds:
            out.append(await job())

    await asyncio.gather(*(caller() for _ in range(callers)))
    return out, time.monotonic() - t0


async def calibrate(base: str) -> Calibration:
    """A stack's own figures on this host now (see ``bench/flex.py``'s docstring)."""
    import httpx

    rng = random.Random(0)

    def long_prompt() -> Any:
        return one(client, base, prompt(rng, LONG_PROMPT), SHORT_ANSWER)

    def long_answer() -> Any:
        return one(client, base, prompt(rng, SHORT_PROMPT), LONG_ANSWER)

    async with httpx.AsyncClient(timeout=300.0, limits=httpx.Limits(max_connections=64)) as client:
        await long_prompt()  # warm-up
        await long_answer()
        ttft = statistics.median([(await long_prompt()).ttft for _ in range(3)])
        tpot = statistics.median([(await long_answer()).tpot for _ in range(2)])
        prompts_per_s = 0.0
        for _ in range(2):  # the better of two: a capacity, not a moment of the host's
            done, seconds = await closed_loop(client, base, 2, 5.0, long_prompt)
            prompts_per_s = max(prompts_per_s, sum(o.ok for o in done) / seconds)
        answers_per_s, streams = 0.0, 0
        for k in (2, 4, 8, 16, 24, 32, 48):
            done, seconds = await closed_loop(client, base, k, 5.0, long_answer)
            if statistics.median(o.tpot for o in done) > 3 * tpot:
                break
            served = sum(o.ok for o in done) / seconds
            if served > answers_per_s:
                answers_per_s, streams = served, k
    if streams == 0:  # not even two streams inside the objective: one is what it serves
        answers_per_s, streams = 1 / (LONG_ANSWER * tpot), 1
    return Calibration(ttft, tpot, prompts_per_s, answers_per_s, streams)

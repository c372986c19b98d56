"""Synthetic traces with the shape of the public ones, made here (nothing downloaded).

:func:`mooncake_like` draws a day of conversation-style traffic: a diurnal
arrival rate, long-tailed prompt and output lengths, and prefix reuse through
``hash_ids`` (shared system prompts, and multi-turn conversations whose next
prompt extends the previous one). :func:`azure_like` draws the Azure
code/conversation shape (no prefix information).
"""

from __future__ import annotations

import math

import numpy as np

from splitserve_operator.sim.workload import Workload

DAY_S = 86400.0


def diurnal_arrivals(
    n: int, duration_s: float, rng: np.random.Generator, swing: float = 0.6
) -> np.ndarray:
    """``n`` sorted arrival times in ``[0, duration_s)`` whose density follows
    ``1 + swing * sin(...)``: a trough at the start, a peak half way."""
    out = np.empty(0)
    while len(out) < n:
        t = rng.uniform(0.0, duration_s, size=2 * n)
        dens = 1 + swing * np.sin(2 * math.pi * t / duration_s - math.pi / 2)
        keep = rng.uniform(0.0, 1 + swing, size=2 * n) < dens
        out = np.concatenate([out, t[keep]])
    return np.sort(out[:n])


def mooncake_like(
    n: int,
    duration_s: float = DAY_S,
    *,
    seed: int = 0,
    mean_prompt: float = 2048,
    mean_output: float = 256,
    block_tokens: int = 512,
    system_prompts: int = 32,
    followup_share: float = 0.35,
    name: str | None = None,
) -> Workload:
    """A Mooncake-format workload. Every prompt's ``hash_ids`` has one id per
    started ``block_tokens`` block; ids are shared exactly when prefixes are."""
    rng = np.random.default_rng(seed)
    arrival = diurnal_arrivals(n, duration_s, rng)
    sys_blocks = rng.integers(1, 5, size=system_prompts)
    next_id = 0
    sys_ids: list[tuple[int, ...]] = []
    for nb in sys_blocks:
        sys_ids.append(tuple(range(next_id, next_id + int(nb))))
        next_id += int(nb)
    zipf = 1.0 / np.arange(1, system_prompts + 1)
    zipf /= zipf.sum()
    sys_pick = rng.choice(system_prompts, size=n, p=zipf)
    extra = np.maximum(1, rng.lognormal(math.log(mean_prompt) - 0.5, 1.0, size=n)).astype(np.int64)
    outputs = np.clip(rng.lognormal(math.log(mean_output) - 0.32, 0.8, size=n), 1, 8192)
    followup = rng.uniform(size=n) < followup_share
    prompts = np.empty(n, dtype=np.int64)
    hashes: list[tuple[int, ...]] = []
    for i in range(n):
        if followup[i] and i > 0:
            j = int(rng.integers(max(0, i - 200), i))  # a recent conversation goes on
            base_ids = hashes[j]
            base_len = len(base_ids) * block_tokens
        else:
            base_ids = sys_ids[sys_pick[i]]
            base_len = len(base_ids) * block_tokens
        total = min(base_len + int(extra[i]), 128 * 1024)
        nblocks = -(-total // block_tokens)
        new = max(0, nblocks - len(base_ids))
        ids = base_ids[:nblocks] + tuple(range(next_id, next_id + new))
        next_id += new
        hashes.append(ids)
        prompts[i] = total
    return Workload(
        arrival,
        prompts,
        np.rint(outputs).astype(np.int64),
        hashes,
        name or f"mooncake-like({n} requests over {duration_s:g} s, seed {seed})",
        block_tokens,
    )


def azure_like(
    n: int,
    duration_s: float = 3600.0,
    *,
    seed: int = 0,
    kind: str = "conv",
) -> Workload:
    """Azure LLM inference shape: ``conv`` (prompts ~1k, outputs ~250) or
    ``code`` (prompts ~2k, outputs ~30)."""
    rng = np.random.default_rng(seed)
    arrival = diurnal_arrivals(n, duration_s, rng, swing=0.3)
    if kind == "code":
        p_mean, o_mean = 2048.0, 28.0
    else:
        p_mean, o_mean = 1024.0, 232.0
    prompts = np.clip(rng.lognormal(math.log(p_mean) - 0.5, 1.0, size=n), 2, 32768)
    outputs = np.clip(rng.lognormal(math.log(o_mean) - 0.32, 0.8, size=n), 1, 4096)
    return Workload(
        arrival,
        np.rint(prompts).astype(np.int64),
        np.rint(outputs).astype(np.int64),
        None,
        f"azure-{kind}-like({n} requests, seed {seed})",
    )

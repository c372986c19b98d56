"""The sampler: penalties, greedy, temperature, top-k, top-p, min-p, seeds, following a
request's :class:`splitserve.sampling.SamplingParams` (the contract's type).

Each sampled row is drawn with its own ``torch.Generator`` (seeded per request), row by
row, so a seeded request gets the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from splitserve.sampling import SamplingParams

TopLogprobs = list[tuple[int, float]]
"""The most likely tokens at one position, with their log-probabilities, best first."""


def make_generator(params: SamplingParams, device: torch.device | str) -> torch.Generator | None:
    """The request's own generator (``None`` for greedy or unseeded sampling)."""
    if params.greedy or params.seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(params.seed % (2**64))
    return g


@dataclass
class SampleRow:
    """What the sampler needs to know about one row of logits."""

    params: SamplingParams
    generator: torch.Generator | None
    suppress: Sequence[int] = ()
    """Token ids that must not be chosen (EOS and stop ids before ``min_tokens``)."""
    tokens: Sequence[int] = ()
    """The sequence so far, prompt then output (read only for penalties)."""
    prompt_len: int = 0


def sample(logits: torch.Tensor, rows: Sequence[SampleRow]) -> tuple[list[int], list[float | None]]:
    """Choose one token per row of ``logits`` ``[B, V]``; return tokens and logprobs.

    Logprobs are those of the model's own distribution (before penalties, temperature and
    filters).
    """
    logits = logits.float()
    if any(r.suppress for r in rows):
        logits = logits.clone()
        for i, r in enumerate(rows):
            if r.suppress:
                ids = [t for t in r.suppress if 0 <= t < logits.shape[1]]
                logits[i, ids] = -math.inf
    model_logits = logits
    if any(r.params.logit_bias or r.params.penalized for r in rows):
        logits = logits.clone()
        for i, r in enumerate(rows):  # the bias first, then penalties
            if r.params.logit_bias:
                apply_bias(logits[i], r.params.logit_bias)
            if r.params.penalized:
                apply_penalties(logits[i], r)
    tokens: list[int] = [0] * len(rows)
    greedy_idx = [i for i, r in enumerate(rows) if r.params.greedy]
    if greedy_idx:
        chosen = logits[greedy_idx].argmax(dim=-1).tolist()
        for i, t in zip(greedy_idx, chosen, strict=True):
            tokens[i] = int(t)
    for i, r in enumerate(rows):
        if not r.params.greedy:
            tokens[i] = _sample_row(logits[i], r.params, r.generator)
    logprobs: list[float | None] = [None] * len(rows)
    lp_idx = [i for i, r in enumerate(rows) if r.params.logprobs]
    if lp_idx:
        lp = torch.log_softmax(model_logits[lp_idx], dim=-1)
        for j, i in enumerate(lp_idx):
            logprobs[i] = float(lp[j, tokens[i]])
    return tokens, logprobs


def top_logprobs(logits: torch.Tensor, rows: Sequence[SampleRow]) -> list[TopLogprobs]:
    """Per row of ``logits`` ``[B, V]``: its ``top_logprobs`` most likely tokens under the
    model's own distribution, best first (empty where none were asked for)."""
    out: list[TopLogprobs] = [[] for _ in rows]
    for i, r in enumerate(rows):
        k = min(r.params.top_logprobs, logits.shape[1])
        if k > 0:
            values, ids = torch.topk(torch.log_softmax(logits[i].float(), dim=-1), k)
            out[i] = list(zip(ids.tolist(), values.tolist(), strict=True))
    return out


def apply_bias(row: torch.Tensor, bias: Sequence[tuple[int, float]]) -> None:
    """Add, in place, each (token id, bias) to that token's logit in ``row`` ``[V]``."""
    vocab = row.shape[0]
    pairs = [(t, b) for t, b in bias if 0 <= t < vocab]
    if pairs:
        ids = torch.tensor([t for t, _ in pairs], dtype=torch.long, device=row.device)
        row.index_add_(0, ids, torch.tensor([b for _, b in pairs], dtype=row.dtype,
                                            device=row.device))  # fmt: skip


def apply_penalties(row: torch.Tensor, r: SampleRow) -> None:
    """Penalise, in place, one row of logits ``[V]`` for what ``r.tokens`` holds."""
    p = r.params
    vocab = row.shape[0]
    if p.repetition_penalty != 1.0 and r.tokens:
        seen = torch.tensor(sorted({t for t in r.tokens if 0 <= t < vocab}), dtype=torch.long)
        picked = row[seen]
        row[seen] = torch.where(
            picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty
        )
    start = max(0, r.prompt_len - p.resumed_tokens)
    output = [t for t in r.tokens[start:] if 0 <= t < vocab]
    if output and (p.presence_penalty or p.frequency_penalty):
        counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=vocab)
        counts = counts[:vocab].to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


def _sample_row(row: torch.Tensor, p: SamplingParams, g: torch.Generator | None) -> int:
    scaled = row / p.temperature
    vocab = scaled.shape[0]
    if 0 < p.top_k < vocab:
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, -math.inf)
    probs = torch.softmax(scaled, dim=-1)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        probs = probs / probs.sum()
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_probs, dim=-1)
        # keep a token while the mass before it is below top_p (the first is always kept)
        drop_sorted = (cum - sorted_probs) >= p.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p; one draw per vocab entry
    # from this row's own generator keeps the result independent of the batch.
    noise = torch.empty_like(probs).exponential_(1.0, generator=g)
    return int(torch.argmax(probs / noise))

"""The sampler: penalties, logit bias, greedy, temperature, top-k, top-p, min-p, seeds,
logprobs and top logprobs, following each request's
:class:`splitserve.sampling.SamplingParams` (the contract's type).

All rows are sampled together on the logits' device: every tensor the sampler builds
(the rows' token ids to suppress, bias, penalise; per-row temperatures and thresholds)
is made there, and the step's answer (tokens, logprobs, top logprobs) comes back to the
host in one copy (:func:`draw` does the device work, :func:`sample` the one sync).

A row is drawn by the exponential race (``argmax(p / E)``, ``E ~ Exp(1)``, one draw per
vocabulary entry). Unseeded rows share one batched draw; a seeded row draws from its
request's own ``torch.Generator`` alone, so a seeded request gets the same tokens
whatever else shares its batch.
"""

from __future__ import annotations

import math
from collections import Counter
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


@dataclass
class Sampled:
    """One step's choices, one entry per row."""

    tokens: list[int]
    logprobs: list[float | None]
    """The chosen token's log-probability under the model's distribution (after
    suppression, before bias, penalties, temperature and filters), where asked for."""
    top: list[TopLogprobs]
    """The row's ``top_logprobs`` most likely tokens (empty where none were asked for)."""


@dataclass(frozen=True)
class Layout:
    """Where each part of :func:`draw`'s packed answer is."""

    rows: int
    logprob_rows: tuple[int, ...]
    top_rows: tuple[int, ...]
    top_k: tuple[int, ...]
    """Per row of ``top_rows``: how many it asked for (of ``max(top_k)`` drawn)."""


def sample(logits: torch.Tensor, rows: Sequence[SampleRow]) -> Sampled:
    """Choose one token per row of ``logits`` ``[B, V]``: the device work of :func:`draw`,
    then one copy of its answer to the host."""
    packed, layout = draw(logits, rows)
    return unpack(packed.tolist(), layout)


def draw(logits: torch.Tensor, rows: Sequence[SampleRow]) -> tuple[torch.Tensor, Layout]:
    """Everything :func:`sample` computes, on the logits' device: a float64 tensor packing
    the tokens, then the asked-for logprobs, then the top logprobs' values and ids."""
    dev = logits.device
    logits = logits.float()
    n, vocab = logits.shape
    raw = logits
    if any(r.suppress for r in rows):
        pairs = [(i, t) for i, r in enumerate(rows) for t in set(r.suppress) if 0 <= t < vocab]
        logits = logits.clone()
        if pairs:
            logits[_index(pairs, dev)] = -math.inf
    model_logits = logits
    if any(r.params.logit_bias or r.params.penalized for r in rows):
        logits = penalize(logits, rows)

    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    if len(greedy) == n:
        tokens = logits.argmax(dim=-1)
    else:
        tokens = torch.empty(n, dtype=torch.long, device=dev)
        if greedy:
            g = torch.tensor(greedy, dtype=torch.long, device=dev)
            tokens[g] = logits.index_select(0, g).argmax(dim=-1)
        picked = [i for i in range(n) if not rows[i].params.greedy]
        s = torch.tensor(picked, dtype=torch.long, device=dev)
        tokens[s] = _sample_rows(logits.index_select(0, s), [rows[i] for i in picked])

    parts = [tokens.double()]
    lp_rows = tuple(i for i, r in enumerate(rows) if r.params.logprobs)
    if lp_rows:
        idx = torch.tensor(lp_rows, dtype=torch.long, device=dev)
        lp = torch.log_softmax(model_logits.index_select(0, idx), dim=-1)
        parts.append(lp.gather(1, tokens.index_select(0, idx)[:, None])[:, 0].double())
    top_rows = tuple(i for i, r in enumerate(rows) if r.params.top_logprobs > 0)
    top_k = tuple(min(rows[i].params.top_logprobs, vocab) for i in top_rows)
    if top_rows:
        idx = torch.tensor(top_rows, dtype=torch.long, device=dev)
        values, ids = torch.topk(torch.log_softmax(raw.index_select(0, idx), dim=-1), max(top_k))
        parts.extend([values.reshape(-1).double(), ids.reshape(-1).double()])
    return torch.cat(parts), Layout(n, lp_rows, top_rows, top_k)


def unpack(values: list[float], layout: Layout) -> Sampled:
    """:func:`draw`'s packed answer, read back on the host."""
    n = layout.rows
    tokens = [int(t) for t in values[:n]]
    logprobs: list[float | None] = [None] * n
    at = n
    for i in layout.logprob_rows:
        logprobs[i] = values[at]
        at += 1
    top: list[TopLogprobs] = [[] for _ in range(n)]
    if layout.top_rows:
        width = max(layout.top_k)
        size = width * len(layout.top_rows)
        vals, ids = values[at : at + size], values[at + size : at + 2 * size]
        for j, (i, k) in enumerate(zip(layout.top_rows, layout.top_k, strict=True)):
            lo = j * width
            top[i] = [(int(ids[lo + c]), vals[lo + c]) for c in range(k)]
    return Sampled(tokens, logprobs, top)


def penalize(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """``logits`` ``[B, V]`` with each row's logit bias added, then its repetition penalty
    applied to every token of its sequence, then presence and frequency penalties
    subtracted for every token of its output (a new tensor, on the logits' device)."""
    dev = logits.device
    vocab = logits.shape[1]
    out = logits.clone()
    bias = [(i, t, b) for i, r in enumerate(rows) for t, b in r.params.logit_bias if 0 <= t < vocab]
    if bias:
        out.index_put_(_index([(i, t) for i, t, _ in bias], dev),
                       _floats([b for *_, b in bias], dev), accumulate=True)  # fmt: skip
    seen: list[tuple[int, int]] = []
    factor: list[float] = []
    for i, r in enumerate(rows):
        rep = r.params.repetition_penalty
        if rep != 1.0 and r.tokens:
            ids = sorted({t for t in r.tokens if 0 <= t < vocab})
            seen.extend((i, t) for t in ids)
            factor.extend([rep] * len(ids))
    if seen:
        where = _index(seen, dev)
        picked = out[where]
        f = _floats(factor, dev)
        out[where] = torch.where(picked > 0, picked / f, picked * f)
    counted: list[tuple[int, int]] = []
    minus: list[float] = []
    for i, r in enumerate(rows):
        p = r.params
        if not (p.presence_penalty or p.frequency_penalty):
            continue
        start = max(0, r.prompt_len - p.resumed_tokens)
        counts = Counter(t for t in r.tokens[start:] if 0 <= t < vocab)
        for t, c in sorted(counts.items()):
            counted.append((i, t))
            minus.append(p.frequency_penalty * c + p.presence_penalty)
    if counted:
        out.index_put_(_index(counted, dev), -_floats(minus, dev), accumulate=True)
    return out


def _sample_rows(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """Tokens drawn for rows ``[S, V]`` that sample (none greedy). With top-p in the batch
    the rows are sorted once (top-k, min-p and top-p then read the sorted order) and the
    draw picks a sorted position; without it nothing is sorted."""
    dev = logits.device
    s, vocab = logits.shape
    params = [r.params for r in rows]
    scaled = logits / _floats([p.temperature for p in params], dev)[:, None]
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    k = torch.tensor([max(k, 1) - 1 for k in ks], dtype=torch.long, device=dev)[:, None]
    has_k = torch.tensor([k > 0 for k in ks], device=dev)[:, None]
    order: torch.Tensor | None = None
    if any(p.top_p < 1.0 for p in params):
        scaled, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
        if any(ks):  # keep what reaches the k-th largest (ties with it included)
            scaled = scaled.masked_fill(has_k & (scaled < scaled.gather(1, k)), -math.inf)
    elif any(ks):
        kth = torch.topk(scaled, max(ks), dim=-1).values.gather(1, k)
        scaled = scaled.masked_fill(has_k & (scaled < kth), -math.inf)
    probs = torch.softmax(scaled, dim=-1)
    if any(p.min_p > 0.0 for p in params):
        min_p = _floats([p.min_p for p in params], dev)[:, None]
        kept = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
        probs = torch.where(min_p > 0, kept / kept.sum(dim=-1, keepdim=True), probs)
    if order is not None:
        top_p = _floats([p.top_p for p in params], dev)[:, None]
        # keep a token while the mass before it is below top_p (the first is always kept)
        drop = ((torch.cumsum(probs, dim=-1) - probs) >= top_p) & (top_p < 1.0)
        probs = probs.masked_fill(drop, 0.0)
    noise = torch.empty_like(probs)
    seeded = [j for j, r in enumerate(rows) if r.generator is not None]
    if len(seeded) < s:
        if seeded:
            free = [j for j in range(s) if rows[j].generator is None]
            fi = torch.tensor(free, dtype=torch.long, device=dev)
            noise[fi] = torch.empty((len(free), vocab), device=dev).exponential_(1.0)
        else:
            noise.exponential_(1.0)
    for j in seeded:  # its own generator, one draw per vocabulary entry, as if alone
        noise[j].exponential_(1.0, generator=rows[j].generator)
    picked = torch.argmax(probs / noise, dim=-1)
    if order is None:
        return picked
    return order.gather(1, picked[:, None])[:, 0]


def _index(
    pairs: Sequence[tuple[int, int]], dev: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row ids, column ids) on ``dev`` for advanced indexing of ``[B, V]``."""
    t = torch.tensor(pairs, dtype=torch.long, device=dev).reshape(-1, 2)
    return t[:, 0], t[:, 1]


def _floats(values: Sequence[float], dev: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=dev)

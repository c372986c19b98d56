"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, seeds.

Each sampled row is drawn with its own ``torch.Generator`` (seeded per request), row by
row, so a seeded request gets the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from splitserve_worker.engine.errors import RequestError


@dataclass(frozen=True)
class SamplingParams:
    """How to choose the tokens of one request. ``validate()`` checks every field."""

    temperature: float = 0.0
    """0 is greedy; higher flattens the distribution."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches this."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 keeps all."""
    seed: int | None = None
    """Seed of this request's own generator: the same seed gives the same tokens."""
    max_tokens: int = 16
    """Most tokens to generate."""
    min_tokens: int = 0
    """EOS and stop token ids are suppressed until this many tokens are generated."""
    ignore_eos: bool = False
    """Keep generating past EOS (until max_tokens or a stop condition)."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end the request (the stop token is emitted)."""
    stop: tuple[str, ...] = ()
    """Strings that end the request once they appear in the generated text."""
    logprobs: bool = False
    """Return the log-probability of each chosen token."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self) -> None:
        """Raise :class:`RequestError` naming the first bad field."""
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise RequestError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_tokens < 1:
            raise RequestError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise RequestError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if self.seed is not None and not (-(2**63) <= self.seed < 2**64):
            raise RequestError(f"seed must fit in 64 bits, got {self.seed}")
        if any(t < 0 for t in self.stop_token_ids):
            raise RequestError(f"stop_token_ids must be >= 0, got {list(self.stop_token_ids)}")
        if any(not s for s in self.stop):
            raise RequestError("stop strings must not be empty")

    def make_generator(self, device: torch.device | str) -> torch.Generator | None:
        """This request's generator (``None`` for greedy or unseeded sampling)."""
        if self.greedy or self.seed is None:
            return None
        g = torch.Generator(device=device)
        g.manual_seed(self.seed % (2**64))
        return g


@dataclass
class SampleRow:
    """What the sampler needs to know about one row of logits."""

    params: SamplingParams
    generator: torch.Generator | None
    suppress: Sequence[int] = ()
    """Token ids that must not be chosen (EOS and stop ids before ``min_tokens``)."""


def sample(logits: torch.Tensor, rows: Sequence[SampleRow]) -> tuple[list[int], list[float | None]]:
    """Choose one token per row of ``logits`` ``[B, V]``; return tokens and logprobs.

    Logprobs are those of the model's own distribution (before temperature and filters).
    """
    logits = logits.float()
    if any(r.suppress for r in rows):
        logits = logits.clone()
        for i, r in enumerate(rows):
            if r.suppress:
                ids = [t for t in r.suppress if 0 <= t < logits.shape[1]]
                logits[i, ids] = -math.inf
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
        lp = torch.log_softmax(logits[lp_idx], dim=-1)
        for j, i in enumerate(lp_idx):
            logprobs[i] = float(lp[j, tokens[i]])
    return tokens, logprobs


def _sample_row(row: torch.Tensor, p: SamplingParams, g: torch.Generator | None) -> int:
    scaled = row / p.temperature
    vocab = scaled.shape[0]
    if 0 < p.top_k < vocab:
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, -math.inf)
    probs = torch.softmax(scaled, dim=-1)
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

"""Prompt logprobs: how likely the model finds each prompt token given the ones before it.

What OpenAI's completions return for ``echo`` with ``logprobs`` (and what evaluation
harnesses read to score a continuation). A forward scores the rows of a chunk whose
next token is still a prompt token: the final hidden state of position ``p`` gives the
distribution of token ``p + 1``. Rows go through the LM head a slice at a time, so a
long prompt never holds a whole ``[prompt, vocab]`` matrix of logits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from splitserve_worker.engine.sampling import TopLogprobs

ROWS_PER_PASS = 256
"""Rows through the LM head at once: 256 x a 49,152-token vocabulary is 48 MiB of float32."""


@dataclass
class ChunkScores:
    """What one chunk asks a forward to score, and (filled by the forward) the answer."""

    targets: Sequence[int]
    """The token after each scored row: the chunk's first ``len(targets)`` rows are scored."""
    top: int = 0
    """Most likely tokens to return per row (besides the target's logprob)."""
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    """Each target's rank among the vocabulary at its row (1: the most likely)."""
    tops: list[TopLogprobs] = field(default_factory=list)


def score_rows(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    want: ChunkScores,
    rows_per_pass: int = ROWS_PER_PASS,
) -> None:
    """Fill ``want`` from the final-normed ``hidden`` ``[len(targets), hidden]`` rows."""
    want.logprobs, want.ranks, want.tops = [], [], []
    n = len(want.targets)
    targets = torch.tensor(list(want.targets), dtype=torch.long, device=hidden.device)
    for lo in range(0, n, rows_per_pass):
        hi = min(n, lo + rows_per_pass)
        lp = torch.log_softmax(head(hidden[lo:hi]).float(), dim=-1)
        picked = lp.gather(1, targets[lo:hi, None])
        want.logprobs.extend(picked[:, 0].tolist())
        want.ranks.extend(((lp > picked).sum(dim=1) + 1).tolist())
        k = min(want.top, lp.shape[1])
        if k > 0:
            values, ids = torch.topk(lp, k, dim=-1)
            want.tops.extend(
                list(zip(i, v, strict=True))
                for i, v in zip(ids.tolist(), values.tolist(), strict=True)
            )


def chunk_targets(tokens: Sequence[int], prompt_len: int, start: int, end: int) -> list[int]:
    """The tokens to score for the rows at positions ``[start, end)``: position ``p``
    predicts ``tokens[p + 1]``, scored while that is still a prompt token."""
    return list(tokens[start + 1 : min(end + 1, prompt_len)])


@dataclass
class PromptLogprobs:
    """One request's prompt scores: entry ``i`` is for prompt token ``i + 1`` (the first
    prompt token has nothing before it and no logprob)."""

    logprobs: list[float]
    tops: list[TopLogprobs]
    ranks: list[int] = field(default_factory=list)

    @classmethod
    def empty(cls, prompt_len: int) -> PromptLogprobs:
        n = max(0, prompt_len - 1)
        return cls([float("nan")] * n, [[] for _ in range(n)], [0] * n)

    def record(self, start: int, scores: ChunkScores) -> None:
        """Store the scores of rows from position ``start`` (by position: a chunk computed
        again after a preemption overwrites what it gave before)."""
        for j, lp in enumerate(scores.logprobs):
            self.logprobs[start + j] = lp
        for j, rank in enumerate(scores.ranks):
            self.ranks[start + j] = rank
        for j, top in enumerate(scores.tops):
            self.tops[start + j] = top

    @property
    def complete(self) -> bool:
        return all(lp == lp for lp in self.logprobs)  # NaN marks a position not yet scored

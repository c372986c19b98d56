"""How closely greedy tokens decoded in bfloat16 agree with transformers' own model.

Free-running greedy outputs are a poor measure in bfloat16: the first near-tie that
rounds the other way sends the rest of the sequence elsewhere, so one rounding step
can cost every later token. Here the reference model is *teacher-forced* on the tokens
being judged (prompt plus the output so far, one forward pass), and each output token
is compared with the reference's choice at that position. Where they differ, the
reference's own logits say how near a tie it was. :data:`MIN_AGREEMENT` and
:data:`MAX_TIE_GAP` are what the bf16 tests (CPU here, CUDA in ``tests/gpu``) hold the
engine to.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

MIN_AGREEMENT = 0.9
"""Share of output tokens that must be the reference's own choice at their position.
Rounding flips only near-ties; a wrong cache, position or mask flips most tokens."""
MAX_TIE_GAP = 0.5
"""Where a token is not the reference's choice, how far below the reference's best
logit it may be (logits; a bfloat16 logit of magnitude 4-8 is rounded to 1/32-1/16,
and rounding differences accumulated over the layers reach a few tenths)."""


@dataclass(frozen=True)
class Agreement:
    matched: int
    total: int
    worst_gap: float
    """Largest (best logit - logit of the judged token) over the positions that differ."""
    first_diverged: tuple[int | None, ...]
    """Per sequence, the first position where the judged token was not the reference's."""

    @property
    def share(self) -> float:
        return self.matched / self.total if self.total else 1.0

    def check(self) -> None:
        assert self.total > 0, "no tokens to judge"
        assert self.share >= MIN_AGREEMENT, (
            f"only {self.matched}/{self.total} tokens are the reference's choice "
            f"(< {MIN_AGREEMENT:.0%}); first divergence per sequence {self.first_diverged}"
        )
        assert self.worst_gap <= MAX_TIE_GAP, (
            f"a token {self.worst_gap:.3f} logits below the reference's best (> {MAX_TIE_GAP}): "
            f"not a rounding tie"
        )


def teacher_forced_agreement(
    model: Any, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]
) -> Agreement:
    """Judges each ``outputs[i]`` (greedy tokens for ``prompts[i]``) against ``model``
    (a transformers causal LM, on its own device and dtype)."""
    import torch

    device = next(model.parameters()).device
    matched = total = 0
    worst = 0.0
    firsts: list[int | None] = []
    with torch.inference_mode():
        for prompt, out in zip(prompts, outputs, strict=True):
            if not out:
                firsts.append(None)
                continue
            ids = torch.tensor([[*prompt, *out[:-1]]], device=device)
            logits = model(ids).logits[0, len(prompt) - 1 :].float()  # one row per output token
            judged = torch.tensor(list(out), device=device)
            best = logits.argmax(dim=-1)
            same = best == judged
            matched += int(same.sum())
            total += len(out)
            gaps = logits.gather(1, best[:, None])[:, 0] - logits.gather(1, judged[:, None])[:, 0]
            worst = max(worst, float(gaps.max()))
            differ = (~same).nonzero()
            firsts.append(int(differ[0, 0]) if len(differ) else None)
    return Agreement(matched, total, worst, tuple(firsts))

"""The sampler draws tokens as often as ``softmax(logits / T)`` after top-k, min-p and
top-p says, not merely from the right set.

Each case draws N tokens from one row of logits with one seeded generator, and Pearson's
chi-square test compares the counts with the distribution computed here, in float64,
from the definitions. With the seed fixed the draws are the same on every run; the
threshold ALPHA is what a fresh seed would risk: a correct sampler fails one case in
a million seeds. Each case also shows the test has the power to tell: the same counts
are rejected against what a sampler that ignored the temperature, or kept one token
too many or too few in top-k or top-p, or drew every allowed token alike, would draw.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import pytest
import torch
from chi_square import goodness_of_fit
from splitserve.sampling import SamplingParams
from splitserve_worker.engine.sampling import SampleRow, make_generator, sample

pytestmark = pytest.mark.unit

N = 8_000
SEED = 1234
ALPHA = 1e-6
LOGITS = (1.2, -0.5, 2.0, 0.0, -3.0, 1.5, -1.0, 0.5, -2.0, 1.0)
"""Ten tokens, out of order so that filters must follow the values, not the ids."""


def reference(
    logits: tuple[float, ...], temperature: float, top_k: int, top_p: float, min_p: float
) -> list[float]:
    """The sampling distribution from the definitions (float64, no torch)."""
    scaled = [x / temperature for x in logits]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    keep = set(order[:top_k]) if 0 < top_k < len(scaled) else set(order)
    top = max(scaled[i] for i in keep)
    weights = [math.exp(scaled[i] - top) if i in keep else 0.0 for i in range(len(scaled))]
    total = math.fsum(weights)
    probs = [w / total for w in weights]
    if min_p > 0:
        floor = min_p * max(probs)
        probs = [p if p >= floor else 0.0 for p in probs]
        total = math.fsum(probs)
        probs = [p / total for p in probs]
    if top_p < 1.0:
        mass = 0.0
        kept = set()
        for i in sorted(range(len(probs)), key=lambda i: -probs[i]):
            if mass >= top_p or probs[i] == 0.0:
                break
            kept.add(i)  # a token is kept while the mass before it is below top_p
            mass += probs[i]
        probs = [p if i in kept else 0.0 for i, p in enumerate(probs)]
        total = math.fsum(probs)
        probs = [p / total for p in probs]
    return probs


@dataclass(frozen=True)
class Case:
    id: str
    temperature: float
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def params(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            seed=SEED,
        )

    def probs(self, **change: float) -> list[float]:
        c = replace(self, **change)  # type: ignore[arg-type]
        return reference(LOGITS, c.temperature, c.top_k, c.top_p, c.min_p)


CASES = [
    Case("plain", temperature=1.0),
    Case("cold", temperature=0.5),
    Case("hot-top-k", temperature=1.7, top_k=4),
    Case("top-p", temperature=1.0, top_p=0.7),
    Case("top-k-and-top-p", temperature=0.8, top_k=6, top_p=0.9),
    Case("min-p", temperature=1.3, min_p=0.1),
]


def _draw(case: Case) -> list[int]:
    params = case.params()
    generator = make_generator(params, "cpu")
    assert generator is not None
    rows = [SampleRow(params, generator) for _ in range(N)]
    tokens = sample(torch.tensor([LOGITS]).expand(N, len(LOGITS)), rows).tokens
    counts = [0] * len(LOGITS)
    for t in tokens:
        counts[t] += 1
    return counts


def _kept(probs: list[float]) -> int:
    return sum(p > 0 for p in probs)


def _wrong_samplers(case: Case) -> dict[str, list[float]]:
    """What a sampler with one plausible mistake would draw, where it differs."""
    right = case.probs()
    wrong: dict[str, Callable[[], list[float]]] = {
        "uniform over the right tokens": lambda: [p and 1.0 / _kept(right) for p in right],
        "temperature ignored": lambda: case.probs(temperature=1.0),
        "temperature squared": lambda: case.probs(temperature=case.temperature**2),
    }
    if case.top_k:
        wrong["top-k one more"] = lambda: case.probs(top_k=case.top_k + 1)
        wrong["top-k one fewer"] = lambda: case.probs(top_k=case.top_k - 1)
    if case.top_p < 1.0:
        n = _kept(right)
        # keeping one token more or fewer than the nucleus
        base = case.probs(top_p=1.0)
        order = sorted(range(len(base)), key=lambda i: -base[i])

        def nucleus(size: int) -> list[float]:
            keep = set(order[:size])
            total = math.fsum(base[i] for i in keep)
            return [base[i] / total if i in keep else 0.0 for i in range(len(base))]

        wrong["top-p one more"] = lambda: nucleus(n + 1)
        wrong["top-p one fewer"] = lambda: nucleus(n - 1)
    if case.min_p:
        wrong["min-p ignored"] = lambda: case.probs(min_p=0.0)
    out = {}
    for name, make in wrong.items():
        probs = make()
        if max(abs(a - b) for a, b in zip(probs, right, strict=True)) > 1e-9:
            out[name] = probs
    return out


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_sampled_frequencies_follow_the_filtered_softmax(case: Case) -> None:
    counts = _draw(case)
    fit = goodness_of_fit(counts, case.probs())
    assert not fit.impossible, f"drew filtered-out tokens {fit.impossible}: {counts}"
    assert fit.p_value > ALPHA, (
        f"chi-square {fit.statistic:.1f} on {fit.df} df (p = {fit.p_value:.2e}): "
        f"counts {counts}, expected {[round(N * p) for p in case.probs()]}"
    )
    wrong = _wrong_samplers(case)
    assert wrong, "no mistaken sampler to tell apart"
    for name, probs in wrong.items():
        rejected = goodness_of_fit(counts, probs)
        assert rejected.p_value < ALPHA, f"the counts do not rule out: {name} ({rejected})"


def test_the_reference_filters_as_documented() -> None:
    # top-k 2 of (2.0, 1.5, ...) at T = 1: softmax over the two largest only
    probs = reference(LOGITS, 1.0, 2, 1.0, 0.0)
    e = math.exp(-0.5)
    assert probs[2] == pytest.approx(1 / (1 + e)) and probs[5] == pytest.approx(e / (1 + e))
    assert _kept(probs) == 2
    # top-p: the first token alone has mass 1 / (1 + e) ~ 0.62 < 0.7, so a second is kept
    assert _kept(reference(LOGITS, 1.0, 2, 0.7, 0.0)) == 2
    assert _kept(reference(LOGITS, 1.0, 2, 0.6, 0.0)) == 1

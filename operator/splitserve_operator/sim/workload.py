"""Workloads: what arrives when, with how many prompt and output tokens.

A :class:`Workload` is a frozen table (arrival seconds, prompt tokens, output
tokens, optional prefix-block hashes). The simulator draws fresh
:class:`Request` objects from it for every run, so one workload is replayed at
many rates by :meth:`Workload.at_rate` (arrival times scaled, order kept) when
goodput is searched.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np


class WorkloadError(ValueError):
    """A workload or length distribution that cannot be built; says why."""


class Request:
    """One request moving through the simulator (its state is written in place)."""

    __slots__ = (
        "arrival",
        "cached",
        "done_tokens",
        "hash_ids",
        "output",
        "prompt",
        "rid",
        "t_first",
        "t_last",
        "t_prefill_end",
    )

    def __init__(
        self,
        rid: int,
        arrival: float,
        prompt: int,
        output: int,
        hash_ids: tuple[int, ...] | None = None,
    ) -> None:
        self.rid = rid
        self.arrival = arrival
        self.prompt = prompt
        self.output = output
        self.hash_ids = hash_ids
        self.cached = 0
        """Prompt tokens found in a prefix cache (not computed)."""
        self.done_tokens = 0
        """Prompt tokens prefilled so far (chunked prefill)."""
        self.t_prefill_end = -1.0
        self.t_first = -1.0
        """When the first token reached the client (-1: not yet)."""
        self.t_last = -1.0
        """When the last token reached the client (-1: not yet)."""

    @property
    def ttft(self) -> float:
        return self.t_first - self.arrival

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first (0 for one-token outputs)."""
        return (self.t_last - self.t_first) / (self.output - 1) if self.output > 1 else 0.0

    def __repr__(self) -> str:
        return f"Request({self.rid}, t={self.arrival:.3f}, prompt={self.prompt}, out={self.output})"


# ---- length distributions ----


@dataclass(frozen=True)
class Fixed:
    n: int

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        return np.full(size, self.n, dtype=np.int64)

    @property
    def mean(self) -> float:
        return float(self.n)


@dataclass(frozen=True)
class Uniform:
    lo: int
    hi: int

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        return rng.integers(self.lo, self.hi + 1, size=size)

    @property
    def mean(self) -> float:
        return (self.lo + self.hi) / 2


@dataclass(frozen=True)
class LogNormal:
    """Lengths with the given mean and a log-space spread ``sigma``, clipped to [lo, hi]."""

    mean_n: float
    sigma: float = 0.6
    lo: int = 1
    hi: int = 131072

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        mu = np.log(self.mean_n) - self.sigma**2 / 2
        x = rng.lognormal(mu, self.sigma, size=size)
        return np.clip(np.rint(x), self.lo, self.hi).astype(np.int64)

    @property
    def mean(self) -> float:
        return self.mean_n


LengthDist = Fixed | Uniform | LogNormal


def parse_length(text: str | int) -> LengthDist:
    """``"512"``, ``"uniform:100:900"`` or ``"lognormal:2000:0.6"``."""
    s = str(text).strip().lower()
    try:
        if s.isdigit():
            return Fixed(int(s))
        kind, *args = s.split(":")
        if kind == "uniform" and len(args) == 2:
            return Uniform(int(args[0]), int(args[1]))
        if kind == "lognormal" and len(args) in (1, 2):
            sigma = float(args[1]) if len(args) == 2 else LogNormal.sigma
            return LogNormal(float(args[0]), sigma)
    except ValueError:
        pass
    raise WorkloadError(f"length {text!r}: use N, uniform:LO:HI or lognormal:MEAN[:SIGMA]")


# ---- workloads ----


@dataclass(frozen=True)
class Workload:
    """Requests in arrival order. Arrays are read-only; never mutate them."""

    arrival: np.ndarray
    prompt: np.ndarray
    output: np.ndarray
    hash_ids: Sequence[tuple[int, ...]] | None = None
    name: str = "workload"
    block_tokens: int = 512
    """Tokens per prefix block that one hash in ``hash_ids`` stands for."""
    _check: bool = field(default=True, repr=False)

    def __post_init__(self) -> None:
        if not self._check:
            return
        n = len(self.arrival)
        if len(self.prompt) != n or len(self.output) != n:
            raise WorkloadError("arrival, prompt and output must have the same length")
        if self.hash_ids is not None and len(self.hash_ids) != n:
            raise WorkloadError("hash_ids must have one entry per request")
        if n and (np.any(np.diff(self.arrival) < 0)):
            raise WorkloadError("arrivals must be sorted")
        if n and (self.prompt.min() < 1 or self.output.min() < 1):
            raise WorkloadError("prompt and output lengths must be >= 1")

    def __len__(self) -> int:
        return len(self.arrival)

    @property
    def duration(self) -> float:
        return float(self.arrival[-1] - self.arrival[0]) if len(self) > 1 else 0.0

    @property
    def rate(self) -> float:
        """Mean arrival rate, requests/s."""
        return (len(self) - 1) / self.duration if self.duration > 0 else float("inf")

    @property
    def mean_prompt(self) -> float:
        return float(self.prompt.mean())

    @property
    def mean_output(self) -> float:
        return float(self.output.mean())

    def at_rate(self, rate: float) -> Workload:
        """The same requests with arrival times scaled to a mean rate of ``rate``."""
        if rate <= 0:
            raise WorkloadError("rate must be positive")
        t0 = self.arrival[0] if len(self) else 0.0
        scale = self.rate / rate if np.isfinite(self.rate) else 1.0
        return Workload(
            (self.arrival - t0) * scale,
            self.prompt,
            self.output,
            self.hash_ids,
            self.name,
            self.block_tokens,
            _check=False,
        )

    def tiled(self, copies: int) -> Workload:
        """``copies`` back-to-back replays (each starting one mean gap after the
        previous ends); prefix ids are renamed per copy, so copies share no cache."""
        if copies <= 1 or len(self) == 0:
            return self
        gap = self.duration / max(1, len(self) - 1)
        span = self.duration + gap
        t = self.arrival - self.arrival[0]
        arrival = np.concatenate([t + i * span for i in range(copies)])
        hashes = None
        if self.hash_ids is not None:
            top = 1 + max((max(h) for h in self.hash_ids if h), default=0)
            hashes = [tuple(x + i * top for x in h) for i in range(copies) for h in self.hash_ids]
        return Workload(
            arrival,
            np.tile(self.prompt, copies),
            np.tile(self.output, copies),
            hashes,
            self.name,
            self.block_tokens,
            _check=False,
        )

    def head(self, n: int) -> Workload:
        h = None if self.hash_ids is None else self.hash_ids[:n]
        return Workload(
            self.arrival[:n], self.prompt[:n], self.output[:n], h, self.name, self.block_tokens
        )

    def requests(self) -> Iterator[Request]:
        """Fresh request objects, in arrival order."""
        arr, pr, out = self.arrival.tolist(), self.prompt.tolist(), self.output.tolist()
        hs = self.hash_ids
        for i in range(len(arr)):
            yield Request(i, arr[i], pr[i], out[i], None if hs is None else hs[i])


def poisson(
    rate: float,
    n: int,
    prompt: LengthDist | int,
    output: LengthDist | int,
    *,
    seed: int = 0,
    name: str | None = None,
) -> Workload:
    """``n`` requests with exponential inter-arrival times at ``rate`` requests/s."""
    if rate <= 0 or n <= 0:
        raise WorkloadError("rate and n must be positive")
    pd = Fixed(prompt) if isinstance(prompt, int) else prompt
    od = Fixed(output) if isinstance(output, int) else output
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, size=n)
    gaps[0] = 0.0
    return Workload(
        np.cumsum(gaps),
        pd.sample(rng, n),
        od.sample(rng, n),
        None,
        name or f"poisson({rate:g}/s, prompt {pd}, output {od})",
    )

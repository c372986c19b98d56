"""Choosing a worker: small Filters, Scorers (each in [0, 1]) and a Picker.

A :class:`Profile` runs its filters, sums the weighted scores and lets its
picker choose. Everything here is pure: a worker is described by a
:class:`WorkerView` snapshot and a request by a :class:`RouteRequest`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from splitserve.roles import DECODE_ROLES, PREFILL_ROLES, Role


@dataclass(frozen=True)
class WorkerView:
    """What the router knows about one worker at the moment of a decision."""

    name: str
    role: Role
    healthy: bool = True
    free_blocks: int = 0
    total_blocks: int = 0
    running: int = 0
    waiting: int = 0
    tokens_in_flight: int = 0
    assigned: int = 0
    """Requests the router has sent to this worker that are not finished yet."""
    max_running: int = 64
    """Sequences the worker runs at once (its engine's max_num_seqs)."""
    switching: bool = False
    """It is switching its role (it takes no requests until that is over)."""
    switches: int = 0
    """Role switches it has completed (its Health's ``switches``)."""
    instance: str = ""
    """The worker process's own id (its Health's ``instance_id``; "" until it answers):
    a worker restarted at the same address has a new one."""

    @property
    def identity(self) -> str:
        """Which worker this is: its name and its instance (a restarted one is another)."""
        return f"{self.name}#{self.instance}" if self.instance else self.name


@dataclass(frozen=True)
class RouteRequest:
    """The parts of a request that routing looks at."""

    num_prompt_tokens: int
    block_hashes: Sequence[int] = ()
    block_size: int = 16
    exclude: frozenset[str] = frozenset()
    """Workers that already failed this request, by :attr:`WorkerView.identity`."""
    cached_blocks: Mapping[str, int] = field(default_factory=dict)
    """Leading prompt blocks each worker holds (from the prefix index)."""

    @property
    def blocks_needed(self) -> int:
        return -(-self.num_prompt_tokens // self.block_size) + 1


class Filter(Protocol):
    def __call__(self, req: RouteRequest, workers: Sequence[WorkerView]) -> list[WorkerView]: ...


class Scorer(Protocol):
    """Returns a score in [0, 1] per worker; higher is better."""

    @property
    def name(self) -> str: ...

    def __call__(self, req: RouteRequest, workers: Sequence[WorkerView]) -> list[float]: ...


Picker = Callable[[Sequence[WorkerView], Sequence[float]], WorkerView]


# ---- filters ----


def healthy(req: RouteRequest, workers: Sequence[WorkerView]) -> list[WorkerView]:
    ex = req.exclude
    if ex:
        return [w for w in workers if w.healthy and w.identity not in ex]
    return [w for w in workers if w.healthy]


def can_prefill(req: RouteRequest, workers: Sequence[WorkerView]) -> list[WorkerView]:
    return [w for w in workers if w.role in PREFILL_ROLES]


def can_decode(req: RouteRequest, workers: Sequence[WorkerView]) -> list[WorkerView]:
    return [w for w in workers if w.role in DECODE_ROLES]


def has_room(req: RouteRequest, workers: Sequence[WorkerView]) -> list[WorkerView]:
    """Workers whose free KV blocks can hold the prompt (unknown pools pass)."""
    need = req.blocks_needed
    return [w for w in workers if w.total_blocks <= 0 or w.free_blocks >= need]


# ---- scorers ----


@dataclass(frozen=True)
class PrefixScorer:
    """Fraction of the prompt's blocks the worker already holds."""

    name: str = "prefix"

    def __call__(self, req: RouteRequest, workers: Sequence[WorkerView]) -> list[float]:
        total = len(req.block_hashes)
        if total == 0 or not req.cached_blocks:
            return [0.0] * len(workers)
        get = req.cached_blocks.get
        inv = 1.0 / total  # a worker never holds more leading blocks than the prompt has
        return [get(w.name, 0) * inv for w in workers]


@dataclass(frozen=True)
class LoadScorer:
    """Less queued work is better: ``1 / (1 + tokens_ahead / scale)``.

    ``tokens_ahead`` counts tokens in flight on the worker plus a prompt's worth
    per request queued there (by the worker or by the router).
    """

    token_scale: float = 2048.0
    name: str = "load"

    def __call__(self, req: RouteRequest, workers: Sequence[WorkerView]) -> list[float]:
        per_req = max(1, req.num_prompt_tokens)
        out = []
        for w in workers:
            ahead = w.tokens_in_flight + (w.waiting + w.assigned) * per_req
            out.append(1.0 / (1.0 + ahead / self.token_scale))
        return out


@dataclass(frozen=True)
class KVFreeScorer:
    """Free KV blocks as a fraction of the pool."""

    name: str = "kv_free"

    def __call__(self, req: RouteRequest, workers: Sequence[WorkerView]) -> list[float]:
        return [(w.free_blocks / w.total_blocks) if w.total_blocks > 0 else 0.5 for w in workers]


@dataclass(frozen=True)
class RunningScorer:
    """Fewer running (and router-assigned) sequences is better."""

    name: str = "running"

    def __call__(self, req: RouteRequest, workers: Sequence[WorkerView]) -> list[float]:
        out = []
        for w in workers:
            busy = (w.running if w.running > w.assigned else w.assigned) + w.waiting
            free = 1.0 - busy / (w.max_running or 1)
            out.append(free if free > 0.0 else 0.0)
        return out


# ---- picker ----


def pick_max(workers: Sequence[WorkerView], scores: Sequence[float]) -> WorkerView:
    """Highest score; ties go to the worker with fewer assigned requests, then by name."""
    best_i = 0
    for i in range(1, len(workers)):
        a, b = workers[i], workers[best_i]
        if scores[i] > scores[best_i] or (
            scores[i] == scores[best_i] and (a.assigned, a.name) < (b.assigned, b.name)
        ):
            best_i = i
    return workers[best_i]


# ---- profile ----


@dataclass(frozen=True)
class Choice:
    worker: WorkerView
    score: float
    scores: dict[str, float]
    """Weighted score of each scorer for the chosen worker."""


@dataclass(frozen=True)
class Profile:
    filters: tuple[Filter, ...]
    scorers: tuple[tuple[Scorer, float], ...]
    picker: Picker = pick_max

    def choose(self, req: RouteRequest, workers: Sequence[WorkerView]) -> Choice | None:
        """The best worker, or None when every worker was filtered out."""
        left: Sequence[WorkerView] = workers
        for f in self.filters:
            left = f(req, left)
            if not left:
                return None
        parts = [scorer(req, left) for scorer, _ in self.scorers]
        w0 = self.scorers[0][1]
        totals = [w0 * x for x in parts[0]]
        for k in range(1, len(parts)):
            wk = self.scorers[k][1]
            totals = [t + wk * x for t, x in zip(totals, parts[k], strict=True)]
        chosen = self.picker(left, totals)
        i = next(i for i, w in enumerate(left) if w is chosen)
        return Choice(
            worker=chosen,
            score=totals[i],
            scores={sc.name: weight * parts[k][i] for k, (sc, weight) in enumerate(self.scorers)},
        )


def prefill_profile(prefix: float, load: float) -> Profile:
    return Profile(
        filters=(healthy, can_prefill),
        scorers=((PrefixScorer(), prefix), (LoadScorer(), load)),
    )


def decode_profile(kv_free: float, running: float, prefix: float) -> Profile:
    return Profile(
        filters=(healthy, can_decode, has_room),
        scorers=((KVFreeScorer(), kv_free), (RunningScorer(), running), (PrefixScorer(), prefix)),
    )

"""The correctness guard: proof, in production, that disaggregated requests decode right.

A sampled share of the greedy requests that ran disaggregated (prefilled on a prefill
worker, their KV pushed to the decode worker) is run again on the same decode worker
with local prefill, the whole prompt computed there (no cached prefix block read, so the
answer owes nothing to pushed KV), and the two token sequences are compared token by
token. Greedy decoding is deterministic, so any difference means the KV that moved was
not the KV the decode worker would have computed: a corrupt transfer, a layout or
compatibility bug. A mismatch is counted (``splitserve_guard_checks_total`` with
``outcome="mismatch"``) and logged with the request id.

The re-run is off the request's path: it starts after the request's last token was
handed on, runs as a task of its own, and nothing it does (a failure, a slow worker)
reaches the request. At most ``guard.max_concurrent`` re-runs are in flight; a request
sampled while they are all busy is left unchecked (``outcome="skipped"``) and the next
eligible one is taken instead.

:class:`Sampler` is the pure choice of which requests to check: ``sample_share`` of them
(deterministically: every ``1 / share``-th), and at least one every ``min_interval_s``
while such requests arrive (the first one after start included).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

import grpc
from splitserve.metric_names import GUARD_CHECKS
from splitserve.metric_registry import Metrics
from splitserve.sampling import SamplingParams

from splitserve_worker.router.config import GuardConfig
from splitserve_worker.router.worker_conn import WorkerConn

log = logging.getLogger(__name__)


class Outcome(StrEnum):
    """The ``outcome`` label of ``splitserve_guard_checks_total``."""

    MATCH = "match"
    """The local re-run decoded the same tokens."""
    MISMATCH = "mismatch"
    """It decoded other tokens: the disaggregated answer was wrong."""
    FAILED = "failed"
    """The re-run could not finish (the worker was busy, gone, or refused it): no verdict."""
    SKIPPED = "skipped"
    """Sampled while every re-run slot was busy: not checked."""


class Sampler:
    """Which eligible requests to check: ``share`` of them, and at least one every
    ``min_interval_s`` (seconds, on the clock the caller passes) while they arrive."""

    def __init__(self, share: float, min_interval_s: float) -> None:
        self.share = share
        self.min_interval_s = min_interval_s
        self._credit = 0.0
        self._last = -math.inf
        self._owed = False

    def take(self, now: float) -> bool:
        """Whether the eligible request arriving at ``now`` is checked."""
        self._credit += self.share
        due = self._credit >= 1.0 or self._owed or now - self._last >= self.min_interval_s
        if due:  # a check the floor forced counts against the share: never more than it
            self._credit = max(0.0, self._credit - 1.0)
            self._last = now
            self._owed = False
        return due

    def missed(self) -> None:
        """The request :meth:`take` chose could not be checked: take the next one."""
        self._owed = True


@dataclass(frozen=True)
class Check:
    """One disaggregated request to verify."""

    request_id: str
    prompt: tuple[int, ...]
    sampling: SamplingParams
    tokens: tuple[int, ...]
    """What the request decoded on pushed KV."""
    decode_worker: str
    """The worker that decoded it, by name in the pool."""


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where ``a`` and ``b`` differ (a shorter one ends there), or
    None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def rerun_sampling(sampling: SamplingParams) -> SamplingParams:
    """The request's own parameters, without what only its client reads (logprobs)."""
    return replace(sampling, logprobs=False, top_logprobs=0, prompt_logprobs=None)


def eligible(sampling: SamplingParams) -> bool:
    """Only greedy requests decode one answer; a sampled one may rightly differ."""
    return sampling.greedy and sampling.resumed_tokens == 0


class CorrectnessGuard:
    """Re-runs sampled disaggregated requests locally and compares (see the module)."""

    def __init__(
        self,
        config: GuardConfig,
        conn_of: Callable[[str], WorkerConn],
        metrics: Metrics,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._conn_of = conn_of
        self._checks = metrics.counter(GUARD_CHECKS)
        for outcome in Outcome:  # every series from the start: a first mismatch is an increase
            self._checks.labels(outcome=outcome.value)
        self._timeout_s = timeout_s
        self._clock = clock
        self._sampler = Sampler(config.sample_share, config.min_interval_s)
        self._tasks: set[asyncio.Task[Outcome]] = set()

    def offer(self, check: Check) -> asyncio.Task[Outcome] | None:
        """Consider a finished disaggregated request; returns the re-run's task when it is
        checked. Never raises for the request and never waits."""
        if not self.config.enabled or not eligible(check.sampling) or not check.tokens:
            return None
        if not self._sampler.take(self._clock()):
            return None
        if len(self._tasks) >= self.config.max_concurrent:
            self._sampler.missed()
            self._checks.labels(outcome=Outcome.SKIPPED.value).inc()
            return None
        task = asyncio.create_task(self._run(check), name=f"guard-{check.request_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def drain(self, timeout: float) -> None:
        """Waits for the re-runs in flight (shutdown and tests), cancelling what is left."""
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=timeout)
            for t in pending:
                t.cancel()

    async def _run(self, check: Check) -> Outcome:
        rid = f"{check.request_id}.guard"
        try:
            conn = self._conn_of(check.decode_worker)
        except KeyError:
            return self._count(Outcome.FAILED, check, "its decode worker left the pool")
        tokens: list[int] = []
        finished = False
        sampling = rerun_sampling(check.sampling)
        try:
            async with asyncio.timeout(self._timeout_s):
                stream = conn.generate(rid, check.prompt, sampling, False, self._timeout_s,
                                       recompute_prompt=True)  # fmt: skip
                async for chunk in stream:
                    tokens.extend(chunk.token_ids)
                    if chunk.finish_reason:
                        finished = chunk.finish_reason in ("stop", "length")
                        break
        except (grpc.RpcError, TimeoutError, OSError) as e:
            return self._count(Outcome.FAILED, check, f"the re-run failed: {e}")
        finally:
            if not finished:
                with contextlib.suppress(grpc.RpcError, TimeoutError, OSError):
                    await conn.cancel(rid, timeout=self._timeout_s)
        if not finished:
            return self._count(Outcome.FAILED, check, "the re-run ended without finishing")
        at = first_difference(check.tokens, tokens)
        if at is None:
            return self._count(Outcome.MATCH, check, "")
        log.error(
            "correctness guard: request %s decoded on KV pushed to %s differs from the same "
            "request prefilled there, from token %d of %d (disaggregated %s, local %s): the "
            "KV that moved was not the KV that worker computes; check the KV transport "
            "(turn on checksums) and the workers' compatibility",
            check.request_id,
            check.decode_worker,
            at,
            len(check.tokens),
            list(check.tokens[at : at + 4]),
            tokens[at : at + 4],
        )
        return self._count(Outcome.MISMATCH, check, "")

    def _count(self, outcome: Outcome, check: Check, why: str) -> Outcome:
        self._checks.labels(outcome=outcome.value).inc()
        if why:
            log.warning("correctness guard: request %s not checked: %s", check.request_id, why)
        return outcome

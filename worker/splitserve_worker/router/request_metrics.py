"""The router's request metrics: prompt and generated tokens, time to first token, time
per output token, end-to-end latency and how each choice ended."""

from __future__ import annotations

from enum import StrEnum

from splitserve.metric_names import E2E, GENERATION_TOKENS, PROMPT_TOKENS, REQUESTS, TPOT, TTFT
from splitserve.metric_registry import Metrics

from splitserve_worker.router.responses import Job


class Outcome(StrEnum):
    """How one choice ended (the ``outcome`` label of the requests counter)."""

    SUCCESS = "success"
    REJECTED = "rejected"
    """A queue refused it (429 / 503)."""
    ERROR = "error"
    """The workers could not serve it."""
    CANCELLED = "cancelled"
    """The client went away first (or another choice of the request failed)."""


class RequestMetrics:
    """Records one choice at a time, as its events come; times are ``time.monotonic``
    readings, as ``Job.arrived`` is."""

    def __init__(self, metrics: Metrics) -> None:
        self._ttft = metrics.histogram(TTFT)
        self._tpot = metrics.histogram(TPOT)
        self._e2e = metrics.histogram(E2E)
        self._outcomes = metrics.counter(REQUESTS)
        self._prompt_tokens = metrics.counter(PROMPT_TOKENS)
        self._generated = metrics.counter(GENERATION_TOKENS)

    def started(self, job: Job) -> None:
        self._prompt_tokens.inc(len(job.prompt))

    def first_token(self, job: Job, now: float) -> None:
        self._ttft.observe(now - job.arrived)

    def generated(self, tokens: int) -> None:
        self._generated.inc(tokens)

    def finished(self, job: Job, now: float) -> None:
        """The choice's last token came at ``now``."""
        self._e2e.observe(now - job.arrived)
        if job.first_at is not None and len(job.tokens) > 1:
            self._tpot.observe((now - job.first_at) / (len(job.tokens) - 1))

    def ended(self, outcome: Outcome) -> None:
        self._outcomes.labels(outcome=outcome.value).inc()

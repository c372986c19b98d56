"""How long to wait before trying again after a transient API failure (no answer, 409,
429, 5xx): exponential in the attempt, with jitter so that many retries spread out, and
never less than what the server asked for (``Retry-After``). Pure: the caller passes the
attempt number and, in tests, the random source."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    base_s: float = 1.0
    """Seconds (s) before the first retry, before jitter."""
    cap_s: float = 300.0
    """Seconds (s) the wait never exceeds (the resync catches anything later anyway)."""

    def delay(
        self,
        attempt: int,
        *,
        retry_after: float | None = None,
        rng: Callable[[], float] = random.random,
    ) -> float:
        """Seconds to wait before retry number ``attempt`` (0 for the first): uniform in
        ``[d/2, d]`` for ``d = min(cap, base * 2**attempt)``, and at least ``retry_after``
        (itself capped)."""
        ceiling = min(self.cap_s, self.base_s * 2.0 ** max(0, min(attempt, 32)))
        wait = ceiling * (0.5 + 0.5 * rng())
        if retry_after is not None:
            wait = max(wait, min(retry_after, self.cap_s))
        return wait

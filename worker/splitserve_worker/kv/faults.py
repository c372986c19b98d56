"""Failure injection for the KV transports: off unless configured.

Reliability tests turn it on to make a share of layer pushes fail outright or arrive
corrupted (one byte flipped after the checksum was taken), and check that every path
still frees its blocks and the client sees a clear outcome.
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Mapping
from dataclasses import dataclass

ENV_FAIL = "SPLITSERVE_FAULT_KV_FAIL_PROB"
ENV_CORRUPT = "SPLITSERVE_FAULT_KV_CORRUPT_PROB"
ENV_SEED = "SPLITSERVE_FAULT_SEED"


class InjectedFault(Exception):
    """A transfer failure made on purpose by the failure-injection knob."""


@dataclass(frozen=True)
class FaultConfig:
    fail_prob: float = 0.0
    """Probability that pushing one layer fails."""
    corrupt_prob: float = 0.0
    """Probability that one layer arrives with a flipped byte (checksums catch it)."""
    seed: int | None = None

    def __post_init__(self) -> None:
        for name in ("fail_prob", "corrupt_prob"):
            p = getattr(self, name)
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"{name} must be within [0, 1], got {p}")

    @property
    def enabled(self) -> bool:
        return self.fail_prob > 0 or self.corrupt_prob > 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> FaultConfig:
        env = os.environ if env is None else env

        def prob(key: str) -> float:
            raw = env.get(key, "").strip()
            try:
                return float(raw) if raw else 0.0
            except ValueError:
                raise ValueError(f"{key} must be a number in [0, 1], got {raw!r}") from None

        seed_raw = env.get(ENV_SEED, "").strip()
        return cls(prob(ENV_FAIL), prob(ENV_CORRUPT), int(seed_raw) if seed_raw else None)


_SEEDED: dict[int, random.Random] = {}
_SEEDED_LOCK = threading.Lock()


def _rng_for(seed: int | None) -> random.Random:
    """One stream per seed for the whole process: each transfer opens its own injector, and
    a fresh ``Random(seed)`` per transfer would repeat the same faults on every request."""
    if seed is None:
        return random.Random()
    with _SEEDED_LOCK:
        return _SEEDED.setdefault(seed, random.Random(seed))


class FaultInjector:
    def __init__(self, config: FaultConfig) -> None:
        self.config = config
        self._rng = _rng_for(config.seed)

    def maybe_fail(self, what: str) -> None:
        if self.config.fail_prob and self._rng.random() < self.config.fail_prob:
            raise InjectedFault(f"injected KV transfer failure ({what})")

    def should_corrupt(self) -> bool:
        return bool(self.config.corrupt_prob) and self._rng.random() < self.config.corrupt_prob

    def corrupt(self, data: bytes) -> bytes:
        """A copy of ``data`` with one byte flipped."""
        if not data:
            return data
        buf = bytearray(data)
        i = self._rng.randrange(len(buf))
        buf[i] ^= 0xFF
        return bytes(buf)

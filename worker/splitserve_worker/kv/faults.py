"""Failure injection for the handoff: off unless configured.

Reliability tests turn it on to make a share of layer pushes fail outright or arrive
corrupted (one byte flipped after the checksum was taken), and check that every path
still frees its blocks and the client sees a clear outcome.

They also hold a worker at a named point (:class:`Holds`) to kill it exactly there: a
handoff on a small model lasts milliseconds, too short to catch by watching Health.
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

ENV_FAIL = "SPLITSERVE_FAULT_KV_FAIL_PROB"
ENV_CORRUPT = "SPLITSERVE_FAULT_KV_CORRUPT_PROB"
ENV_SEED = "SPLITSERVE_FAULT_SEED"
ENV_HOLD_DIR = "SPLITSERVE_FAULT_HOLD_DIR"

HOLD_POINTS = ("push", "receive", "stream")
"""``push``: a prefill worker, once the first layer of a prompt went to the transport.
``receive``: a decode worker, once the first part of a KV push was written.
``stream``: a decode worker, once a Generate stream sent its first tokens."""
HOLD_MAX_S = 120.0
"""A hold ends by itself after this long, so a forgotten file cannot wedge a worker."""
HOLD_POLL_S = 0.01


class InjectedFault(Exception):
    """A transfer failure made on purpose by the failure-injection knob."""


@dataclass(frozen=True)
class FaultConfig:
    fail_prob: float = 0.0
    """Probability that pushing one layer fails."""
    corrupt_prob: float = 0.0
    """Probability that one layer arrives with a flipped byte (checksums catch it)."""
    seed: int | None = None
    hold_dir: str | None = None
    """Where hold points are armed (see :class:`Holds`); ``None``: never held."""

    def __post_init__(self) -> None:
        for name in ("fail_prob", "corrupt_prob"):
            p = getattr(self, name)
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"{name} must be within [0, 1], got {p}")

    @property
    def enabled(self) -> bool:
        return self.fail_prob > 0 or self.corrupt_prob > 0

    @property
    def holds(self) -> Holds:
        return Holds(self.hold_dir)

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
        try:
            seed = int(seed_raw) if seed_raw else None
        except ValueError:
            raise ValueError(f"{ENV_SEED} must be an integer, got {seed_raw!r}") from None
        hold_dir = env.get(ENV_HOLD_DIR, "").strip() or None
        return cls(prob(ENV_FAIL), prob(ENV_CORRUPT), seed, hold_dir)


def hold_files(directory: str, pid: int, point: str) -> tuple[str, str]:
    """The file that arms ``point`` in process ``pid``, and the one it writes on arrival."""
    armed = os.path.join(directory, str(pid), point)
    return armed, armed + ".reached"


@dataclass(frozen=True)
class Holds:
    """Named points where a worker waits on request, so a test can kill it right there.

    With ``directory`` set, a worker reaching point ``P`` while the file
    ``<directory>/<pid>/P`` exists (``pid``: the worker's process id, so workers can share
    one directory) writes ``<directory>/<pid>/P.reached`` and waits until the file is gone,
    at most :data:`HOLD_MAX_S`. Without a directory every call returns at once."""

    directory: str | None = None

    def _armed(self, point: str) -> str | None:
        """The path to mark as reached when ``point`` is armed now, else ``None``."""
        if self.directory is None:
            return None
        if point not in HOLD_POINTS:
            raise ValueError(f"unknown hold point {point!r}; known: {HOLD_POINTS}")
        armed, reached = hold_files(self.directory, os.getpid(), point)
        if not os.path.exists(armed):
            return None
        with open(reached, "a"):
            pass
        return armed

    def wait(self, point: str) -> bool:
        """Blocks while ``point`` is armed; returns whether it held."""
        base = self._armed(point)
        if base is None:
            return False
        deadline = time.monotonic() + HOLD_MAX_S
        while os.path.exists(base) and time.monotonic() < deadline:
            time.sleep(HOLD_POLL_S)
        return True

    async def wait_async(self, point: str) -> bool:
        """:meth:`wait` for the event loop."""
        base = self._armed(point)
        if base is None:
            return False
        deadline = time.monotonic() + HOLD_MAX_S
        while os.path.exists(base) and time.monotonic() < deadline:
            await asyncio.sleep(HOLD_POLL_S)
        return True


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
        """A copy of ``data`` with one byte flipped: the top byte of a 4-byte word (on a
        little-endian host, the sign and exponent of a float32 element, or of the second
        of two 16-bit ones), so the element is wrong by far, as a real fault that matters
        would leave it, not in a low mantissa bit that decoding never notices."""
        if not data:
            return data
        buf = bytearray(data)
        words = len(buf) // 4
        i = self._rng.randrange(words) * 4 + 3 if words else self._rng.randrange(len(buf))
        buf[i] ^= 0xFF
        return bytes(buf)

"""What a simulation reports: per-window observations and whole-run results."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from splitserve_operator.sim.config import Slo


@dataclass(frozen=True)
class Percentiles:
    p50: float
    p90: float
    p99: float
    mean: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float] | np.ndarray) -> Percentiles | None:
        if len(values) == 0:
            return None
        a = np.asarray(values, dtype=float)
        p50, p90, p99 = np.percentile(a, [50, 90, 99])
        return cls(float(p50), float(p90), float(p99), float(a.mean()), len(a))


@dataclass(frozen=True)
class PoolObservation:
    """One pool at the end of a window."""

    active: int
    starting: int
    draining: int
    queue: int
    """Requests waiting in this pool (router queue included): for prefill and
    colocated pools, not yet started; for decode, KV landed but not yet batched."""
    queue_tokens: int
    running: int
    """Sequences decoding (decode and colocated pools) or being prefilled (prefill pool)."""
    kv_utilization: float
    """KV tokens in use / KV capacity, over the active and draining instances."""
    busy_fraction: float
    """Computing time / (instances x window), over the window."""


@dataclass(frozen=True)
class Window:
    """What the simulator saw between ``t_start`` and ``t_end`` (seconds of simulated time)."""

    t_start: float
    t_end: float
    arrivals: int
    request_rate: float
    input_token_rate: float
    """Prompt tokens arriving per second."""
    output_token_rate: float
    """Tokens generated per second (first tokens and decode steps)."""
    prefill_token_rate: float
    """Prompt tokens computed per second (prefix-cache hits excluded)."""
    first_tokens: int
    completed: int
    ttft: Percentiles | None
    """Of requests whose first token came in this window."""
    tpot: Percentiles | None
    """Of requests completed in this window."""
    slo_attainment: float | None
    """Fraction of requests completed in this window that met both targets (None
    without an SLO or without completions)."""
    pools: dict[str, PoolObservation]
    transfers_in_flight: int
    gpus: int
    """GPUs held at ``t_end`` (starting and draining instances included)."""
    gpu_seconds: float
    """GPU-seconds held during the window."""

    @property
    def duration(self) -> float:
        return self.t_end - self.t_start

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SimResult:
    """A finished run. Latency arrays cover the finished requests, in arrival order."""

    label: str
    n_requests: int
    arrival: np.ndarray
    prompt: np.ndarray
    output: np.ndarray
    ttft: np.ndarray
    tpot: np.ndarray
    finish: np.ndarray
    duration_s: float
    gpu_seconds: float
    gpus: int
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def n_finished(self) -> int:
        return len(self.ttft)

    def attainment(self, slo: Slo) -> float:
        """Fraction of all requests (unfinished ones count as misses) meeting both targets."""
        if self.n_requests == 0:
            return 1.0
        ok = np.count_nonzero((self.ttft <= slo.ttft_s) & (self.tpot <= slo.tpot_s))
        return ok / self.n_requests

    def summary(self, slo: Slo | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "label": self.label,
            "requests": self.n_requests,
            "finished": self.n_finished,
            "duration_s": self.duration_s,
            "gpus": self.gpus,
            "gpu_seconds": self.gpu_seconds,
            "ttft_s": asdict(p) if (p := Percentiles.of(self.ttft)) else None,
            "tpot_s": asdict(p) if (p := Percentiles.of(self.tpot)) else None,
            **self.extra,
        }
        if slo is not None:
            out["slo_attainment"] = self.attainment(slo)
        return out

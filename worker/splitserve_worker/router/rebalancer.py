"""The local rebalancer (``splitserve up --flex``): switchable workers change role as the
router's own metrics ask, decided by the same policy as the operator's planner.

Each tick reads what the router measured since the last one (the TTFT and TPOT
percentiles of that window, the prefill and decode queues) and what its pool knows of
the workers (roles, switches under way, KV use), hands them to
:func:`splitserve.role_balance.decide`, and when it says so, marks one worker of the
donor role as switching in the pool (nothing more is routed to it from that moment)
and asks it to switch. Locally no pod can be added, so a switch is weighed against
nothing but its own cost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from prometheus_client import CollectorRegistry
from splitserve.metric_names import DECODE_QUEUE, PREFILL_QUEUE, TPOT, TTFT, MetricSpec
from splitserve.role_balance import (
    BalanceConfig,
    BalanceDecision,
    BalanceMemory,
    Costs,
    SideLoad,
    Split,
    decide,
)
from splitserve.roles import Role

from splitserve_worker.router.scoring import WorkerView

log = logging.getLogger(__name__)

Switch = Callable[[str, Role], Awaitable[Any]]
"""Asks the worker of that name to serve that role (returns once it does)."""


@dataclass(frozen=True)
class FlexSettings:
    ttft_slo_s: float = 1.0
    """The TTFT objective the prefill side is held to (s)."""
    tpot_slo_s: float = 0.05
    """The TPOT objective the decode side is held to (s)."""
    percentile: float = 0.9
    kv_high: float = 0.9
    """Decode KV use above which decode is under pressure (0 to 1)."""
    drain_s: float = 2.0
    """How long a switching worker's streams may run before they migrate (s): the
    switch's cost."""
    tick_s: float = 1.0
    balance: BalanceConfig = field(
        default_factory=lambda: BalanceConfig(min_dwell_s=10.0, sustain_s=2.0)
    )
    """Locally a switch takes about a second: a shorter dwell and sustain than in a
    cluster (60 s, 10 s), so the behaviour shows within a minute."""


def histogram_buckets(registry: CollectorRegistry, spec: MetricSpec) -> list[tuple[float, float]]:
    """``(upper bound, cumulative count)`` of a histogram without labels, in order."""
    out: list[tuple[float, float]] = []
    for family in registry.collect():
        if family.name != spec.name:
            continue
        for s in family.samples:
            if s.name == spec.name + "_bucket":
                out.append((float(s.labels["le"]), s.value))
    return sorted(out)


def window_quantile(
    now: Sequence[tuple[float, float]], before: Sequence[tuple[float, float]], q: float
) -> float | None:
    """The ``q`` quantile of what a histogram recorded between two readings (linear inside
    a bucket, as PromQL's ``histogram_quantile``); None when it recorded nothing."""
    prev = dict(before)
    counts = [(le, c - prev.get(le, 0.0)) for le, c in now]
    if not counts or counts[-1][1] <= 0:
        return None
    rank = q * counts[-1][1]
    lower, below = 0.0, 0.0
    for le, c in counts:
        if c >= rank:
            if math.isinf(le):
                return lower
            if c == below:
                return le
            return lower + (le - lower) * (rank - below) / (c - below)
        lower, below = le, c
    return lower  # pragma: no cover - the last bucket holds every count


def gauge_value(registry: CollectorRegistry, spec: MetricSpec) -> float:
    v = registry.get_sample_value(spec.name)
    return 0.0 if v is None else v


class Rebalancer:
    def __init__(
        self,
        registry: CollectorRegistry,
        views: Callable[[], Sequence[WorkerView]],
        mark_switching: Callable[[str], None],
        switch: Switch,
        switchable: Collection[str],
        settings: FlexSettings = FlexSettings(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = registry
        self.views = views
        self.mark_switching = mark_switching
        self.switch = switch
        self.switchable = set(switchable)
        self.settings = settings
        self.clock = clock
        self.memory = BalanceMemory()
        self.switches: list[tuple[float, str, Role]] = []
        """Every switch asked for: when, which worker, to what role."""
        self._ttft = histogram_buckets(registry, TTFT)
        self._tpot = histogram_buckets(registry, TPOT)
        self._tasks: set[asyncio.Task[None]] = set()

    def loads(self) -> tuple[SideLoad, SideLoad]:
        """Each side's load over the window since the last call."""
        st = self.settings
        ttft, tpot = histogram_buckets(self.registry, TTFT), histogram_buckets(self.registry, TPOT)
        ttft_p = window_quantile(ttft, self._ttft, st.percentile)
        tpot_p = window_quantile(tpot, self._tpot, st.percentile)
        self._ttft, self._tpot = ttft, tpot
        kv = [
            1.0 - v.free_blocks / v.total_blocks
            for v in self.views()
            if v.healthy and v.role.can_decode and v.total_blocks
        ]
        prefill = SideLoad(
            slo_ratio=None if ttft_p is None else ttft_p / st.ttft_slo_s,
            queue_pressure=gauge_value(self.registry, PREFILL_QUEUE) > 0,
        )
        decode = SideLoad(
            slo_ratio=None if tpot_p is None else tpot_p / st.tpot_slo_s,
            queue_pressure=gauge_value(self.registry, DECODE_QUEUE) > 0,
            kv_pressure=bool(kv) and max(kv) > st.kv_high,
        )
        return prefill, decode

    def split(self) -> Split:
        views = self.views()
        flex = [v for v in views if v.name in self.switchable]
        fixed = [v for v in views if v.name not in self.switchable and v.healthy]
        return Split(
            prefill=sum(1 for v in flex if v.healthy and v.role is Role.PREFILL),
            decode=sum(1 for v in flex if v.healthy and v.role is Role.DECODE),
            both=sum(1 for v in flex if v.healthy and v.role is Role.BOTH),
            switching=sum(1 for v in flex if v.switching) + len(self._tasks),
            fixed_prefill=sum(1 for v in fixed if v.role.can_prefill),
            fixed_decode=sum(1 for v in fixed if v.role.can_decode),
        )

    def tick(self) -> BalanceDecision:
        """Decide once; a switch it decides runs in the background (see :meth:`close`)."""
        prefill, decode = self.loads()
        costs = Costs(drain_s=self.settings.drain_s, prefix_hit_ratio=0.0,
                      cold_start_s=math.inf, can_scale=False)  # fmt: skip
        now = self.clock()
        d = decide(prefill, decode, self.split(), costs, self.memory, now, self.settings.balance)
        self.memory = d.memory
        if d.switch_to is not None and d.switch_from is not None:
            donor = self._donor(d.switch_from)
            if donor is None:  # gone since the split was read: decide again next tick
                self.memory = BalanceMemory()
                return d
            log.info("switching %s to %s: %s", donor, d.switch_to, d.detail)
            self.mark_switching(donor)
            self.switches.append((now, donor, d.switch_to))
            task = asyncio.create_task(self._switch(donor, d.switch_to), name=f"switch-{donor}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return d

    def _donor(self, role: Role) -> str | None:
        """The least busy switchable worker serving ``role``."""
        fits = [v for v in self.views() if v.name in self.switchable and v.healthy
                and v.role is role]  # fmt: skip
        if not fits:
            return None
        return min(fits, key=lambda v: (v.running + v.assigned, v.name)).name

    async def _switch(self, name: str, role: Role) -> None:
        try:
            await self.switch(name, role)
        except (grpc.RpcError, OSError, TimeoutError) as e:  # the next ticks decide again
            log.warning("switching %s to %s failed: %s", name, role, e)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.tick()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.settings.tick_s)

    async def close(self) -> None:
        """Wait for the switches under way (a switch is never cut halfway)."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

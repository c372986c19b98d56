"""A switchable worker's role, and the switch from one role to another in place.

A worker started with ``--switchable`` holds the parts of both roles (the decode
handoff with its KV receivers, and the prefill runner) over one engine; its
:class:`RoleState` says which role it serves now, and the servicer checks it on every
call. :meth:`RoleSwitcher.switch` changes it:

1. from then on, new work of either role is refused (UNAVAILABLE with the
   :data:`~splitserve.roles.SWITCHING_METADATA` trailing metadata: a router plans it
   elsewhere); calls of work already admitted (a push into a lease, its Commit, the
   Generate stream of a reservation) still run;
2. Prefill calls finish their pushes; reservations are committed and their streams,
   like every other stream, run for up to the drain time;
3. the streams still running are ended for migration (the same refusal: the router
   resumes them elsewhere with the tokens so far) and every lease left is released;
4. what differs between roles is set for the new one (the engine's role-labelled
   metrics), and the new role is served.

The weights, the KV pool and the prefix cache stay as they are.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from splitserve import metric_names as names
from splitserve.metric_registry import Metrics
from splitserve.roles import SWITCHING_METADATA, Role
from splitserve.v1 import worker_pb2 as pb

from splitserve_worker.server.errors import RpcFailure

log = logging.getLogger(__name__)

DRAIN_POLL_S = 0.01
"""How often a drain looks at what is still running (a switch takes at least this)."""

TO_PROTO = {Role.PREFILL: pb.ROLE_PREFILL, Role.DECODE: pb.ROLE_DECODE, Role.BOTH: pb.ROLE_BOTH}
FROM_PROTO = {v: k for k, v in TO_PROTO.items()}


@dataclass
class RoleState:
    """The role a worker serves, and the switch under way (if any)."""

    role: Role
    switchable: bool = False
    switching_to: Role | None = None
    switches: int = 0
    streams: dict[str, bool] = field(default_factory=dict)
    """Generate streams under way: request id -> ended by a switch (for migration)."""

    @property
    def switching(self) -> bool:
        return self.switching_to is not None

    def refusal(self) -> RpcFailure:
        """What a call of new work gets while a switch is under way."""
        to = self.switching_to or self.role
        return RpcFailure(
            grpc.StatusCode.UNAVAILABLE,
            f"this worker is switching its role from {self.role.value} to {to.value}: "
            "send the request to another worker",
            ((SWITCHING_METADATA, to.value),),
        )

    def wrong_role(self, message: str) -> RpcFailure:
        """What a call for a role this worker does not serve gets: FAILED_PRECONDITION,
        and on a switchable worker the switching metadata too (the caller's view of its
        role is stale: it plans elsewhere and reads the role again)."""
        metadata = ((SWITCHING_METADATA, self.role.value),) if self.switchable else ()
        return RpcFailure(grpc.StatusCode.FAILED_PRECONDITION, message, metadata)

    def check_new_work(self) -> None:
        """Raise the switch's refusal while one is under way."""
        if self.switching:
            raise self.refusal()


@dataclass(frozen=True)
class SwitchOutcome:
    previous: Role
    role: Role
    seconds: float
    migrated: int
    leases_released: int


class RoleSwitcher:
    """Drains a switchable worker and changes its :class:`RoleState`.

    ``handoff`` and ``prefill`` are the decode and prefill parts (both present on a
    switchable worker); ``relabel`` sets what differs between roles for the new one (it
    runs with nothing in flight)."""

    def __init__(
        self,
        state: RoleState,
        *,
        engine: Any,
        handoff: Any,
        prefill: Any,
        metrics: Metrics,
        drain_seconds: float,
        relabel: Callable[[Role], Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.state = state
        self.engine = engine
        self.handoff = handoff
        self.prefill = prefill
        self.drain_seconds = drain_seconds
        self.relabel = relabel
        self.clock = clock
        self._task: asyncio.Task[SwitchOutcome] | None = None
        self._role_gauge = metrics.gauge(names.WORKER_ROLE)
        self._in_progress = metrics.gauge(names.ROLE_SWITCH_IN_PROGRESS)
        self._switches = metrics.counter(names.ROLE_SWITCHES)
        self._duration = metrics.histogram(names.ROLE_SWITCH_DURATION)
        self._migrated = metrics.counter(names.ROLE_SWITCH_MIGRATED)
        self._show_role()

    def _show_role(self) -> None:
        for r in Role:
            self._role_gauge.labels(role=r.value).set(1 if r is self.state.role else 0)

    async def switch(self, target: Role, drain_seconds: float | None = None) -> SwitchOutcome:
        """Switch to ``target`` (a no-op when it is the role already); raises
        FAILED_PRECONDITION when the worker is not switchable or another switch is under
        way. The switch runs to its end even if the caller goes away."""
        st = self.state
        if not st.switchable:
            raise RpcFailure(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this worker serves {st.role.value} only: start it with --switchable "
                "to change its role in place",
            )
        if self._task is not None and not self._task.done():
            raise RpcFailure(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"a switch to {st.switching_to.value if st.switching_to else '?'} is under "
                "way: wait for it to end (Health says switching) and ask again",
            )
        drain = self.drain_seconds if drain_seconds is None or drain_seconds <= 0 else drain_seconds
        self._task = asyncio.create_task(self._run(target, drain), name=f"switch-to-{target}")
        return await asyncio.shield(self._task)

    async def _run(self, target: Role, drain_s: float) -> SwitchOutcome:
        st = self.state
        previous = st.role
        started = self.clock()
        if target is previous:
            return SwitchOutcome(previous, target, 0.0, 0, 0)
        st.switching_to = target
        self._in_progress.set(1)
        log.info("switching role %s -> %s (drain up to %g s)", previous, target, drain_s)
        try:
            deadline = started + drain_s
            while not self._drained() and self.clock() < deadline:
                await asyncio.sleep(DRAIN_POLL_S)
            migrated = await self._end_streams()
            while self.prefill.in_progress:  # a push under way ends by its own timeout
                await asyncio.sleep(DRAIN_POLL_S)
            released = 0
            for lease in self.handoff.leases.leases():
                if lease.request_id in st.streams:  # its Generate waits for the Commit
                    st.streams[lease.request_id] = True
                await self.handoff.drop(lease.request_id, "role_switch")
                released += 1
            while st.streams:  # the ended streams tell their callers, then leave
                await asyncio.sleep(DRAIN_POLL_S)
            if self.relabel is not None:
                await self.relabel(target)
            st.role = target
            st.switches += 1
            self._show_role()
        finally:
            st.switching_to = None
            self._in_progress.set(0)
        seconds = self.clock() - started
        self._switches.labels(from_role=previous.value, to_role=target.value).inc()
        self._duration.observe(seconds)
        log.info("now serving %s (%.3f s, %d migrated, %d leases released)",
                 target, seconds, migrated, released)  # fmt: skip
        return SwitchOutcome(previous, target, seconds, migrated, released)

    def _drained(self) -> bool:
        return not (self.state.streams or len(self.handoff.leases) or self.prefill.in_progress)

    async def _end_streams(self) -> int:
        """End every stream still running: each is marked, then aborted in the engine (its
        Generate call then ends with the switch's refusal)."""
        n = 0
        for rid, ended in list(self.state.streams.items()):
            # a stream still waiting for its Commit holds a lease: released with the
            # leases (its blocks may be under a push)
            if not ended and not self.handoff.leases.contains(rid):
                self.state.streams[rid] = True
                await self.engine.abort(rid)
                n += 1
        if n:
            self._migrated.inc(n)
        return n

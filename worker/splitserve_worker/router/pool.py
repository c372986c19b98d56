"""The live set of workers: health polling, prefix events, and snapshots for routing.

Discovery says where workers are; the pool keeps one connection per worker,
polls its Health every ``health_interval_s``, follows its prefix-cache Events
into the shared :class:`PrefixIndex`, and offers an immutable snapshot of
:class:`WorkerView` for each routing decision. A worker that fails a Health
call or a request is marked unhealthy until its next good Health answer.

A worker's role is the one its Health reports (discovery's is only the first guess):
a switchable worker changes it. While its Health says a switch is under way, or from
the moment one of its calls was refused for one, it takes no requests at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import grpc
from splitserve.roles import Role
from splitserve.v1 import worker_pb2 as pb

from splitserve_worker.router.discovery import Discovery, WorkerEndpoint
from splitserve_worker.router.prefix_index import PrefixIndex
from splitserve_worker.router.scoring import WorkerView
from splitserve_worker.router.worker_conn import WorkerConn

log = logging.getLogger(__name__)

ConnFactory = Callable[[WorkerEndpoint], WorkerConn]
ROLES = {pb.ROLE_PREFILL: Role.PREFILL, pb.ROLE_DECODE: Role.DECODE, pb.ROLE_BOTH: Role.BOTH}


@dataclass
class Member:
    endpoint: WorkerEndpoint
    conn: WorkerConn
    view: WorkerView
    compat: pb.CompatInfo | None = None
    tasks: tuple[asyncio.Task[None], ...] = ()


class WorkerPool:
    def __init__(
        self,
        connect: ConnFactory,
        index: PrefixIndex,
        health_interval_s: float = 1.0,
        health_timeout_s: float = 5.0,
        on_change: Callable[[], None] | None = None,
        drain_s: float = 60.0,
    ) -> None:
        self._connect = connect
        self.drain_s = drain_s
        self.index = index
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self._on_change = on_change
        self.on_compat: Callable[[pb.CompatInfo], None] | None = None
        self._members: dict[str, Member] = {}
        self._snapshot: tuple[WorkerView, ...] = ()
        self._changed = asyncio.Event()
        self._closing: dict[asyncio.Task[None], WorkerConn] = {}
        """Connections of workers that left, closing once their streams end."""

    # ---- reading ----

    def snapshot(self) -> tuple[WorkerView, ...]:
        return self._snapshot

    def conn(self, name: str) -> WorkerConn:
        return self._members[name].conn

    def compat(self, name: str) -> pb.CompatInfo | None:
        m = self._members.get(name)
        return m.compat if m else None

    def has(self, name: str) -> bool:
        return name in self._members

    def count(self, side: Callable[[Role], bool]) -> int:
        return sum(1 for v in self._snapshot if v.healthy and side(v.role))

    async def wait_change(self, timeout: float) -> None:
        """Returns when the worker set or a worker's health changes, or after ``timeout``."""
        self._changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout)

    # ---- bookkeeping by the dispatcher ----

    def assign(self, name: str, delta: int) -> None:
        m = self._members.get(name)
        if m is not None:
            m.view = replace(m.view, assigned=max(0, m.view.assigned + delta))
            self._publish(notify=False)

    def mark_failed(self, name: str, why: str, instance: str = "") -> None:
        """Mark ``name`` unhealthy until its next good Health answer; with ``instance``,
        only while it is still that instance (one restarted meanwhile is a new worker)."""
        m = self._members.get(name)
        if instance and m is not None and m.view.instance not in ("", instance):
            return
        if m is not None and m.view.healthy:
            log.warning("worker %s marked unhealthy: %s", name, why)
            m.view = replace(m.view, healthy=False)
            self.index.remove_worker(name)
            self._publish()

    def mark_switching(self, name: str, instance: str = "") -> None:
        """Send nothing more to ``name`` (it said it is switching its role) until a Health
        answer says the switch is over; what it has cached stays known."""
        m = self._members.get(name)
        if m is None or (instance and m.view.instance not in ("", instance)):
            return
        if m.view.healthy or not m.view.switching:
            log.info("worker %s is switching its role", name)
            m.view = replace(m.view, healthy=False, switching=True)
            self._publish()

    # ---- membership ----

    def set_endpoints(self, endpoints: list[WorkerEndpoint]) -> None:
        wanted = {e.name: e for e in endpoints}
        for name in list(self._members):
            if name not in wanted or wanted[name] != self._members[name].endpoint:
                self._drop(name)
        for name, ep in wanted.items():
            if name not in self._members:
                m = Member(
                    ep, self._connect(ep), WorkerView(name=name, role=ep.role, healthy=False)
                )
                self._members[name] = m
                m.tasks = (
                    asyncio.create_task(self._poll_health(m), name=f"health-{name}"),
                    asyncio.create_task(self._follow_events(m), name=f"events-{name}"),
                )
        self._publish()

    def _drop(self, name: str) -> None:
        m = self._members.pop(name)
        for t in m.tasks:
            t.cancel()
        self.index.remove_worker(name)
        # no new requests go there; the streams under way may finish (a stopping worker
        # drains them) before the connection closes
        closing = asyncio.create_task(m.conn.close(grace=self.drain_s))
        self._closing[closing] = m.conn
        closing.add_done_callback(lambda t: self._closing.pop(t, None))

    async def follow(self, discovery: Discovery) -> None:
        async for endpoints in discovery.watch():
            self.set_endpoints(endpoints)

    async def close(self) -> None:
        for name in list(self._members):
            m = self._members.pop(name)
            for t in m.tasks:
                t.cancel()
            with contextlib.suppress(Exception):
                await m.conn.close()
        for conn in list(self._closing.values()):  # the router stops: no more waiting
            with contextlib.suppress(Exception):
                await conn.close()
        self._snapshot = ()

    def _publish(self, notify: bool = True) -> None:
        self._snapshot = tuple(m.view for m in self._members.values())
        if notify:
            self._changed.set()
            if self._on_change is not None:
                self._on_change()

    # ---- background loops ----

    async def refresh(self, m: Member) -> bool:
        """One Health call; updates the view and says whether the worker answered."""
        try:
            h = await m.conn.health(self.health_timeout_s)
        except (grpc.RpcError, OSError, TimeoutError) as e:
            if m.view.healthy:
                log.warning("worker %s failed its health check: %s", m.endpoint.name, e)
                m.view = replace(m.view, healthy=False)
                self.index.remove_worker(m.endpoint.name)
                self._publish()
            return False
        was = m.view.healthy
        if m.view.instance and h.instance_id != m.view.instance:
            # restarted at the same address: what the old process held is gone
            log.warning("worker %s restarted (instance %s, was %s)", m.endpoint.name,
                        h.instance_id or "unknown", m.view.instance)  # fmt: skip
            self.index.remove_worker(m.endpoint.name)
            was = False
        m.compat = h.compat
        if self.on_compat is not None and h.HasField("compat"):
            self.on_compat(h.compat)
        role = ROLES.get(h.role, m.view.role)
        changed = role is not m.view.role or h.switching != m.view.switching
        m.view = replace(
            m.view,
            role=role,
            switching=h.switching,
            healthy=not h.switching,
            switches=h.switches,
            free_blocks=h.free_blocks,
            total_blocks=h.total_blocks,
            running=h.running,
            waiting=h.waiting,
            tokens_in_flight=h.tokens_in_flight,
            instance=h.instance_id,
        )
        self._publish(notify=changed or was != m.view.healthy)
        return True

    async def _poll_health(self, m: Member) -> None:
        while True:
            await self.refresh(m)
            await asyncio.sleep(self.health_interval_s)

    async def _follow_events(self, m: Member) -> None:
        name = m.endpoint.name
        while True:
            try:
                async for ev in m.conn.events():
                    if ev.kind == pb.KVEvent.STORED:
                        self.index.stored(name, ev.block_hashes)
                    elif ev.kind == pb.KVEvent.EVICTED:
                        self.index.evicted(name, ev.block_hashes)
                    elif ev.kind == pb.KVEvent.CLEARED:
                        self.index.remove_worker(name)
            except grpc.RpcError as e:
                log.debug("events of %s ended: %s", name, e)
            # the stream ended (worker restarted or gone): what it held is unknown now
            self.index.remove_worker(name)
            await asyncio.sleep(self.health_interval_s)

"""Two bounded queues (prefill and decode) with admission control.

A :class:`Stage` lets ``capacity`` requests through at once and keeps at most
``max_waiting`` more waiting, first come first served. A request beyond that is
refused at once (:class:`Saturated`, HTTP 429); one that waits longer than
``max_wait_s`` is refused too (HTTP 503). Both answers carry Retry-After.
Capacity follows the workers: it is set from the number of healthy workers.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass


@dataclass
class Saturated(Exception):
    """A queue refused a request; ``status`` is the HTTP status to answer with."""

    stage: str
    status: int
    retry_after_s: int
    detail: str

    def __str__(self) -> str:
        return self.detail


class Stage:
    """One bounded FIFO queue in front of ``capacity`` slots."""

    def __init__(
        self,
        name: str,
        capacity: int,
        max_waiting: int,
        max_wait_s: float,
        retry_after_s: int = 1,
        on_depth: Callable[[int], None] | None = None,
    ) -> None:
        if max_waiting < 0 or capacity < 0 or max_wait_s <= 0:
            raise ValueError("capacity and max_waiting must be >= 0 and max_wait_s > 0")
        self.name = name
        self._capacity = capacity
        self.max_waiting = max_waiting
        self.max_wait_s = max_wait_s
        self.retry_after_s = retry_after_s
        self._on_depth = on_depth
        self._active = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def active(self) -> int:
        return self._active

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @property
    def has_room(self) -> bool:
        """Whether :meth:`acquire` would return at once."""
        return self._active < self._capacity and not self._waiters

    def set_capacity(self, capacity: int) -> None:
        self._capacity = max(0, capacity)
        self._wake()

    def _depth_changed(self) -> None:
        if self._on_depth is not None:
            self._on_depth(len(self._waiters))

    def _wake(self) -> None:
        while self._waiters and self._active < self._capacity:
            fut = self._waiters.popleft()
            if not fut.done():
                self._active += 1
                fut.set_result(None)
        self._depth_changed()

    async def acquire(self) -> None:
        """Wait for a slot; raises :class:`Saturated` when full or after ``max_wait_s``."""
        if self._active < self._capacity and not self._waiters:
            self._active += 1
            return
        if len(self._waiters) >= self.max_waiting:
            raise Saturated(
                self.name,
                429,
                self.retry_after_s,
                f"the {self.name} queue is full ({self.max_waiting} requests waiting); "
                f"retry after {self.retry_after_s} s",
            )
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self._depth_changed()
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.max_wait_s)
        except TimeoutError:
            if fut.done() and not fut.cancelled():
                self.release()  # granted just as the wait ran out: give the slot back
            self._forget(fut)
            raise Saturated(
                self.name,
                503,
                self.retry_after_s,
                f"no {self.name} capacity became free within {self.max_wait_s:g} s; "
                f"retry after {self.retry_after_s} s",
            ) from None
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()
            self._forget(fut)
            raise

    def _forget(self, fut: asyncio.Future[None]) -> None:
        fut.cancel()
        with contextlib.suppress(ValueError):
            self._waiters.remove(fut)
        self._depth_changed()

    def release(self) -> None:
        if self._active > 0:
            self._active -= 1
        self._wake()

    async def admit(self) -> Admission:
        """:meth:`acquire`, as an :class:`Admission` another part of the router can release."""
        await self.acquire()
        return Admission(self)

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        await self.acquire()
        try:
            yield
        finally:
            self.release()


class Admission:
    """A slot taken from a :class:`Stage` ahead of its use; released once, whoever
    releases it first (the request that used it, or a cleanup if it never ran)."""

    def __init__(self, stage: Stage) -> None:
        self._stage = stage
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._stage.release()

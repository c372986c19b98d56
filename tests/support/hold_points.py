"""Stopping worker processes at named points (``SPLITSERVE_FAULT_HOLD_DIR``), so a test
kills or cuts one exactly there instead of after a sleep.

A worker started with ``env()`` in its environment waits at point ``P`` (``push``,
``receive``, ``stream``; see ``splitserve_worker.kv.faults``) while ``arm(pid, P)``'s
file exists, and says it got there by writing a ``.reached`` file next to it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from splitserve_worker.kv.faults import ENV_HOLD_DIR, hold_files

POLL_S = 0.01


class HoldPoints:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    def env(self) -> dict[str, str]:
        """What a worker's environment needs for its hold points to work."""
        return {ENV_HOLD_DIR: str(self.directory)}

    def _files(self, pid: int, point: str) -> tuple[Path, Path]:
        armed, reached = hold_files(str(self.directory), pid, point)
        return Path(armed), Path(reached)

    def arm(self, pid: int, point: str) -> None:
        """Process ``pid`` will stop at ``point`` (forgetting any earlier arrival)."""
        armed, reached = self._files(pid, point)
        armed.parent.mkdir(parents=True, exist_ok=True)
        reached.unlink(missing_ok=True)
        armed.touch()

    def release(self, pid: int, point: str) -> None:
        """Lets ``pid`` go on from ``point`` (and pass it from now on)."""
        self._files(pid, point)[0].unlink(missing_ok=True)

    def reached(self, pid: int, point: str) -> bool:
        return self._files(pid, point)[1].exists()

    def _first(self, pids: Iterable[int], point: str) -> int | None:
        return next((pid for pid in pids if self.reached(pid, point)), None)

    def wait_reached(
        self,
        pids: Iterable[int],
        point: str,
        timeout: float = 60.0,
        gave_up: Callable[[], bool] = lambda: False,
    ) -> int:
        """The first of ``pids`` found stopped at ``point``. Fails after ``timeout``, or
        as soon as ``gave_up()`` says the work that should get there has ended."""
        pids = list(pids)
        deadline = time.monotonic() + timeout
        while (pid := self._first(pids, point)) is None:
            if gave_up():
                raise AssertionError(f"the work ended before any of {pids} reached {point!r}")
            if time.monotonic() > deadline:
                raise AssertionError(f"none of {pids} reached {point!r} in {timeout:g} s")
            time.sleep(POLL_S)
        return pid

    async def wait_reached_async(
        self,
        pids: Iterable[int],
        point: str,
        timeout: float = 60.0,
        gave_up: Callable[[], bool] = lambda: False,
    ) -> int:
        """:meth:`wait_reached` for a test's event loop."""
        pids = list(pids)
        deadline = time.monotonic() + timeout
        while (pid := self._first(pids, point)) is None:
            if gave_up():
                raise AssertionError(f"the work ended before any of {pids} reached {point!r}")
            if time.monotonic() > deadline:
                raise AssertionError(f"none of {pids} reached {point!r} in {timeout:g} s")
            await asyncio.sleep(POLL_S)
        return pid

    @contextlib.contextmanager
    def armed(self, pids: Iterable[int], point: str) -> Iterator[list[int]]:
        """Arms ``point`` on every one of ``pids``; releases them all on leaving."""
        pids = list(pids)
        for pid in pids:
            self.arm(pid, point)
        try:
            yield pids
        finally:
            for pid in pids:
                self.release(pid, point)

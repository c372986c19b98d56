"""Rank 0 starting the other tensor-parallel ranks of one worker, watching them, and
leaving none behind.

Rank 0 opens a ``torch.distributed`` store on 127.0.0.1 (the ranks of a worker share its
pod), puts there what every rank needs to build its shard (the model, dtype, device, the
engine settings), and starts ranks ``1..N-1`` as ``python -m
splitserve_worker.commands.rank`` processes that exit with it (a parent-death signal).
A thread watches them: one that exits while the worker is not stopping is a lost rank,
and every ``on_lost`` callback hears which one and how it ended (the worker fails its
health and exits: nothing it runs can finish without that rank's heads). :meth:`stop`
ends them all, killing any that does not return in time.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from splitserve_worker.parallel.collectives import RankGroup

log = logging.getLogger(__name__)

SPEC_KEY = "rank-spec"
RANK_MODULE = "splitserve_worker.commands.rank"
POLL_S = 0.2
"""How often the watcher looks at the rank processes (a lost rank is noticed within it)."""


@dataclass(frozen=True)
class RankSpec:
    """What every rank builds its part from (pickled into the store)."""

    model: str
    dtype: str
    device: str
    """``cpu`` or ``cuda`` (rank ``r`` takes ``cuda:r``)."""
    allreduce: str
    engine: dict[str, Any]
    """The engine settings (:class:`~splitserve_worker.engine.config.EngineConfig` fields)."""
    serve: Any = None
    """What the worker's server asks of the other ranks besides forwards, if anything (a
    decode worker's: each rank's own KV port)."""


def rank_device(device: str, rank: int) -> torch.device:
    return torch.device(f"cuda:{rank}") if device.startswith("cuda") else torch.device("cpu")


class RankProcesses:
    """Ranks ``1..world-1`` of one worker, as processes of this one (rank 0)."""

    def __init__(self, world: int, spec: RankSpec, *, timeout_s: float = 300.0,
                 env: dict[str, str] | None = None) -> None:  # fmt: skip
        self.world = world
        self.spec = spec
        self.timeout_s = timeout_s
        self.store: Any = dist.TCPStore("127.0.0.1", 0, world, True, wait_for_workers=False,
                                        timeout=datetime.timedelta(seconds=timeout_s))  # fmt: skip
        self.store.set(SPEC_KEY, pickle.dumps(spec))  # type: ignore[arg-type]  # takes bytes
        self._stopping = threading.Event()
        self._lost: list[Callable[[str], None]] = []
        self._lock = threading.Lock()
        self.lost: str | None = None
        """How the first lost rank ended, once one is."""
        self.procs: list[subprocess.Popen[bytes]] = []
        try:
            for rank in range(1, world):
                cmd = [sys.executable, "-m", RANK_MODULE, "--store-port", str(self.store.port),
                       "--rank", str(rank), "--world", str(world),
                       "--parent-pid", str(os.getpid())]  # fmt: skip
                self.procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL))
        except OSError:
            self.stop(0.0)
            raise
        self._watcher = threading.Thread(target=self._watch, name="splitserve-ranks", daemon=True)
        self._watcher.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def group(self) -> RankGroup:
        """Rank 0's group (returns once every rank has joined it)."""
        return RankGroup(self.store, 0, self.world, rank_device(self.spec.device, 0),
                         allreduce=self.spec.allreduce, timeout_s=self.timeout_s)  # fmt: skip

    def on_lost(self, callback: Callable[[str], None]) -> None:
        """``callback(why)`` when a rank process ends while the worker is not stopping (on
        the watcher's thread; at once if one has already)."""
        with self._lock:
            self._lost.append(callback)
            lost = self.lost
        if lost is not None:
            callback(lost)

    def check(self, within_s: float = 0.0) -> str | None:
        """Look at the rank processes (for up to ``within_s`` until one has exited): the
        first that has exited while the worker is not stopping is lost (every ``on_lost``
        callback hears it, once). Returns how the lost rank ended, if one is. The watcher
        calls this every ``POLL_S``; an error that a lost rank causes elsewhere (a
        collective whose peer closed) calls it with a short wait, since the peer's sockets
        close a moment before its exit can be seen, so that the worker says which rank
        went rather than only what failed."""
        deadline = time.monotonic() + within_s
        while (why := self._poll()) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return why

    def _poll(self) -> str | None:
        for rank, p in enumerate(self.procs, start=1):
            code = p.poll()
            if code is None:
                continue
            why = (f"tensor-parallel rank {rank} (pid {p.pid}) exited with status {code}; "
                   f"the worker cannot run without its heads and must restart")  # fmt: skip
            with self._lock:
                if self.lost is not None or self._stopping.is_set():
                    return self.lost
                self.lost = why
                callbacks = list(self._lost)
            log.error("%s", why)
            for cb in callbacks:
                cb(why)
            return why
        return self.lost

    def _watch(self) -> None:
        while not self._stopping.wait(POLL_S):
            if self.check() is not None:
                return

    def stop(self, grace_s: float = 10.0) -> None:
        """End every rank: wait up to ``grace_s`` for those told to return, then kill the
        rest; returns once none runs."""
        self._stopping.set()
        for p in self.procs:
            try:
                p.wait(grace_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

"""CPU time of a sender (this process) and a receiver process over timed pushes, for
the benches that compare transports: where throughput is bound by CPU, not the wire."""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds, all threads, of this process or of process ``pid``
    (from ``/proc``: Linux; clock ticks, so 10 ms grain)."""
    if pid is None:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuClock:
    """CPU time of the sending process (this one) and the receiving one over timed spans."""

    def __init__(self, receiver_pid: int | None) -> None:
        self._pid = receiver_pid
        self.reset()

    def reset(self) -> None:
        self.send = self.recv = self.wall = 0.0
        self.spans = 0

    def __enter__(self) -> None:
        self._s0, self._r0 = cpu_seconds(), cpu_seconds(self._pid) if self._pid else 0.0
        self._t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.wall += time.perf_counter() - self._t0
        self.send += cpu_seconds() - self._s0
        if self._pid:
            self.recv += cpu_seconds(self._pid) - self._r0
        self.spans += 1


@dataclass
class Measured:
    """One side of a side-by-side run: best GB/s; mean wall and CPU seconds per push."""

    gbs: float
    wall: float
    cpu_send: float
    cpu_recv: float

    @property
    def cpu_total(self) -> float:
        return self.cpu_send + self.cpu_recv


def cpu_report(name: str, m: Measured, base_name: str, base: Measured, nbytes: int) -> str:
    """CPU per push of a backend and its baseline (means), and the ratio that CPU alone
    allows: with every usable core busy, a push takes at least its CPU time over the cores."""
    cores = len(os.sched_getaffinity(0))
    floor = m.cpu_total / cores
    return (
        f"  per {nbytes >> 20} MiB push (mean): {name} {m.wall * 1e3:.0f} ms, CPU "
        f"{m.cpu_send * 1e3:.0f} ms sending + {m.cpu_recv * 1e3:.0f} ms receiving; {base_name} "
        f"{base.wall * 1e3:.0f} ms, CPU {base.cpu_send * 1e3:.0f} + {base.cpu_recv * 1e3:.0f} ms. "
        f"{name} spends {m.cpu_total / base.cpu_total:.1f}x the CPU per byte: on {cores} cores "
        f"a push needs >= {floor * 1e3:.0f} ms, so CPU alone caps the ratio near "
        f"{base.wall / floor:.2f}"
    )

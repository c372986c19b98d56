"""An all-reduce over shared memory between the ranks of one host (the CPU path).

gloo moves every all-reduce through loopback sockets (about a millisecond each here,
whatever the size); two all-reduces per layer per step make that most of a decode step.
Here each rank copies its partial into its own slot of one shared mapping, raises its
flag to the call's sequence number, waits for every other rank's flag, and sums the slots
in rank order: every rank computes the same sum in the same order, so all get the same
bits. Slots alternate between two banks by the sequence number's parity, so a rank
never overwrites a slot another rank may still be reading (to start call ``s + 2`` in
a bank a rank must have seen every flag of call ``s + 1``, raised after its reader had
finished call ``s``).

The mapping is a file under ``/dev/shm`` that rank 0 creates and unlinks as soon as
every rank has it open: nothing is left behind, whichever rank dies.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

FLAG_STRIDE = 8
"""int64s between two flags: one 64-byte cache line each."""

SPIN_BEFORE_YIELD = 64
SPIN_BEFORE_SLEEP = 2048
"""Polls of a peer's flag before the waiter yields its core, then before it sleeps
between polls (``SLEEP_S``): a peer that is computing arrives within the spins; one that
the host has not scheduled gets the core."""
SLEEP_S = 50e-6


class ShmTimeout(RuntimeError):
    """A peer rank did not arrive at an all-reduce in time (or the group was aborted)."""


class ShmAllReduce:
    def __init__(self, mm: mmap.mmap, rank: int, world: int, max_elems: int,
                 timeout_s: float = 120.0) -> None:  # fmt: skip
        self._mm = mm
        self.rank = rank
        self.world = world
        self.max_elems = max_elems
        self.timeout_s = timeout_s
        self._seq = 0
        nflags = 2 * world * FLAG_STRIDE
        self._flags = np.frombuffer(mm, dtype=np.int64, count=nflags)
        self._data_offset = nflags * 8
        self._slot_bytes = max_elems * 4
        self._aborted = threading.Event()
        self._why = ""

    @staticmethod
    def size_bytes(world: int, max_elems: int) -> int:
        return 2 * world * FLAG_STRIDE * 8 + 2 * world * max_elems * 4

    @classmethod
    def open(
        cls, store: Any, rank: int, world: int, max_elems: int, barrier: Callable[[], None]
    ) -> ShmAllReduce:
        """Rank 0 creates the mapping and names it in ``store``; every rank maps it;
        after ``barrier`` (all have it) rank 0 unlinks the file."""
        size = cls.size_bytes(world, max_elems)
        key = "shm-allreduce-path"
        if rank == 0:
            base = "/dev/shm" if os.path.isdir("/dev/shm") else None
            fd, path = tempfile.mkstemp(prefix="splitserve-tp-", dir=base)
            os.ftruncate(fd, size)
            store.set(key, path)
        else:
            path = store.get(key).decode()
            fd = os.open(path, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        barrier()
        if rank == 0:
            os.unlink(path)
        return cls(mm, rank, world, max_elems)

    def _slot(self, bank: int, rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
        off = self._data_offset + (bank * self.world + rank) * self._slot_bytes
        return torch.frombuffer(self._mm, dtype=dtype, count=n, offset=off)

    def abort(self, why: str) -> None:
        """End any wait now (a rank is known to be gone)."""
        self._why = why
        self._aborted.set()

    def all_reduce(self, t: torch.Tensor) -> None:
        if t.numel() > self.max_elems or t.element_size() > 4:
            raise ValueError(f"shared-memory all-reduce takes at most {self.max_elems} "
                             f"elements of at most 4 bytes")  # fmt: skip
        self._seq += 1
        seq = self._seq
        bank = seq & 1
        if not t.is_contiguous():
            raise ValueError("shared-memory all-reduce takes contiguous tensors")
        n = t.numel()
        flat = t.view(-1)
        self._slot(bank, self.rank, n, t.dtype).copy_(flat)
        flags = self._flags
        flags[(bank * self.world + self.rank) * FLAG_STRIDE] = seq
        for j in range(self.world):
            if j != self.rank:
                self._await(flags, (bank * self.world + j) * FLAG_STRIDE, seq)
        flat.copy_(self._slot(bank, 0, n, t.dtype))
        for j in range(1, self.world):
            flat.add_(self._slot(bank, j, n, t.dtype))

    def _await(self, flags: np.ndarray, at: int, seq: int) -> None:
        spins = 0
        deadline = 0.0
        while flags[at] < seq:
            spins += 1
            if spins < SPIN_BEFORE_YIELD:
                continue
            if spins < SPIN_BEFORE_SLEEP:
                os.sched_yield()
            else:  # the peer is not running: give its core back rather than spin on it
                time.sleep(SLEEP_S)
            if spins % 1024 == 0:
                now = time.monotonic()
                if deadline == 0.0:
                    deadline = now + self.timeout_s
                if self._aborted.is_set():
                    raise ShmTimeout(self._why or "the tensor-parallel group was aborted")
                if now > deadline:
                    raise ShmTimeout(f"a tensor-parallel rank did not reach an all-reduce "
                                     f"within {self.timeout_s:g} s")  # fmt: skip

    def close(self) -> None:
        self._flags = np.zeros(0, dtype=np.int64)
        with contextlib.suppress(BufferError):  # still viewed: it goes with the process
            self._mm.close()

"""The tensor-parallel ranks' process group: what one engine step needs between ranks.

- :meth:`RankGroup.all_reduce`: the sum of every rank's partial, in place, the same bits
  on every rank (after attention's output projection and after the MLP). On CUDA over
  NCCL; on the CPU over gloo or, with ``allreduce="shm"``, over the ranks' shared memory
  (:mod:`.shm_allreduce`: one host's ranks, no sockets).
- :meth:`RankGroup.send_step` / :meth:`RankGroup.recv_step`: rank 0 (the leader, which owns
  the scheduler) tells the other ranks what to run next, pickled over gloo.
- :meth:`RankGroup.all_gather`: every rank's tensor (a layer's K/V for a handoff).

Groups are made from a ``torch.distributed`` store without the global default group, so
one process may hold several in turn. A peer that is gone makes the next collective
raise :class:`RankLost` (gloo notices a closed socket; the launcher also watches the
rank processes, :mod:`.launch`).
"""

from __future__ import annotations

import datetime
import pickle
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from splitserve_worker.parallel.shm_allreduce import ShmAllReduce, ShmTimeout

ALLREDUCE_KINDS = ("auto", "gloo", "shm", "nccl")
"""``auto``: NCCL on CUDA, the shared-memory all-reduce on the CPU."""


class RankLost(RuntimeError):
    """A tensor-parallel rank is gone: the worker cannot run another step."""


@dataclass
class CollectiveStats:
    """Time spent in all-reduces (what ``bench/tp.py`` reports as their share)."""

    all_reduces: int = 0
    all_reduce_s: float = 0.0
    steps_sent: int = 0
    step_send_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ProbeAllReduce:
    """The leader asks every rank for ``count`` back-to-back all-reduces of ``elems``
    floats over ``path`` (``gloo`` or ``shm``): what one all-reduce costs by itself."""

    path: str
    elems: int
    count: int


class RankGroup:
    """One rank's view of its tensor-parallel group."""

    def __init__(
        self,
        store: Any,
        rank: int,
        world: int,
        device: torch.device,
        *,
        allreduce: str = "auto",
        max_elems: int = 1 << 20,
        timeout_s: float = 120.0,
    ) -> None:
        if allreduce not in ALLREDUCE_KINDS:
            raise ValueError(f"allreduce must be one of {', '.join(ALLREDUCE_KINDS)}")
        self.rank = rank
        self.world = world
        self.device = device
        timeout = datetime.timedelta(seconds=timeout_s)
        # typed Any: torch's stubs lack the process groups' collective methods
        self._control: Any = dist.ProcessGroupGloo(
            dist.PrefixStore("control", store), rank, world, timeout
        )
        if allreduce == "auto":
            allreduce = "nccl" if device.type == "cuda" else "shm"
        self.kind = allreduce
        self._shm: ShmAllReduce | None = None
        if allreduce == "nccl":
            nccl = getattr(dist, "ProcessGroupNCCL", None)
            if nccl is None or device.type != "cuda":
                raise ValueError("allreduce nccl needs CUDA and a torch built with NCCL")
            torch.cuda.set_device(device)  # NCCL's communicator binds the current device
            self._compute: Any = nccl(dist.PrefixStore("compute", store), rank, world, timeout)
        elif allreduce == "shm":
            self._compute = self._control
            self._shm = ShmAllReduce.open(store, rank, world, max_elems, self.barrier)
        else:
            self._compute = self._control
        self.stats = CollectiveStats()
        self.lost: str | None = None
        """Why the group is known broken (:meth:`abort`), once it is."""

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def _wait(self, work: Any) -> None:
        try:
            work.wait()
        except RuntimeError as e:  # gloo/NCCL: a peer's connection closed or timed out
            raise RankLost(f"a tensor-parallel rank is gone ({e}); the worker must restart") from e

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place; every rank gets the same values."""
        t0 = time.perf_counter()
        shm = self._shm
        if shm is not None and t.device.type == "cpu" and t.numel() <= shm.max_elems:
            try:
                shm.all_reduce(t)
            except ShmTimeout as e:
                raise RankLost(f"{e}; the worker must restart") from e
        else:
            self._wait(self._compute.allreduce([t]))
        self.stats.all_reduces += 1
        self.stats.all_reduce_s += time.perf_counter() - t0
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``t`` (same shape on every rank), in rank order."""
        t = t.contiguous()
        out = [torch.empty_like(t) for _ in range(self.world)]
        self._wait(self._compute.allgather([out], [t]))
        return out

    def min_int(self, value: int) -> int:
        """The smallest ``value`` over the ranks (the KV pool size all can hold)."""
        t = torch.tensor([value], dtype=torch.long)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN  # type: ignore[assignment]
        self._wait(self._control.allreduce([t], opts))
        return int(t.item())

    def barrier(self) -> None:
        self._wait(self._control.allreduce([torch.zeros(1)]))

    def send_step(self, message: Any) -> None:
        """Leader: broadcast ``message`` (picklable) to the other ranks."""
        if self.lost is not None:
            raise RankLost(self.lost)
        t0 = time.perf_counter()
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        size = torch.tensor([len(data)], dtype=torch.long)
        self._wait(self._control.broadcast([size], dist.BroadcastOptions()))
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self._wait(self._control.broadcast([payload], dist.BroadcastOptions()))
        self.stats.steps_sent += 1
        self.stats.step_send_s += time.perf_counter() - t0

    def recv_step(self) -> Any:
        """Follower: the leader's next :meth:`send_step` message."""
        size = torch.zeros(1, dtype=torch.long)
        self._wait(self._control.broadcast([size], dist.BroadcastOptions()))
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        self._wait(self._control.broadcast([payload], dist.BroadcastOptions()))
        return pickle.loads(payload.numpy().tobytes())  # rank 0 of this pod

    def abort(self, why: str) -> None:
        """A rank is known to be gone: end a shared-memory wait under way now (gloo and
        NCCL notice a closed peer themselves, or time out), and refuse every later
        step message at once."""
        self.lost = why
        if self._shm is not None:
            self._shm.abort(why)

    def probe(self, path: str, elems: int, count: int) -> float:
        """Leader: seconds per all-reduce of ``elems`` floats over ``path``, on every rank
        at once (the others run it from :meth:`recv_step`'s :class:`ProbeAllReduce`)."""
        if path == "shm" and self._shm is None:
            raise ValueError("this group has no shared-memory all-reduce (allreduce='shm')")
        step = ProbeAllReduce(path, elems, count)
        self.send_step(step)
        return self.run_probe(step)

    def run_probe(self, step: ProbeAllReduce) -> float:
        t = torch.zeros(step.elems)
        self.barrier()
        t0 = time.perf_counter()
        for _ in range(step.count):
            if step.path == "shm" and self._shm is not None:
                self._shm.all_reduce(t)
            else:
                self._wait(self._control.allreduce([t]))
        return (time.perf_counter() - t0) / step.count

    def close(self) -> None:
        if self._shm is not None:
            self._shm.close()
            self._shm = None

"""The rank launcher names a rank that exits: at once to a caller that asks (a collective
whose peer closed asks, so the worker's error says which rank went), once to every
``on_lost`` callback, and never for a rank ended by ``stop``."""

from __future__ import annotations

import os
import signal

import pytest
from splitserve_worker.parallel.launch import RankProcesses, RankSpec

pytestmark = pytest.mark.integration


def spec() -> RankSpec:
    # a rank waits in the store for rank 0's group, which this test never forms
    return RankSpec(model="unused", dtype="float32", device="cpu", allreduce="gloo", engine={})


def test_a_killed_rank_is_named_to_the_caller_and_to_each_callback_once() -> None:
    ranks = RankProcesses(2, spec(), timeout_s=60.0)
    heard: list[str] = []
    ranks.on_lost(heard.append)
    try:
        assert ranks.check() is None  # every rank runs
        (pid,) = ranks.pids
        os.kill(pid, signal.SIGKILL)
        why = ranks.check(within_s=30.0)
        assert why is not None
        assert f"tensor-parallel rank 1 (pid {pid}) exited with status -9" in why
        assert ranks.check() == why  # the first loss stays the answer
        assert heard == [why]  # told once, whoever looked first (caller or watcher)
    finally:
        ranks.stop(0.0)


def test_ranks_ended_by_stop_are_not_lost() -> None:
    ranks = RankProcesses(2, spec(), timeout_s=60.0)
    heard: list[str] = []
    ranks.on_lost(heard.append)
    ranks.stop(0.0)
    assert ranks.check() is None
    assert heard == []
    assert all(p.poll() is not None for p in ranks.procs)

"""Decode batch bookkeeping in closed form.

A batch's context sum at any step is one multiply-add, so admitting and
finishing sequences is O(log n) and a span of ``k`` decode steps needs no
per-sequence work (see :mod:`splitserve_operator.sim.instances`).
"""

from __future__ import annotations

import heapq

from splitserve_operator.sim.cost import CostModel
from splitserve_operator.sim.workload import Request


def steps_until(cost: CostModel, n: int, ctx: float, k: int, dt: float) -> int:
    """Smallest ``j`` in ``[1, k]`` whose span of ``j`` decode steps lasts at least ``dt``
    (``k`` when none does)."""
    lo, hi = 1, k
    while lo < hi:
        mid = (lo + hi) // 2
        if cost.decode_span(n, ctx, mid) >= dt:
            hi = mid
        else:
            lo = mid + 1
    return lo


class DecodeBatch:
    """The running decode sequences of one instance.

    Sequence ``r`` admitted at step ``s0`` with context ``c`` attends to
    ``c + (s - s0)`` positions at step ``s``, so the batch's context sum at step
    ``s`` is ``ctx_off + n * s`` with ``ctx_off = sum(c - s0)``: joining and
    finishing are O(log n) and a span needs no per-sequence work.
    """

    __slots__ = ("ctx_off", "done", "n", "reserved", "step", "tokens_out")

    def __init__(self) -> None:
        self.step = 0
        self.n = 0
        self.ctx_off = 0
        self.reserved = 0
        self.tokens_out = 0
        self.done: list[tuple[int, int, Request, int]] = []

    def ctx_sum(self) -> int:
        return self.ctx_off + self.n * self.step

    def admit(self, req: Request) -> None:
        """Join at the current step boundary; the next step decodes its second token."""
        off = req.prompt + 1 - self.step
        heapq.heappush(self.done, (self.step + req.output - 1, req.rid, req, off))
        self.n += 1
        self.ctx_off += off

    def pop_done(self) -> list[Request]:
        out = []
        done = self.done
        while done and done[0][0] <= self.step:
            _, _, req, off = heapq.heappop(done)
            self.n -= 1
            self.ctx_off -= off
            self.reserved -= req.prompt + req.output
            out.append(req)
        return out

    def steps_to_next_done(self) -> int:
        return self.done[0][0] - self.step

"""One routing plan: which decode worker, which prefill worker, local or remote."""

from __future__ import annotations

import pytest
from splitserve.roles import Role
from splitserve_worker.router.config import CostModelConfig, RouterConfig
from splitserve_worker.router.planner import RoutePlanner
from splitserve_worker.router.scoring import WorkerView

pytestmark = pytest.mark.unit

COST = CostModelConfig(prefill_tokens_per_s=1000.0, decode_prefill_tokens_per_s=1000.0)


def view(name: str, role: Role, **kw: int) -> WorkerView:
    return WorkerView(name, role, free_blocks=1000, total_blocks=1000, **kw)


def plan(workers: list[WorkerView], prompt: int = 800) -> tuple[str, str | None]:
    p = RoutePlanner(RouterConfig(cost=COST)).plan(prompt, (), workers)
    return p.decode.worker.name, None if p.prefill is None else p.prefill.worker.name


def test_a_colocated_decode_worker_hands_long_prompts_to_an_idle_prefill_worker() -> None:
    # a switchable pair mid-rebalance: one worker serves both roles, the other prefill
    # only. Every request decodes on the colocated one; an idle prefill worker beside it
    # must take the prompt (else it would sit idle while its neighbour does everything)
    both, pre = view("b", Role.BOTH, running=2), view("p", Role.PREFILL)
    assert plan([both, pre]) == ("b", "p")
    # once the prefill worker has prompts queued (3 x 800 tokens: 2.4 s), the colocated
    # worker's own chunked prefill (0.8 s + the stall of its 2 streams) is cheaper
    busy = view("p", Role.PREFILL, waiting=3)
    assert plan([both, busy]) == ("b", None)
    # a short prompt stays on the colocated worker
    assert plan([both, pre], prompt=20) == ("b", None)


def test_colocated_workers_do_not_prefill_for_each_other() -> None:
    # another 'both' worker would only move the stall onto its own streams
    b1, b2 = view("b1", Role.BOTH, running=4), view("b2", Role.BOTH, running=5)
    assert plan([b1, b2]) == ("b1", None)


def test_a_decode_worker_still_takes_a_colocated_worker_as_its_prefill_worker() -> None:
    d, b = view("d", Role.DECODE, running=1), view("b", Role.BOTH, running=9)
    assert plan([d, b]) == ("d", "b")

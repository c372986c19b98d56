"""A tensor-parallel rank other than 0 of a colocated or a decode worker (its KV handed
over tcp or grpc) is killed (``kill -9``) while 20 streams run: its worker fails visibly
(it stops answering, exits with status 3 saying which rank went, and leaves no rank
process), every request completes on the other worker with the right greedy tokens or
ends with a clear error within the bound, and the survivors' free blocks come back to
where they started."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from splitserve.roles import Role
from stack_kit import alive, child_pids

pytestmark = [pytest.mark.slow, pytest.mark.integration]

N = 20
MAX_TOKENS = 48
BOUND_S = 45.0
STACKS = {
    # a colocated worker over two ranks beside a decode worker of one
    "colocated": ([Role.BOTH, Role.DECODE], {Role.BOTH: 2}, 0, 1),
    # a decode worker over two ranks (each receiving its own KV heads from a prefill
    # worker) beside a colocated worker of one
    "decode": ([Role.PREFILL, Role.DECODE, Role.BOTH], {Role.DECODE: 2}, 1, 2),
}
BACKENDS = {"colocated": ("tcp",), "decode": ("tcp", "grpc")}
"""The KV backends each stack runs with (its router asks them of decode workers): the
split decode pool over both that reach its ranks."""


@pytest.mark.parametrize(("kind", "backend"), [(k, b) for k in sorted(STACKS) for b in BACKENDS[k]])
def test_a_killed_rank_takes_its_worker_down_and_requests_finish_elsewhere(
    stack_factory: Any, kit: Any, tiny_model_path: Path, kind: str, backend: str
) -> None:
    roles, tp, tp_worker, other = STACKS[kind]
    router_config = {**kit.router_config, "kv_backend": backend}
    if kind == "colocated":
        # the only prefill-capable worker goes: a request waiting for a prefill slot then
        # is refused (a clear error, allowed here) after a short wait rather than the default
        router_config = {**router_config, "queues": {"max_wait_s": 5.0}}
    s = stack_factory(tiny_model_path, roles, tensor_parallel=tp, router_config=router_config)
    worker = s.procs.procs[tp_worker].proc
    (rank1,) = child_pids(worker.pid)

    async def go() -> None:
        prompts = [kit.prompt_of(7000 + i) for i in range(N)]
        expected = await asyncio.to_thread(kit.reference_tokens, tiny_model_path, prompts,
                                           MAX_TOKENS)  # fmt: skip
        rest = [i for i in range(len(roles)) if i != tp_worker]
        base = await s.baseline_of(rest)
        armed = s.hold(tp_worker, "stream")
        run = asyncio.create_task(kit.many_requests(s, prompts, MAX_TOKENS, BOUND_S))
        deadline = time.monotonic() + 30
        while not s.reached(tp_worker, "stream"):
            assert time.monotonic() < deadline and not run.done(), "no stream reached the TP worker"
            await asyncio.sleep(0.01)
        os.kill(rank1, signal.SIGKILL)  # mid-stream: a stream of this worker is held
        armed.unlink()
        outcomes = await run
        hung = [o.index for o in outcomes if o.hung]
        assert not hung, kit.describe(outcomes)
        done = 0
        for o in outcomes:
            if o.completed:
                assert o.tokens == expected[o.index], f"request {o.index} got wrong tokens"
                done += 1
            else:
                err = (o.error_body or {}).get("error", {})
                assert err.get("message") and err.get("type"), f"not an OpenAI error: {o}"
        assert done > 0, kit.describe(outcomes)
        settled = await s.wait_settled(base)
        h = settled[other]
        assert (h.free_blocks, h.leases, h.running, h.waiting) == (base[other], 0, 0, 0)
        await s.wait_router_sees(rest)

    asyncio.run(go())
    assert worker.wait(30) == 3, "\n".join(s.procs.lines[-60:])
    said = [ln for ln in s.procs.lines if "error:" in ln and "tensor-parallel rank 1" in ln]
    assert said, s.procs.lines[-20:]
    assert not alive(rank1)
    assert tp_worker not in s.survivors()

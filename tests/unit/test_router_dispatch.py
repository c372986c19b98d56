"""The dispatcher's retry, migration and cleanup logic, against in-memory workers
(``tests/support/mem_workers.py``). Real worker processes are exercised in
tests/integration/test_router_faults.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from mem_workers import MemWorker, collect, expected, make, rpc_error, run
from splitserve.metric_names import ROUTER_RETRIES
from splitserve.roles import SWITCHING_METADATA
from splitserve.sampling import SamplingParams
from splitserve_worker.router.config import (
    CostModelConfig,
    GuardConfig,
    QueueConfig,
    TimeoutConfig,
)
from splitserve_worker.router.dispatch import MAX_SWITCH_MOVES, Dispatcher, GenRequest
from splitserve_worker.router.failures import RequestFailed, Stale

pytestmark = pytest.mark.unit

REMOTE = "always"


@pytest.mark.parametrize("p1_answers_health", [False, True])
async def test_prefill_failure_retries_on_another_prefill_worker_and_frees_reservation(
    p1_answers_health: bool,
) -> None:
    p1, p2, d1 = MemWorker("p1", "prefill"), MemWorker("p2", "prefill"), MemWorker("d1", "decode")
    disp = await make([p1, p2, d1], disaggregation=REMOTE)
    p1.fail_prefill = grpc.StatusCode.UNAVAILABLE
    p1.fail_health = not p1_answers_health
    assert await run(disp, [1, 2, 3], 5) == expected([1, 2, 3], 5)
    assert p1.prefilled == ["r.0"] and p2.prefilled == ["r.1"]
    assert "r.0" in d1.cancelled and "r.0" in p1.cancelled  # the failed attempt is ended everywhere
    # p1 (sorted first) is marked down only when it does not answer Health either: a
    # prefill that failed while both workers answer (a lease run out under load) is the
    # request's failure, and must not take a working prefill worker out of the pool
    assert disp.pool.snapshot()[0].healthy is p1_answers_health


async def test_prefill_failure_with_decode_not_answering_blames_the_decode_worker() -> None:
    p1, d1, d2 = MemWorker("p1", "prefill"), MemWorker("d1", "decode"), MemWorker("d2", "decode")
    disp = await make([p1, d1, d2], disaggregation=REMOTE)
    p1.fail_prefill = grpc.StatusCode.UNAVAILABLE
    d1.fail_health = True
    # p1 fails every prefill: d1 does not answer (down), d2 does (p1 is then only excluded
    # for this request), and the request ends prefilled on d2 itself
    assert await run(disp, [1, 2, 3], 5) == expected([1, 2, 3], 5)
    views = {v.name: v.healthy for v in disp.pool.snapshot()}
    assert views["p1"] and not views["d1"]


async def test_worker_lost_while_waiting_for_a_prefill_slot_is_planned_around() -> None:
    p1, d1, d2 = MemWorker("p1", "prefill"), MemWorker("d1", "decode"), MemWorker("d2", "decode")
    disp = await make(
        [p1, d1, d2], disaggregation=REMOTE, queues=QueueConfig(prefill_slots_per_worker=1)
    )
    p1.prefill_gate = asyncio.Event()
    first = asyncio.create_task(run(disp, [1, 2], 3))  # holds the only prefill slot
    while not p1.prefilled:
        await asyncio.sleep(0.001)
    target = "d1" if p1.prefilled[0] not in d1.reserved else "d2"
    second = asyncio.create_task(
        collect(disp.generate(GenRequest("s", (4, 5), SamplingParams(max_tokens=3))))
    )
    while disp.prefill_stage.waiting == 0:
        await asyncio.sleep(0.001)
    # the waiting request was planned onto the idle decode worker; that worker goes down
    disp.pool.mark_failed(target, "test: lost while the request waited")
    p1.prefill_gate.set()
    assert await first == expected([1, 2], 3)
    assert await second == expected([4, 5], 3)
    lost = d1 if target == "d1" else d2
    assert not any(r.startswith("s.") for r in lost.reserved), lost.reserved


async def test_decode_lost_before_first_token_retries_elsewhere() -> None:
    b1, b2 = MemWorker("b1", "both"), MemWorker("b2", "both")
    b1.fail_generate_after = 0
    disp = await make([b1, b2])
    assert await run(disp, [5, 6], 4) == expected([5, 6], 4)
    assert [g[0] for g in b1.generated] == ["r.0"] and [g[0] for g in b2.generated] == ["r.1"]


async def test_lost_mid_stream_migrates_prompt_plus_tokens_so_far() -> None:
    b1, b2 = MemWorker("b1", "both"), MemWorker("b2", "both")
    b1.fail_generate_after = 3
    disp = await make([b1, b2])
    assert await run(disp, [7, 8, 9], 10) == expected([7, 8, 9], 10)
    _, prompt, max_tokens = b2.generated[0]
    assert prompt == (7, 8, 9, *expected([7, 8, 9], 3)) and max_tokens == 7


@pytest.mark.parametrize(("min_tokens", "left"), [(5, 2), (2, 0), (0, 0)])
async def test_a_migrated_request_owes_only_the_minimum_it_has_not_yet_produced(
    min_tokens: int, left: int
) -> None:
    b1, b2 = MemWorker("b1", "both"), MemWorker("b2", "both")
    b1.fail_generate_after = 3
    disp = await make([b1, b2])
    sampling = SamplingParams(max_tokens=10, min_tokens=min_tokens)
    assert await run(disp, [7, 8, 9], 10, sampling) == expected([7, 8, 9], 10)
    (resumed,) = b2.generate_sampling
    assert (resumed.min_tokens, resumed.max_tokens, resumed.resumed_tokens) == (left, 7, 3)


async def test_a_request_planned_again_too_often_fails_saying_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # every attempt finds its planned workers gone when its prefill slot comes (Stale):
    # planned once, then again eight times (MAX_REPLANS), then a 503 that says why
    disp = await make([MemWorker("b1", "both")])
    attempts: list[str] = []

    async def stale(rid: str, *_: Any) -> AsyncIterator[Any]:
        attempts.append(rid)
        raise Stale()
        yield  # an async generator, as the attempt is

    monkeypatch.setattr(disp, "_attempt", stale)
    with pytest.raises(RequestFailed) as info:
        await run(disp, [1], 3)
    assert info.value.status == 503 and "kept going down" in info.value.message
    assert len(attempts) == 9 and disp.decode_stage.active == 0


async def test_a_request_no_worker_can_ever_hold_fails_at_once_saying_why() -> None:
    small = MemWorker("b1", "both")
    small.total_blocks = 2
    disp = await make([small], queues=QueueConfig(max_wait_s=0.5))
    with pytest.raises(RequestFailed) as info:
        await run(disp, list(range(100)), 3)
    assert info.value.status == 503
    assert "b1 holds 2 KV blocks, it needs" in info.value.message, info.value.message
    assert small.generated == []


async def test_a_request_waits_for_its_only_worker_to_come_back_restarted() -> None:
    # the only worker breaks mid-stream and restarts: the request, admitted, finds no
    # worker until a Health answer brings the new instance back, and waits for it
    b1 = MemWorker("b1", "both")
    b1.fail_generate_after, b1.restart_after_failing = 2, True
    disp = await make([b1], health_interval_s=0.05, queues=QueueConfig(max_wait_s=30))
    assert await run(disp, [1, 2], 4) == expected([1, 2], 4)
    assert [g[0] for g in b1.generated] == ["r.0", "r.1"]


async def test_a_finished_request_leaves_no_assignment_and_cancels_nothing() -> None:
    b1 = MemWorker("b1", "both")
    p1, d1 = MemWorker("p1", "prefill"), MemWorker("d1", "decode")
    local = await make([b1])
    # the guard's own re-run of a remote request would be one more local Generate
    remote = await make([p1, d1], disaggregation=REMOTE, guard=GuardConfig(enabled=False))
    for disp, decoder, kv_from_prefill in ((local, b1, False), (remote, d1, True)):
        for _ in range(2):
            assert await run(disp, [3, 4], 3) == expected([3, 4], 3)
        assert decoder.expect_remote == [kv_from_prefill] * 2
        assert [v.assigned for v in disp.pool.snapshot()] == [0] * len(disp.pool.snapshot())
    assert b1.cancelled == p1.cancelled == d1.cancelled == []


async def test_retries_run_out_with_a_clear_error() -> None:
    ws = [MemWorker(f"b{i}", "both") for i in range(4)]
    for w in ws:
        w.fail_generate_after = 0
    disp = await make(ws, max_retries=2)
    with pytest.raises(RequestFailed) as info:
        await run(disp, [1], 3)
    assert info.value.status == 502 and "failed on 3 workers" in info.value.message
    assert sum(len(w.generated) for w in ws) == 3


async def test_bad_request_on_the_worker_is_not_retried() -> None:
    b1, b2 = MemWorker("b1", "both"), MemWorker("b2", "both")
    b1.fail_generate_after = 0
    b1.fail_code = grpc.StatusCode.INVALID_ARGUMENT
    disp = await make([b1, b2])
    with pytest.raises(RequestFailed) as info:
        await run(disp, [1], 3)
    assert info.value.status == 400 and not b2.generated


async def test_consumer_leaving_early_cancels_on_every_worker() -> None:
    p1, d1 = MemWorker("p1", "prefill"), MemWorker("d1", "decode")
    disp = await make([p1, d1], disaggregation=REMOTE)
    gen = disp.generate(GenRequest("r", (1, 2, 3), SamplingParams(max_tokens=50)))
    async for _ in gen:
        break
    await gen.aclose()
    await disp.drain()
    assert d1.cancelled == ["r.0"] and p1.cancelled == ["r.0"]
    assert disp.decode_stage.active == 0 and disp.prefill_stage.active == 0


async def test_prefill_slot_comes_back_when_an_attempt_breaks_before_its_prefill() -> None:
    p1, d1 = MemWorker("p1", "prefill"), MemWorker("d1", "decode")
    disp = await make([p1, d1], disaggregation=REMOTE)
    conn = disp.pool.conn

    def broken(name: str) -> Any:
        if name == "p1":
            raise RuntimeError("test: no connection to p1")
        return conn(name)

    disp.pool.conn = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="no connection to p1"):
        await run(disp, [1, 2, 3], 4)
    assert disp.prefill_stage.active == 0 and disp.decode_stage.active == 0
    assert not p1.prefilled and not d1.reserved
    disp.pool.conn = conn  # type: ignore[method-assign]
    assert await run(disp, [1, 2, 3], 4) == expected([1, 2, 3], 4)


async def test_requests_queued_for_prefill_spread_over_the_prefill_workers() -> None:
    """A burst waits for prefill slots; each request picks its prefill worker when its
    slot comes, from the load then, not from the load when it arrived."""
    p1, p2 = MemWorker("p1", "prefill"), MemWorker("p2", "prefill")
    d1, d2 = MemWorker("d1", "decode"), MemWorker("d2", "decode")
    disp = await make(
        [p1, p2, d1, d2], disaggregation=REMOTE, queues=QueueConfig(prefill_slots_per_worker=1)
    )
    p1.prefill_gate, p2.prefill_gate = asyncio.Event(), asyncio.Event()
    burst = [
        asyncio.create_task(
            collect(disp.generate(GenRequest(f"r{i}", (i, i + 1), SamplingParams(max_tokens=2))))
        )
        for i in range(12)
    ]
    while disp.prefill_stage.waiting < 10:  # two prefills started, ten queued behind them
        await asyncio.sleep(0.001)
    assert len(p1.prefilled) == len(p2.prefilled) == 1
    p2.prefill_gate.set()  # p2 serves as fast as it can; p1 holds its one prefill

    async def p2_took_the_rest() -> None:
        while len(p2.prefilled) < 11:
            await asyncio.sleep(0.001)

    try:
        await asyncio.wait_for(p2_took_the_rest(), 5.0)
    finally:
        p1.prefill_gate.set()
        outs = await asyncio.gather(*burst)
    assert outs == [expected([i, i + 1], 2) for i in range(12)]
    # every queued request took the slot p2 freed: none stayed pinned to the busy p1
    assert (len(p1.prefilled), len(p2.prefilled)) == (1, 11)


def retries(disp: Dispatcher, reason: str) -> float:
    return disp.metrics.registry.get_sample_value(ROUTER_RETRIES.name, {"reason": reason}) or 0.0


@pytest.mark.parametrize(("fail_after", "counted"), [(3, "migrate"), (0, "decode_lost")])
async def test_a_retry_is_counted_as_a_migration_only_once_tokens_were_produced(
    fail_after: int, counted: str
) -> None:
    b1, b2 = MemWorker("b1", "both"), MemWorker("b2", "both")
    b1.fail_generate_after = fail_after
    disp = await make([b1, b2])
    assert await run(disp, [7, 8, 9], 6) == expected([7, 8, 9], 6)
    other = {"migrate": "decode_lost", "decode_lost": "migrate"}[counted]
    assert (retries(disp, counted), retries(disp, other)) == (1.0, 0.0)


@pytest.mark.parametrize(("overhead_s", "lease_s"), [(20.0, 60.0), (0.005, 30.0)])
async def test_the_lease_asked_at_reserve_covers_three_expected_prefills_at_least_lease_s(
    overhead_s: float, lease_s: float
) -> None:
    # a prefill expected to take ~20 s gets a lease of three times that, one expected in
    # milliseconds the configured 30 s (timeouts.lease_s)
    p1, d1 = MemWorker("p1", "prefill"), MemWorker("d1", "decode")
    cost = CostModelConfig(handoff_overhead_s=overhead_s)
    disp = await make([p1, d1], disaggregation=REMOTE, cost=cost, guard=GuardConfig(enabled=False))
    assert await run(disp, [1, 2, 3], 2) == expected([1, 2, 3], 2)
    assert d1.leases == [pytest.approx(lease_s, rel=1e-3)]


async def test_a_request_that_ends_leaves_the_others_on_its_worker_assigned() -> None:
    # two requests on one worker: when one ends, the worker still has one assigned
    b1 = MemWorker("b1", "both")
    disp = await make([b1])
    long = disp.generate(GenRequest("long", (1, 2), SamplingParams(max_tokens=20)))
    await anext(long)  # running, its consumer not reading on
    assert [v.assigned for v in disp.pool.snapshot()] == [1]
    assert await run(disp, [3, 4], 2) == expected([3, 4], 2)
    assert [v.assigned for v in disp.pool.snapshot()] == [1]
    assert len(await collect(long)) == 19
    assert [v.assigned for v in disp.pool.snapshot()] == [0]


async def test_queue_capacity_is_the_slots_of_every_worker_of_the_role() -> None:
    ws = [MemWorker("p1", "prefill"), MemWorker("p2", "prefill")]
    ws += [MemWorker(f"d{i}", "decode") for i in range(3)]
    queues = QueueConfig(prefill_slots_per_worker=3, decode_slots_per_worker=5)
    disp = await make(ws, disaggregation=REMOTE, queues=queues)
    assert (disp.prefill_stage.capacity, disp.decode_stage.capacity) == (2 * 3, 3 * 5)


async def test_prompt_logprobs_are_asked_of_the_first_attempt_only() -> None:
    # scored once, with the first token: the attempt that resumes a request mid-stream
    # does not score its prompt (the request's prompt plus the tokens so far) again
    b1, b2 = MemWorker("b1", "both"), MemWorker("b2", "both")
    b1.fail_generate_after = 3
    disp = await make([b1, b2])
    sampling = SamplingParams(max_tokens=6, prompt_logprobs=2)
    assert await run(disp, [7, 8, 9], 6, sampling) == expected([7, 8, 9], 6)
    (first,), (resumed,) = b1.generate_sampling, b2.generate_sampling
    assert (first.prompt_logprobs, resumed.prompt_logprobs) == (2, None)


class Full(MemWorker):
    """Healthy, big enough for any prompt here, and with no block free now."""

    async def health(self, timeout: float) -> Any:
        h = await super().health(timeout)
        h.free_blocks = 0
        return h


async def test_a_request_no_worker_has_room_for_within_max_wait_ends_503() -> None:
    # the only worker is full now, and may free up: the request waits max_wait_s for
    # room, then a 503 (try again later), not a 502 (a failure on a worker)
    b1 = Full("b1", "both")
    disp = await make([b1], queues=QueueConfig(max_wait_s=0.2))
    with pytest.raises(RequestFailed) as info:
        await run(disp, [1, 2], 3)
    assert info.value.status == 503
    assert "(1 workers known, 0 failed this request)" in info.value.message, info.value.message
    assert b1.generated == []


class SilentAfterFirst(MemWorker):
    """Streams one token, then nothing, for ever."""

    async def generate(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        async for chunk in super().generate(*args, **kwargs):
            yield chunk
            await asyncio.Event().wait()


async def test_a_stream_silent_after_its_first_token_is_judged_by_the_inter_token_timeout() -> None:
    # first_token_s bounds only the wait for the first token; past it a silence of
    # inter_token_s moves the request (here: after an hour, it would wait the hour)
    b1, b2 = SilentAfterFirst("b1", "both"), MemWorker("b2", "both")
    disp = await make([b1, b2])
    timeouts = TimeoutConfig(health_interval_s=60, first_token_s=3600, inter_token_s=2)
    disp.config = dataclasses.replace(disp.config, timeouts=timeouts)
    got = await asyncio.wait_for(run(disp, [4, 5], 5), 60)
    assert got == expected([4, 5], 5)
    assert [g[0] for g in b1.generated] == ["r.0"] and [g[0] for g in b2.generated] == ["r.1"]
    assert retries(disp, "migrate") == 1


async def test_a_request_whose_workers_go_while_it_waits_for_a_prefill_slot_ends_503() -> None:
    # planned onto d1, the request waits for p1's one slot; d1 goes meanwhile and no
    # other decode worker exists: planned again (nothing fits), it ends 503 saying so
    p1, d1 = MemWorker("p1", "prefill"), MemWorker("d1", "decode")
    disp = await make([p1, d1], disaggregation=REMOTE,
                      queues=QueueConfig(prefill_slots_per_worker=1, max_wait_s=0.2))  # fmt: skip
    p1.prefill_gate = asyncio.Event()
    first = asyncio.create_task(run(disp, [1, 2], 3))  # holds the only prefill slot
    while not p1.prefilled:
        await asyncio.sleep(0.001)
    second = asyncio.create_task(
        collect(disp.generate(GenRequest("s", (4, 5), SamplingParams(max_tokens=3))))
    )
    while disp.prefill_stage.waiting == 0:
        await asyncio.sleep(0.001)
    disp.pool.mark_failed("d1", "test: lost while the request waited")
    p1.prefill_gate.set()
    assert await first == expected([1, 2], 3)
    with pytest.raises(RequestFailed) as info:
        await second
    assert info.value.status == 503, info.value.message
    assert not any(r.startswith("s.") for r in d1.reserved), d1.reserved


class AlwaysSwitching(MemWorker):
    """Says at every Generate that it is switching its role, and is back at its next
    Health answer."""

    async def generate(self, request_id: str, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        self.generated.append((request_id, (), 0))
        trailing = grpc.aio.Metadata((SWITCHING_METADATA, "decode"))
        raise grpc.aio.AioRpcError(
            grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), trailing, "switching", None
        )
        yield  # an async generator, as Generate is


async def test_a_request_moves_off_switching_workers_at_most_max_switch_moves_times() -> None:
    b1 = AlwaysSwitching("b1", "both")
    disp = await make([b1], health_interval_s=0.01)
    with pytest.raises(RequestFailed) as info:
        await run(disp, [1, 2], 3)
    assert info.value.status == 503 and "kept switching roles" in info.value.message
    # each move counted once; the one past the bound ends the request instead
    assert retries(disp, "role_switch") == MAX_SWITCH_MOVES
    assert len(b1.generated) == MAX_SWITCH_MOVES + 1


async def test_a_remote_request_that_ran_in_one_attempt_is_offered_to_the_guard() -> None:
    # the guard re-runs a sampled disaggregated request locally, to compare its tokens;
    # every one is sampled here, so the request's one remote Generate is followed by the
    # guard's local one on the same decode worker
    p1, d1 = MemWorker("p1", "prefill"), MemWorker("d1", "decode")
    guard = GuardConfig(sample_share=1.0, min_interval_s=0.001)
    disp = await make([p1, d1], disaggregation=REMOTE, guard=guard)
    assert await run(disp, [3, 4], 3) == expected([3, 4], 3)
    assert d1.expect_remote == [True, False]


class FailsResumedPrefills(MemWorker):
    """A prefill worker that breaks on every attempt after a request's first."""

    async def prefill(self, request_id: str, *args: Any, **kwargs: Any) -> Any:
        if not request_id.endswith(".0"):
            self.prefilled.append(request_id)
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, "prefill broke")
        return await super().prefill(request_id, *args, **kwargs)


async def test_a_prefill_failing_after_tokens_counts_as_a_prefill_failure_not_a_migration() -> None:
    # d1 breaks mid-stream (a migration); the resumed attempt's prefill fails on p1 (a
    # prefill failure, though tokens were already produced); p2 and d2 finish it
    p1, p2 = FailsResumedPrefills("p1", "prefill"), MemWorker("p2", "prefill")
    d1, d2 = MemWorker("d1", "decode"), MemWorker("d2", "decode")
    d1.fail_generate_after = 2
    disp = await make([p1, p2, d1, d2], disaggregation=REMOTE, guard=GuardConfig(enabled=False))
    assert await run(disp, [7, 8, 9], 6) == expected([7, 8, 9], 6)
    assert (retries(disp, "migrate"), retries(disp, "prefill_failed")) == (1.0, 1.0)


async def test_a_request_every_worker_already_failed_ends_502_naming_the_last_error() -> None:
    # b1 refused it, and is back in the pool at its next Health answer, the same worker:
    # no worker is left that has not failed it, so a 502 saying why (not a 503)
    b1 = MemWorker("b1", "both")
    b1.fail_generate_after, b1.fail_code = 0, grpc.StatusCode.ABORTED
    disp = await make([b1], health_interval_s=0.01, queues=QueueConfig(max_wait_s=30))
    with pytest.raises(RequestFailed) as info:
        await run(disp, [1, 2], 3)
    assert info.value.status == 502, info.value.message
    assert "b1 already failed it" in info.value.message
    assert "last error" in info.value.message, info.value.message

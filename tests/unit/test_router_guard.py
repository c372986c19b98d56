"""The correctness guard: which requests it samples, that it re-runs them on their decode
worker with the prompt computed there, and what a mismatch, a failed or a busy re-run
counts, against in-memory workers (``tests/support/mem_workers.py``). With real workers
and corrupt KV: tests/integration/test_guard_live.py."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence

import grpc
import pytest
from mem_workers import MemWorker, expected, make, rpc_error, run
from splitserve.metric_names import GUARD_CHECKS, PLANNED_REMOTE_RAN_LOCAL
from splitserve.sampling import SamplingParams
from splitserve.v1 import worker_pb2 as pb
from splitserve_worker.router.config import ConfigError, GuardConfig
from splitserve_worker.router.dispatch import Dispatcher, GenRequest
from splitserve_worker.router.guard import Sampler, first_difference

pytestmark = pytest.mark.unit

REMOTE = "always"
EVERY = GuardConfig(sample_share=1.0)


def checks(d: Dispatcher) -> dict[str, float]:
    out = {}
    for outcome in ("match", "mismatch", "failed", "skipped"):
        v = d.metrics.registry.get_sample_value(GUARD_CHECKS.name, {"outcome": outcome})
        if v:
            out[outcome] = v
    return out


def test_sampler_takes_its_share_exactly_and_the_first_request() -> None:
    s = Sampler(0.25, min_interval_s=1e9)
    taken = [i for i in range(12) if s.take(now=float(i))]
    # the first one (nothing checked yet), then every fourth by the share
    assert taken == [0, 4, 8]


def test_sampler_checks_one_per_interval_whatever_the_share() -> None:
    s = Sampler(0.0, min_interval_s=10.0)
    taken = [t for t in (0.0, 1.0, 9.9, 10.0, 10.5, 25.0, 26.0) if s.take(now=t)]
    assert taken == [0.0, 10.0, 25.0]


def test_sampler_owes_a_check_it_could_not_run() -> None:
    s = Sampler(0.0, min_interval_s=100.0)
    assert s.take(0.0)
    s.missed()
    assert s.take(1.0)  # the next request is taken instead
    assert not s.take(2.0)


def test_first_difference() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2


@pytest.mark.parametrize(
    "bad",
    [
        {"sample_share": 1.5},
        {"sample_share": -0.1},
        {"min_interval_s": 0},
        {"max_concurrent": 0},
    ],
)
def test_bad_guard_settings_are_refused_by_name(bad: dict[str, float]) -> None:
    with pytest.raises(ConfigError, match="guard." + next(iter(bad))):
        GuardConfig(**bad)  # type: ignore[arg-type]


async def test_a_disaggregated_request_is_rerun_locally_on_its_decode_worker_and_matches() -> None:
    p1, d1 = MemWorker("p1", "prefill"), MemWorker("d1", "decode")
    disp = await make([p1, d1], disaggregation=REMOTE, guard=EVERY)
    assert await run(disp, [1, 2, 3], 5) == expected([1, 2, 3], 5)
    assert checks(disp) == {"match": 1}
    # the request on pushed KV, then the guard's: the same prompt and length, prefilled
    # on d1 itself with no cached prefix
    assert d1.generated == [("r.0", (1, 2, 3), 5), ("r.guard", (1, 2, 3), 5)]
    assert d1.recomputed == [False, True]
    assert p1.prefilled == ["r.0"]  # the re-run never touches a prefill worker


async def test_a_mismatch_is_counted_and_logged_with_the_request_id_and_the_user_unhurt(
    caplog: pytest.LogCaptureFixture,
) -> None:
    p1, d1 = MemWorker("p1", "prefill"), MemWorker("d1", "decode")
    d1.diverge_remote = True  # what decoding on corrupt pushed KV looks like
    disp = await make([p1, d1], disaggregation=REMOTE, guard=EVERY)
    with caplog.at_level(logging.ERROR, logger="splitserve_worker.router.guard"):
        got = await run(disp, [1, 2, 3], 5)
    assert len(got) == 5 and got != expected([1, 2, 3], 5)  # the user's answer, as decoded
    assert checks(disp) == {"mismatch": 1}
    logged = [r.getMessage() for r in caplog.records]
    assert any("request r " in m and "from token 0 of 5" in m for m in logged), logged


async def test_sampled_and_unsampled_requests() -> None:
    p1, d1 = MemWorker("p1", "prefill"), MemWorker("d1", "decode")
    disp = await make(
        [p1, d1], disaggregation=REMOTE, guard=GuardConfig(sample_share=0.5, min_interval_s=1e9)
    )
    for _ in range(4):
        await run(disp, [1, 2, 3], 2)
    # the first (nothing checked yet) and then every second by the share
    assert checks(disp) == {"match": 2}
    # a sampled request is never checked, and a local one has nothing to check
    await run(disp, [1, 2, 3], 2, SamplingParams(max_tokens=2, temperature=0.8, seed=1))
    await run(disp, [1, 2, 3], 2, SamplingParams(max_tokens=2, temperature=0.8, seed=2))
    assert checks(disp) == {"match": 2}
    local = await make([p1, d1], disaggregation="never", guard=EVERY)
    await run(local, [1, 2, 3], 2)
    assert checks(local) == {}
    off = await make([p1, d1], disaggregation=REMOTE, guard=GuardConfig(enabled=False))
    await run(off, [1, 2, 3], 2)
    assert checks(off) == {}


class GatedWorker(MemWorker):
    """A decode worker whose guard re-runs wait for a gate, or fail."""

    def __init__(self, name: str) -> None:
        super().__init__(name, "decode")
        self.rerun_gate = asyncio.Event()
        self.rerun_error: grpc.StatusCode | None = None

    async def generate(  # type: ignore[override]
        self,
        request_id: str,
        prompt: Sequence[int],
        sampling: SamplingParams,
        expect_remote_kv: bool,
        timeout: float,
        recompute_prompt: bool = False,
    ) -> AsyncIterator[pb.TokenChunk]:
        if recompute_prompt:
            if self.rerun_error is not None:
                raise rpc_error(self.rerun_error, "worker going away")
            await self.rerun_gate.wait()
        async for chunk in super().generate(
            request_id, prompt, sampling, expect_remote_kv, timeout, recompute_prompt
        ):
            yield chunk


async def finish(d: Dispatcher, rid: str, prompt: list[int], n: int) -> list[int]:
    """One request's tokens, not waiting for the guard's re-runs."""
    out: list[int] = []
    async for ev in d.generate(GenRequest(rid, tuple(prompt), SamplingParams(max_tokens=n))):
        out += ev.token_ids
    return out


async def test_a_rerun_that_is_slow_busy_or_failing_never_reaches_the_requests() -> None:
    p1, d1 = MemWorker("p1", "prefill"), GatedWorker("d1")
    disp = await make([p1, d1], disaggregation=REMOTE, guard=EVERY)
    # a's re-run hangs on d1: a is answered all the same, at once
    assert await asyncio.wait_for(finish(disp, "a", [1, 2, 3], 4), 5) == expected([1, 2, 3], 4)
    # b is sampled too, but the one re-run slot is a's: b is skipped, and answered
    assert await asyncio.wait_for(finish(disp, "b", [4, 5], 4), 5) == expected([4, 5], 4)
    assert checks(disp) == {"skipped": 1}
    d1.rerun_gate.set()
    await disp.drain()
    assert checks(disp) == {"skipped": 1, "match": 1}
    # c, taken in b's place, has its re-run refused: no verdict, and c is answered
    d1.rerun_error = grpc.StatusCode.UNAVAILABLE
    assert await asyncio.wait_for(finish(disp, "c", [6], 4), 5) == expected([6], 4)
    await disp.drain()
    assert checks(disp) == {"skipped": 1, "match": 1, "failed": 1}
    assert "c.guard" in d1.cancelled  # the unfinished re-run is ended on the worker


async def test_a_request_planned_remote_that_ran_local_is_counted() -> None:
    p1, d1 = MemWorker("p1", "prefill"), MemWorker("d1", "decode")
    disp = await make([p1, d1], disaggregation=REMOTE, guard=EVERY)
    # the handoff fails and p1 no longer answers: the retry prefills on d1 itself
    p1.fail_prefill = grpc.StatusCode.UNAVAILABLE
    p1.fail_health = True
    assert await run(disp, [1, 2, 3], 3) == expected([1, 2, 3], 3)
    reg = disp.metrics.registry
    assert reg.get_sample_value(PLANNED_REMOTE_RAN_LOCAL.name) == 1.0
    assert checks(disp) == {}  # it did not run disaggregated: nothing for the guard

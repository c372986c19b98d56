"""A request's choices turned into its answer without the HTTP app: text deltas, stop
strings, finish reasons and metrics of one choice; ``n`` choices merged; the SSE stream
with its usage and errors; the whole answer; a client that leaves; decode slots taken
and given back. The workers are scripted event sources."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from splitserve.metric_registry import Metrics
from splitserve.sampling import SamplingParams
from splitserve_worker.router import streaming
from splitserve_worker.router.dispatch import TokenEvent
from splitserve_worker.router.failures import RequestFailed
from splitserve_worker.router.queues import Saturated, Stage
from splitserve_worker.router.request_metrics import RequestMetrics
from splitserve_worker.router.responses import Job, choices_of
from splitserve_worker.router.text import Detokenizer

pytestmark = pytest.mark.unit


class Letters:
    """Token id i is the letter chr(ord('a') + i)."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


def job(kind: str = "text_completion", *, prompt: tuple[int, ...] = (1, 2, 3),
        stop: tuple[str, ...] = (), **kw: Any) -> Job:  # fmt: skip
    return Job(id="cmpl-1", kind=kind, model="m", prompt=prompt, sampling=SamplingParams(),
               detok=Detokenizer(Letters(), stop), want_logprobs=False,
               return_token_ids=False, stream=True, arrived=0.0, **kw)  # fmt: skip


def ev(*ids: int, finish: str | None = None) -> TokenEvent:
    return TokenEvent(tuple(ids), (0.0,) * len(ids), finish)


class Workers:
    """Scripted event sources, one per choice index; records which were closed."""

    def __init__(self, *scripts: Sequence[TokenEvent | BaseException | None]) -> None:
        self.scripts = scripts
        self.closed: list[int] = []
        self.gate = asyncio.Event()
        """A ``None`` in a script waits here (a worker that has not answered yet)."""

    def start(self, j: Job) -> AsyncGenerator[TokenEvent, None]:
        return self._events(j.index)

    async def _events(self, index: int) -> AsyncGenerator[TokenEvent, None]:
        try:
            for item in self.scripts[index]:
                if item is None:
                    await self.gate.wait()
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            self.closed.append(index)


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def record(registry: CollectorRegistry) -> RequestMetrics:
    return RequestMetrics(Metrics(registry))


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    got = registry.get_sample_value(name, labels)
    return 0.0 if got is None else got


def outcome(registry: CollectorRegistry, what: str) -> float:
    return value(registry, "splitserve_requests_total", outcome=what)


async def events_of(j: Job, w: Workers, record: RequestMetrics, **kw: Any) -> list[str]:
    return [piece.text async for piece in streaming.choice_events(j, w.start, record, **kw)]


async def test_a_choice_gives_text_deltas_and_records_its_metrics(
    registry: CollectorRegistry, record: RequestMetrics
) -> None:
    j = job()
    w = Workers([ev(1, 2), ev(3), ev(4, finish="length")])
    times = iter([1.0, 2.0, 4.0, 4.0])  # one reading per event, then the end
    assert await events_of(j, w, record, clock=lambda: next(times)) == ["bc", "d", "e"]
    assert (j.tokens, j.finish_reason, j.first_at, w.closed) == ([1, 2, 3, 4], "length", 1.0, [0])
    assert value(registry, "splitserve_prompt_tokens_total") == 3
    assert value(registry, "splitserve_generation_tokens_total") == 4
    assert value(registry, "splitserve_time_to_first_token_seconds_sum") == 1.0
    assert value(registry, "splitserve_e2e_request_latency_seconds_sum") == 4.0
    # three tokens after the first, in the 3 s from the first to the last
    assert value(registry, "splitserve_time_per_output_token_seconds_sum") == 1.0
    assert outcome(registry, "success") == 1


async def test_a_stop_string_ends_the_choice_and_its_stream(
    registry: CollectorRegistry, record: RequestMetrics
) -> None:
    j = job(stop=("d",))
    w = Workers([ev(1, 2), ev(3, 4), ev(5), ev(6, finish="length")])
    assert await events_of(j, w, record) == ["bc", ""]
    assert j.finish_reason == "stop" and j.detok.text == "bc" and w.closed == [0]
    assert outcome(registry, "success") == 1


async def test_a_consumer_that_leaves_closes_the_stream_as_cancelled(
    registry: CollectorRegistry, record: RequestMetrics
) -> None:
    w = Workers([ev(1), ev(2), ev(3, finish="length")])
    gen = streaming.choice_events(job(), w.start, record)
    assert (await anext(gen)).text == "b"
    await gen.aclose()
    assert w.closed == [0] and outcome(registry, "cancelled") == 1


@pytest.mark.parametrize(
    ("error", "label"),
    [(RequestFailed(502, "gone"), "error"), (Saturated("decode", 503, 2, "full"), "rejected")],
)
async def test_failures_are_raised_and_counted(
    registry: CollectorRegistry, record: RequestMetrics, error: Exception, label: str
) -> None:
    w = Workers([ev(1), error])
    with pytest.raises(type(error)):
        await events_of(job(), w, record)
    assert w.closed == [0] and outcome(registry, label) == 1


async def test_n_choices_merge_as_they_come_and_all_end(record: RequestMetrics) -> None:
    jobs = choices_of(job(), 2)
    w = Workers([ev(1), None, ev(2, finish="length")], [ev(3), ev(4, finish="stop")])
    got: list[tuple[int, str]] = []
    async for j, piece in streaming.merged(jobs, w.start, record):
        got.append((j.index, piece.text))
        if len(got) == 3:
            w.gate.set()  # choice 0 answers again only once choice 1 has finished
    assert sorted(got) == [(0, "b"), (0, "c"), (1, "d"), (1, "e")]
    assert got[-1] == (0, "c") and sorted(w.closed) == [0, 1]
    assert [j.finish_reason for j in jobs] == ["length", "stop"]


async def test_one_failed_choice_fails_the_merge_and_stops_the_others(
    registry: CollectorRegistry, record: RequestMetrics
) -> None:
    jobs = choices_of(job(), 2)
    w = Workers([ev(1), None, ev(2, finish="length")], [RequestFailed(502, "lost")])
    with pytest.raises(RequestFailed, match="lost"):
        async for _ in streaming.merged(jobs, w.start, record):
            pass
    assert sorted(w.closed) == [0, 1]
    assert outcome(registry, "error") == 1 and outcome(registry, "cancelled") == 1


def lines(body: list[bytes]) -> list[Any]:
    out: list[Any] = []
    for raw in body:
        text = raw.decode()
        assert text.startswith("data: ") and text.endswith("\n\n"), text
        data = text[len("data: ") : -2]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def test_a_chat_stream_sends_the_role_the_pieces_the_usage_then_done(
    record: RequestMetrics,
) -> None:
    jobs = choices_of(job("chat.completion", include_usage=True), 2)
    # both choices run ahead of the stream: choice 0 has finished before its first chunk
    # is sent, which must still carry no finish reason
    w = Workers([ev(1), ev(2, finish="length")], [ev(3, finish="stop")])
    got = lines([b async for b in streaming.sse_stream(jobs, w.start, record)])
    assert [c["index"] for c in got[0]["choices"]] == [0, 1]
    assert all(c["delta"] == {"role": "assistant", "content": ""} for c in got[0]["choices"])
    assert {c["object"] for c in got[:-1]} == {"chat.completion.chunk"}
    pieces = [(c["choices"][0]["index"], c["choices"][0]["delta"].get("content"),
               c["choices"][0]["finish_reason"]) for c in got[1:-2]]  # fmt: skip
    assert sorted(pieces) == [(0, "b", None), (0, "c", "length"), (1, "d", "stop")]
    # the prompt once (both choices answer the same prompt), every choice's tokens
    assert got[-2]["choices"] == [] and got[-2]["usage"] == {
        "prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}  # fmt: skip
    assert got[-1] == "[DONE]"


async def test_the_echo_goes_first_and_a_held_back_piece_is_not_sent(
    record: RequestMetrics,
) -> None:
    j = job(echo="abc")
    w = Workers([ev(1), ev(2, finish="length")])
    # a piece whose text is held back (no new text, not final) and nothing else asked
    assert streaming.stream_chunk([j], j, streaming.Piece("", ev(7), final=False)) is None
    got = lines([b async for b in streaming.sse_stream([j], w.start, record)])
    assert [c["choices"][0]["text"] for c in got[:-1]] == ["abcb", "c"]


async def test_a_failure_mid_stream_ends_it_with_an_error_chunk(
    registry: CollectorRegistry, record: RequestMetrics
) -> None:
    w = Workers([ev(1), RequestFailed(502, "the request failed on 3 workers")])
    got = lines([b async for b in streaming.sse_stream([job()], w.start, record)])
    assert got[0]["choices"][0]["text"] == "b"
    assert got[1]["error"] == {
        "message": "the request failed on 3 workers",
        "type": "server_error",
        "param": None,
        "code": "worker_error",
    }
    assert got[2] == "[DONE]" and outcome(registry, "error") == 1


async def test_a_batch_answers_every_choice_and_counts_each_prompt_once(
    record: RequestMetrics,
) -> None:
    first, second = job(prompt=(1, 2)), job(prompt=(3, 4, 5), index=2, prompt_index=1)
    jobs = [*choices_of(first, 2), *choices_of(second, 2)]
    w = Workers(*[[ev(i + 1, finish="length")] for i in range(4)])

    async def connected() -> bool:
        return False

    answer = await streaming.run_to_end(jobs, w.start, record, connected)
    assert answer is not None
    assert [(c["index"], c["text"]) for c in answer["choices"]] == [
        (0, "b"), (1, "c"), (2, "d"), (3, "e")]  # fmt: skip
    assert answer["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}


async def test_a_client_that_went_away_ends_every_choice(
    registry: CollectorRegistry, record: RequestMetrics
) -> None:
    jobs = choices_of(job(), 2)
    w = Workers([None, ev(1, finish="length")], [None, ev(2, finish="length")])
    asked = asyncio.Event()

    async def gone() -> bool:
        asked.set()
        return True

    assert await streaming.run_to_end(jobs, w.start, record, gone, poll_s=0.01) is None
    assert asked.is_set() and sorted(w.closed) == [0, 1]
    assert outcome(registry, "cancelled") == 2


async def test_a_failed_choice_fails_the_whole_answer(record: RequestMetrics) -> None:
    jobs = choices_of(job(), 2)
    w = Workers([None], [Saturated("decode", 429, 1, "the decode queue is full")])

    async def connected() -> bool:
        return False

    with pytest.raises(Saturated):
        await streaming.run_to_end(jobs, w.start, record, connected)
    assert sorted(w.closed) == [0, 1]


async def test_slots_are_taken_for_every_choice_or_for_none() -> None:
    stage = Stage("decode", capacity=1, max_waiting=0, max_wait_s=1.0)
    jobs = choices_of(job(), 2)
    with pytest.raises(Saturated):
        await streaming.admit(jobs, stage)
    assert stage.active == 0
    await streaming.admit(jobs[:1], stage)
    assert stage.active == 1
    streaming.release(jobs[:1])
    streaming.release(jobs[:1])  # a slot is given back once, whoever releases it
    assert stage.active == 0

"""A request's choices run on the workers and turned into its OpenAI answer: each choice's
text deltas as its token events come (recorded in the metrics), the choices of ``n``
(and of a batch of prompts) merged as they come, the SSE stream, and the whole answer of
a request that is not streamed.

Plain functions of the request's :class:`~splitserve_worker.router.responses.Job`\\ s and
a :data:`Start` that opens one job's event stream (the dispatcher's, through
:func:`dispatch_start`; tests pass their own), so none needs the HTTP app.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Send

from splitserve_worker.router.dispatch import Dispatcher, GenRequest, TokenEvent
from splitserve_worker.router.errors import error_body, from_failure
from splitserve_worker.router.failures import RequestFailed
from splitserve_worker.router.queues import Saturated, Stage
from splitserve_worker.router.request_metrics import Outcome, RequestMetrics
from splitserve_worker.router.responses import (
    Job,
    choice,
    chunk,
    echo_scores,
    envelope,
    response,
    role_choice,
    sse,
    usage,
)

log = logging.getLogger(__name__)

Start = Callable[[Job], AsyncGenerator[TokenEvent, None]]
"""Opens one job's stream of token events; it raises :class:`Saturated` or
:class:`RequestFailed` when the job cannot be served, and closing it ends the job on the
workers."""

DONE = b"data: [DONE]\n\n"
"""The last line of every stream, after the answer or its error."""

DISCONNECT_POLL_S = 0.25
"""How often a request that is not streamed checks whether its client went away."""

DEFAULT_BACKLOG = 1024
"""Pieces (token events) a stream may have waiting for its client, all choices together
(``queues.max_stream_backlog``)."""


def dispatch_start(dispatcher: Dispatcher) -> Start:
    """Jobs run by ``dispatcher``: each choice of a request under an id of its own, in the
    decode slot taken for it before a stream's 200 (else it waits for one)."""

    def start(job: Job) -> AsyncGenerator[TokenEvent, None]:
        rid = job.id if job.index == 0 else f"{job.id}-{job.index}"
        return dispatcher.generate(GenRequest(rid, job.prompt, job.sampling), job.admission)

    return start


@dataclass(frozen=True)
class Piece:
    """What one token event added to a choice."""

    text: str
    """The text that became final with it (none while half a character is held back)."""
    event: TokenEvent
    final: bool
    """It ended the choice (its finish reason is ``job.finish_reason``)."""


def take(job: Job, ev: TokenEvent) -> str:
    """Add one event's tokens to ``job``; the text they add. Sets ``job.finish_reason``
    when the event ends the choice: ``stop`` when a stop string appeared, else the
    worker's finish reason on its last event."""
    final = ev.finish_reason is not None
    text = job.detok.add(ev.token_ids, final=final)
    job.tokens.extend(ev.token_ids)
    job.logprobs.extend(ev.logprobs)
    job.top_logprobs.extend(ev.top_logprobs)
    if ev.prompt_logprobs is not None:
        job.prompt_scores = ev.prompt_logprobs
    if job.detok.stopped:
        job.finish_reason = "stop"
    elif final:
        job.finish_reason = ev.finish_reason
    return text


async def choice_events(
    job: Job,
    start: Start,
    record: RequestMetrics,
    clock: Callable[[], float] = time.monotonic,
) -> AsyncGenerator[Piece, None]:
    """The pieces of one choice until it ends; records its metrics, and however it ends
    (the consumer leaving included), closes its stream on the workers."""
    record.started(job)
    outcome = Outcome.CANCELLED
    events = start(job)
    try:
        async for ev in events:
            now = clock()
            if job.first_at is None and ev.token_ids:
                job.first_at = now
                record.first_token(job, now)
            text = take(job, ev)
            record.generated(len(ev.token_ids))
            final = job.finish_reason is not None
            yield Piece(text, ev, final)
            if final:
                break
        record.finished(job, clock())
        outcome = Outcome.SUCCESS
    except Saturated:
        outcome = Outcome.REJECTED
        raise
    except RequestFailed:
        outcome = Outcome.ERROR
        raise
    finally:
        await events.aclose()
        record.ended(outcome)


class TooSlow(RequestFailed):
    """The client let more of its stream wait than the router holds for it."""


async def merged(
    jobs: Sequence[Job], start: Start, record: RequestMetrics, backlog: int = DEFAULT_BACKLOG
) -> AsyncGenerator[tuple[Job, Piece], None]:
    """The pieces of every choice as they come; ends when all have, or raises the first
    failure (and then no choice runs on). Each choice runs ahead of what was taken from
    here (each piece says itself whether it was its choice's last), by at most
    ``backlog`` pieces in all: a consumer further behind (a client that stopped reading)
    gets :class:`TooSlow` once it reads again, and meanwhile every choice is ended on the
    workers, its KV and decode slot freed."""
    queue: asyncio.Queue[tuple[Job, Piece] | None] = asyncio.Queue()
    waiting = 0
    """Pieces in the queue: what the consumer has yet to take."""
    failure: list[BaseException] = []

    def fail(e: BaseException) -> None:
        if not failure:
            failure.append(e)
        queue.put_nowait(None)  # wake the consumer

    async def pump(job: Job) -> None:
        nonlocal waiting
        try:
            async with contextlib.aclosing(choice_events(job, start, record)) as evs:
                async for piece in evs:
                    if waiting >= backlog:
                        log.warning("stream %s: its client stopped reading; ended", job.id)
                        raise TooSlow(
                            499,
                            f"the client left {waiting} pieces of its stream unread, more than "
                            f"the router holds for it ({backlog}); the request was ended",
                        )
                    waiting += 1
                    queue.put_nowait((job, piece))
            queue.put_nowait(None)
        except Exception as e:  # handed to the consumer, which raises it
            fail(e)

    tasks = [asyncio.create_task(pump(j)) for j in jobs]
    try:
        ended = 0
        while ended < len(jobs):
            if failure:
                raise failure[0]
            item = await queue.get()
            if item is None:
                ended += 1
                continue
            waiting -= 1
            yield item
        if failure:
            raise failure[0]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def stream_chunk(jobs: Sequence[Job], job: Job, piece: Piece) -> bytes | None:
    """The SSE chunk ``piece`` of ``job`` adds to the stream of ``jobs``, or ``None`` when
    it adds nothing to send yet (text held back as half a character, with neither token
    ids nor logprobs asked for)."""
    if not (piece.text or piece.final or job.return_token_ids or job.want_logprobs):
        return None
    text, job.echo = job.echo + piece.text, ""
    # the prompt's logprobs go with the echo, in the first chunk
    scores, job.prompt_scores = echo_scores(job), None
    ev = piece.event
    c = choice(job, text, list(ev.token_ids), list(ev.logprobs), piece.final,
               list(ev.top_logprobs), scores)  # fmt: skip
    return sse(chunk(jobs, [c]))


async def sse_stream(
    jobs: Sequence[Job], start: Start, record: RequestMetrics, backlog: int = DEFAULT_BACKLOG
) -> AsyncIterator[bytes]:
    """The whole SSE body of a streamed request run as ``jobs``: a chat's role chunk,
    every choice's chunks as they come, the usage when asked for, then ``[DONE]``. A
    failure ends the stream with an error chunk in the OpenAI shape (the 200 is sent),
    and so does a fault of the router's own (logged with the request id): a stream that
    started always ends with ``[DONE]``, never with a cut connection."""
    try:
        if jobs[0].kind == "chat.completion":
            yield sse(chunk(jobs, [role_choice(j) for j in jobs]))
        async with contextlib.aclosing(merged(jobs, start, record, backlog)) as evs:
            async for job, piece in evs:
                line = stream_chunk(jobs, job, piece)
                if line is not None:
                    yield line
        if jobs[0].include_usage:
            body = envelope(jobs[0], [])
            body["usage"] = usage(jobs)
            yield sse(body)
    except (Saturated, RequestFailed) as e:
        yield sse(from_failure(e).body())
    except Exception:  # a fault of the router's own: logged whole, said in the stream
        log.exception("stream %s failed in the router", jobs[0].id)
        message = f"the router failed to serve this request; its error is logged under {jobs[0].id}"
        yield sse(error_body(500, message, code="internal_error"))
    yield DONE


class SSEResponse(StreamingResponse):
    """A streamed answer that closes its stream however the response ends (sent whole,
    the client gone, the connection cut): the request's choices end on the workers then,
    not whenever the stream is collected."""

    async def stream_response(self, send: Send) -> None:
        body = self.body_iterator
        try:
            await super().stream_response(send)
        finally:
            close = getattr(body, "aclose", None)
            if close is not None:
                await close()


async def run_to_end(
    jobs: Sequence[Job],
    start: Start,
    record: RequestMetrics,
    disconnected: Callable[[], Awaitable[bool]],
    poll_s: float = DISCONNECT_POLL_S,
) -> dict[str, Any] | None:
    """The whole answer of a request run as ``jobs``, or ``None`` when ``disconnected()``
    said the client went away first. Raises the first choice's :class:`Saturated` or
    :class:`RequestFailed`; whatever ends the wait, no choice runs on."""

    async def collect(job: Job) -> None:
        async with contextlib.aclosing(choice_events(job, start, record)) as evs:
            async for _ in evs:
                pass

    tasks = [asyncio.create_task(collect(j)) for j in jobs]
    try:
        pending: set[asyncio.Task[None]] = set(tasks)
        while pending:
            done, pending = await asyncio.wait(
                pending, timeout=poll_s, return_when=asyncio.FIRST_EXCEPTION
            )
            for t in done:
                t.result()  # a choice that failed fails the request
            if pending and not done and await disconnected():
                return None
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return response(jobs)


async def admit(jobs: Sequence[Job], stage: Stage) -> None:
    """A decode slot for each job before a stream's 200 is sent, so a full queue answers
    429 and a queue timeout 503 as HTTP statuses. Raises :class:`Saturated` with no slot
    left taken."""
    try:
        for j in jobs:
            j.admission = await stage.admit()
    except Saturated:
        release(jobs)
        raise


def release(jobs: Sequence[Job]) -> None:
    """Free the slots :func:`admit` took (those a stream has not freed already)."""
    for j in jobs:
        if j.admission is not None:
            j.admission.release()

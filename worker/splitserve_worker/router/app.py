"""The OpenAI-compatible HTTP API (FastAPI): completions, chat, models, health, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from splitserve.metric_names import (
    E2E,
    GENERATION_TOKENS,
    PROMPT_TOKENS,
    REQUESTS,
    TPOT,
    TTFT,
)
from splitserve.roles import DECODE_ROLES
from starlette.background import BackgroundTask

from splitserve_worker.router import errors, jobs, tokens
from splitserve_worker.router.api_models import ChatCompletionRequest, CompletionRequest
from splitserve_worker.router.body_limit import BodyLimit
from splitserve_worker.router.dispatch import GenRequest, TokenEvent
from splitserve_worker.router.errors import APIError
from splitserve_worker.router.failures import RequestFailed
from splitserve_worker.router.queues import Saturated
from splitserve_worker.router.responses import (
    Job,
    choice,
    choices_of,
    chunk,
    echo_scores,
    envelope,
    response,
    role_choice,
    sse,
    usage,
)
from splitserve_worker.router.service import RouterService


def _auth(service: RouterService) -> Callable[[Request], Awaitable[None]]:
    async def check(request: Request) -> None:
        key = service.config.api_key
        if not key:
            return
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip(), key):
            raise APIError(
                401,
                "missing or wrong API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )

    return check


def create_app(service: RouterService) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await service.start()
        try:
            yield
        finally:
            await service.stop()

    app = FastAPI(title="splitserve router", version="1", lifespan=lifespan)
    errors.install(app)
    app.add_middleware(BodyLimit, limit=service.config.max_request_bytes)
    auth = Depends(_auth(service))
    cfg = service.config
    m = service.metrics
    ttft, tpot, e2e = m.histogram(TTFT), m.histogram(TPOT), m.histogram(E2E)
    outcomes, prompt_tokens, gen_tokens = (
        m.counter(REQUESTS),
        m.counter(PROMPT_TOKENS),
        m.counter(GENERATION_TOKENS),
    )

    # ---- helpers ----

    def make_job(
        kind: str,
        body: CompletionRequest | ChatCompletionRequest,
        prompt: list[int],
        job_id: str | None = None,
    ) -> Job:
        return jobs.make_job(kind, body, prompt, cfg, service.tokenizer, job_id)

    async def events(job: Job) -> AsyncGenerator[tuple[str, TokenEvent], None]:
        """(text delta, event) pairs; records metrics; always ends the worker side."""
        prompt_tokens.inc(len(job.prompt))
        outcome = "cancelled"
        rid = job.id if job.index == 0 else f"{job.id}-{job.index}"
        gen = service.dispatcher.generate(GenRequest(rid, job.prompt, job.sampling), job.admission)
        try:
            async for ev in gen:
                now = time.monotonic()
                if job.first_at is None and ev.token_ids:
                    job.first_at = now
                    ttft.observe(now - job.arrived)
                final = ev.finish_reason is not None
                text = job.detok.add(ev.token_ids, final=final)
                job.tokens.extend(ev.token_ids)
                job.logprobs.extend(ev.logprobs)
                job.top_logprobs.extend(ev.top_logprobs)
                if ev.prompt_logprobs is not None:
                    job.prompt_scores = ev.prompt_logprobs
                gen_tokens.inc(len(ev.token_ids))
                if job.detok.stopped:
                    job.finish_reason = "stop"
                    yield text, ev
                    break
                if final:
                    job.finish_reason = ev.finish_reason
                yield text, ev
                if final:
                    break
            end = time.monotonic()
            e2e.observe(end - job.arrived)
            if job.first_at is not None and len(job.tokens) > 1:
                tpot.observe((end - job.first_at) / (len(job.tokens) - 1))
            outcome = "success"
        except Saturated:
            outcome = "rejected"
            raise
        except RequestFailed:
            outcome = "error"
            raise
        finally:
            await gen.aclose()
            outcomes.labels(outcome=outcome).inc()

    def failure(e: Saturated | RequestFailed) -> APIError:
        if isinstance(e, Saturated):
            return errors.from_saturated(e)
        return APIError(e.status, e.message, code="worker_error" if e.status >= 500 else None)

    async def run_to_end(request: Request, jobs: list[Job]) -> dict[str, Any] | None:
        """The whole answer, or None when the client went away first (the request is ended)."""

        async def collect(job: Job) -> None:
            async with contextlib.aclosing(events(job)) as evs:
                async for _ in evs:
                    pass

        tasks = [asyncio.create_task(collect(j)) for j in jobs]
        try:
            pending: set[asyncio.Task[None]] = set(tasks)
            while pending:
                done, pending = await asyncio.wait(
                    pending, timeout=0.25, return_when=asyncio.FIRST_EXCEPTION
                )
                for t in done:
                    t.result()  # a choice that failed fails the request
                if pending and not done and await request.is_disconnected():
                    return None
        except (Saturated, RequestFailed) as e:
            raise failure(e) from None
        finally:
            # whatever ended the wait (a failure, the client leaving), no choice runs on
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return response(jobs)

    async def merged(jobs: list[Job]) -> AsyncGenerator[tuple[Job, str, TokenEvent], None]:
        """The events of every choice as they come; ends when all have (or one fails)."""
        if len(jobs) == 1:
            async with contextlib.aclosing(events(jobs[0])) as evs:
                async for text, ev in evs:
                    yield jobs[0], text, ev
            return
        queue: asyncio.Queue[tuple[Job, str, TokenEvent] | BaseException | None] = asyncio.Queue()

        async def pump(job: Job) -> None:
            try:
                async with contextlib.aclosing(events(job)) as evs:
                    async for text, ev in evs:
                        await queue.put((job, text, ev))
                await queue.put(None)
            except Exception as e:  # the stream reports it; the other choices stop
                await queue.put(e)

        tasks = [asyncio.create_task(pump(j)) for j in jobs]
        try:
            for _ in jobs:
                while (item := await queue.get()) is not None:
                    if isinstance(item, BaseException):
                        raise item
                    yield item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def run_streaming(jobs: list[Job]) -> AsyncIterator[bytes]:
        try:
            if jobs[0].kind == "chat.completion":
                yield sse(chunk(jobs, [role_choice(j) for j in jobs]))
            async with contextlib.aclosing(merged(jobs)) as evs:
                async for job, text, ev in evs:
                    final = job.finish_reason is not None
                    # a token whose text is held back (half a character) is still sent
                    # when its id or logprob was asked for
                    if not (text or final or job.return_token_ids or job.want_logprobs):
                        continue
                    text, job.echo = job.echo + text, ""
                    # the prompt's logprobs go with the echo, in the first chunk
                    scores, job.prompt_scores = echo_scores(job), None
                    ids, lps = list(ev.token_ids), list(ev.logprobs)
                    tops = list(ev.top_logprobs)
                    yield sse(chunk(jobs, [choice(job, text, ids, lps, final, tops, scores)]))
            if jobs[0].include_usage:
                body = envelope(jobs[0], [])
                body["usage"] = usage(jobs)
                yield sse(body)
        except (Saturated, RequestFailed) as e:
            yield sse(failure(e).body())
        yield b"data: [DONE]\n\n"

    async def respond(
        request: Request, prompts: list[Job], body: CompletionRequest | ChatCompletionRequest
    ) -> Response:
        """Run each prompt's ``n`` choices, streamed or as one answer."""
        jobs = [choice for job in prompts for choice in choices_of(job, body.n)]
        if body.stream:
            # admission first (a decode slot per choice, held for the stream), so a full
            # queue answers 429 and a queue timeout 503 as HTTP statuses, never as an error
            # inside a 200
            try:
                for j in jobs:
                    j.admission = await service.dispatcher.decode_stage.admit()
            except Saturated as e:
                release_all(jobs)
                raise failure(e) from None
            return StreamingResponse(
                run_streaming(jobs),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                # frees the slots if the stream never started (client gone before it)
                background=BackgroundTask(release_all, jobs),
            )
        answer = await run_to_end(request, jobs)
        if answer is None:
            return Response(status_code=499)  # client closed the request; nobody reads this
        return JSONResponse(answer)

    def release_all(jobs: list[Job]) -> None:
        for j in jobs:
            if j.admission is not None:
                j.admission.release()

    # ---- routes ----

    @app.post("/v1/completions", dependencies=[auth])
    async def completions(request: Request, body: CompletionRequest) -> Response:
        batch: list[Job] = []
        prompts = body.prompts()
        for i, given in enumerate(prompts):  # a batch: each prompt its n choices
            if isinstance(given, str):
                prompt = list(service.tokenizer(given, add_special_tokens=True)["input_ids"])
            else:
                prompt = list(given)
            try:
                job = make_job("text_completion", body, prompt, batch[0].id if batch else None)
            except APIError as e:
                if len(prompts) == 1:
                    raise
                raise APIError(e.status, f"prompt {i} of the batch: {e.message}",
                               param=e.param, code=e.code) from None  # fmt: skip
            job.index, job.prompt_index = i * body.n, i
            if body.echo:
                job.echo = (
                    given
                    if isinstance(given, str)
                    else service.tokenizer.decode(prompt, skip_special_tokens=True)
                )
            batch.append(job)
        return await respond(request, batch, body)

    @app.post("/v1/chat/completions", dependencies=[auth])
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        prompt = tokens.chat_prompt(service.tokenizer, cfg.model_name, body)
        job = make_job("chat.completion", body, prompt)
        job.echo = body.echoed()
        return await respond(request, [job], body)

    tokens.install(app, service, auth)

    card = {"id": cfg.model_name, "object": "model", "created": 0, "owned_by": "splitserve",
            "max_model_len": cfg.max_model_len}  # fmt: skip

    @app.get("/v1/models", dependencies=[auth])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}", dependencies=[auth])
    async def model(model_id: str) -> dict[str, Any]:
        """OpenAI's retrieve-a-model: the served model's card, or 404 for another name."""
        jobs.check_model(model_id, cfg)
        return card

    @app.get("/health")
    async def health() -> JSONResponse:
        snap = service.pool.snapshot()
        workers = [
            {
                "name": w.name,
                "role": w.role.value,
                "healthy": w.healthy,
                "free_blocks": w.free_blocks,
                "total_blocks": w.total_blocks,
                "running": w.running,
                "assigned": w.assigned,
            }
            for w in snap
        ]
        ok = any(w.healthy and w.role in DECODE_ROLES for w in snap)
        body = {"status": "ok" if ok else "no decode worker is healthy", "workers": workers}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(service.registry), media_type=CONTENT_TYPE_LATEST)

    return app

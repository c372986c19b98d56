"""The OpenAI-compatible HTTP API (FastAPI): the routes, and nothing but the routes.

Completions and chat become jobs (:mod:`.jobs`), run and answered by :mod:`.streaming`;
``/tokenize`` and ``/detokenize`` are in :mod:`.tokens`. Every route needs the API key
when one is configured, except those in :data:`OPEN_PATHS`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from splitserve.roles import DECODE_ROLES
from starlette.background import BackgroundTask

from splitserve_worker.router import errors, jobs, streaming, tokens
from splitserve_worker.router.api_key import require_api_key
from splitserve_worker.router.api_models import ChatCompletionRequest, CompletionRequest
from splitserve_worker.router.body_limit import BodyLimit
from splitserve_worker.router.catch_all import CatchAll
from splitserve_worker.router.failures import RequestFailed
from splitserve_worker.router.queues import Saturated
from splitserve_worker.router.request_metrics import RequestMetrics
from splitserve_worker.router.responses import Job, choices_of
from splitserve_worker.router.service import RouterService

OPEN_PATHS = frozenset({"/health", "/openapi.json", "/docs", "/docs/oauth2-redirect",
                        "/redoc"})  # fmt: skip
"""Routes served without the API key: ``/health`` (liveness and readiness probes, which
send no key: without the key it answers only its status, the workers' details need the
key) and the API's own description (FastAPI's OpenAPI schema and docs pages).
``/metrics`` needs the key when one is set; Prometheus scrapes the router's separate
``--metrics-port`` instead, which serves nothing else. A test sends every route of the
app without the key and holds the ones that answer to this list."""

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def create_app(service: RouterService) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await service.start()
        try:
            yield
        finally:
            await service.stop()

    app = FastAPI(title="splitserve router", version="1", lifespan=lifespan)
    app.state.http = service.config.http  # the server's connection bounds (http_server)
    errors.install(app)
    app.add_middleware(BodyLimit, limit=service.config.max_request_bytes)
    app.add_middleware(CatchAll)  # added last: the outermost, it sees what nothing answered
    api_key = Depends(require_api_key(service.config))
    cfg, tok = service.config, service.tokenizing
    start = streaming.dispatch_start(service.dispatcher)
    record = RequestMetrics(service.metrics)

    async def respond(
        request: Request, prompts: list[Job], body: CompletionRequest | ChatCompletionRequest
    ) -> Response:
        """Run each prompt's ``n`` choices, streamed or as one answer."""
        choices = [c for job in prompts for c in choices_of(job, body.n)]
        if body.stream:
            try:
                await streaming.admit(choices, service.dispatcher.decode_stage)
            except Saturated as e:
                raise errors.from_saturated(e) from None
            return streaming.SSEResponse(
                streaming.sse_stream(choices, start, record, cfg.queues.max_stream_backlog),
                media_type="text/event-stream",
                headers=SSE_HEADERS,
                # frees the slots if the stream never started (client gone before it)
                background=BackgroundTask(streaming.release, choices),
            )
        try:
            answer = await streaming.run_to_end(choices, start, record, request.is_disconnected)
        except (Saturated, RequestFailed) as e:
            raise errors.from_failure(e) from None
        if answer is None:
            return Response(status_code=499)  # client closed the request; nobody reads this
        return JSONResponse(answer)

    @app.post("/v1/completions", dependencies=[api_key])
    async def completions(request: Request, body: CompletionRequest) -> Response:
        return await respond(request, await jobs.completion_jobs(body, cfg, tok), body)

    @app.post("/v1/chat/completions", dependencies=[api_key])
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        prompt = await tok.chat(cfg.model_name, body)
        job = jobs.make_job("chat.completion", body, prompt, cfg, tok)
        job.echo = body.echoed()
        return await respond(request, [job], body)

    tokens.install(app, service, api_key)

    card = {"id": cfg.model_name, "object": "model", "created": 0, "owned_by": "splitserve",
            "max_model_len": cfg.max_model_len}  # fmt: skip

    @app.get("/v1/models", dependencies=[api_key])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}", dependencies=[api_key])
    async def model(model_id: str) -> dict[str, Any]:
        """OpenAI's retrieve-a-model: the served model's card, or 404 for another name."""
        jobs.check_model(model_id, cfg)
        return card

    check_key = require_api_key(service.config)

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        """Ready (200) while a decode worker is healthy, else 503; the workers' details
        only to a caller with the API key (or to anyone when none is set)."""
        snap = service.pool.snapshot()
        ok = any(w.healthy and w.role in DECODE_ROLES for w in snap)
        status = "ok" if ok else "no decode worker is healthy"
        code = 200 if ok else 503
        try:
            await check_key(request)
        except errors.APIError:
            return JSONResponse({"status": status}, status_code=code)
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
        return JSONResponse({"status": status, "workers": workers}, status_code=code)

    @app.get("/metrics", dependencies=[api_key])
    async def metrics() -> Response:
        return Response(generate_latest(service.registry), media_type=CONTENT_TYPE_LATEST)

    return app

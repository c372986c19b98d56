"""One huge request costs only itself: a text longer than any prompt the model accepts is
refused before it is tokenized, with the router's memory bounded, and what is tokenized
runs off the event loop, so other streams go on while it does."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from mem_workers import MemWorker, mem_router
from splitserve_worker.router.app import create_app
from tiny_models import tiny_tokenizer

pytestmark = pytest.mark.unit

GUARD_S = 20.0
"""A hang guard only."""


class SpyTokenizer:
    """The tiny tokenizer, recording what it was asked to tokenize (and on which thread);
    on one prompt it blocks until released."""

    BLOCKING = "hold the tokenizer"

    def __init__(self) -> None:
        self._inner = tiny_tokenizer()
        self.lengths: list[int] = []
        self.threads: list[int] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        self.timed_out = False

    def __len__(self) -> int:
        return len(self._inner)

    def __call__(self, text: str, **kw: Any) -> Any:
        self.lengths.append(len(text))
        self.threads.append(threading.get_ident())
        if text == self.BLOCKING:
            self.entered.set()
            self.timed_out = not self.release.wait(GUARD_S)
        return self._inner(text, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@asynccontextmanager
async def router(tok: SpyTokenizer, **cfg: Any) -> AsyncIterator[httpx.AsyncClient]:
    service = mem_router([MemWorker("b1", "both")], tok, max_model_len=256, **cfg)
    app: FastAPI = create_app(service)
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://r", timeout=GUARD_S) as c,
    ):
        assert await service.wait_ready(GUARD_S)
        yield c


def peak_rss_reset() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts from now


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/self/status")


async def test_a_text_too_long_for_any_prompt_is_refused_unread() -> None:
    """An 8 MB prompt for a model of 256 tokens: answered 400 without the tokenizer ever
    seeing it (it used to be tokenized on the event loop first, for tens of seconds and
    gigabytes at tens of megabytes)."""
    tok = SpyTokenizer()
    big = "All work and no play. " * (8_000_000 // 22)
    async with router(tok) as c:
        limit = 256 * 5 * 2  # max_model_len x the longest token (5 characters) x 2
        peak_rss_reset()
        before = rss_kib("VmRSS")
        r = await c.post("/v1/completions", json={"prompt": big, "max_tokens": 4})
        grown_mib = (rss_kib("VmHWM") - before) / 1024
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
        assert f"no text of more than {limit} characters" in err["message"]
        chat = {"messages": [{"role": "user", "content": big}]}
        r = await c.post("/v1/chat/completions", json=chat)
        assert r.json()["error"]["code"] == "context_length_exceeded", r.text
        r = await c.post("/tokenize", json={"prompt": big})
        assert r.json()["error"]["code"] == "context_length_exceeded", r.text
        r = await c.post("/v1/completions", json={"prompt": ["ok", big]})
        assert "prompt 1 of the batch" in r.json()["error"]["message"]
    assert max(tok.lengths, default=0) <= limit, "a text past the bound was tokenized"
    # the body, its JSON text and a few copies in the client and the app; never the
    # tokens of 8 million characters
    assert grown_mib < 25 * 8, f"the router's memory grew {grown_mib:.0f} MiB for an 8 MB prompt"


async def test_tokenizing_runs_off_the_event_loop_while_other_streams_flow() -> None:
    """While one request's prompt is being tokenized (held here until released), another
    request is served from start to end."""
    tok = SpyTokenizer()
    async with router(tok) as c:
        held = asyncio.create_task(
            c.post("/v1/completions", json={"prompt": SpyTokenizer.BLOCKING, "max_tokens": 2})
        )
        assert await asyncio.to_thread(tok.entered.wait, GUARD_S), "the held request never came"
        other = await c.post(
            "/v1/completions", json={"prompt": "hi", "max_tokens": 6, "stream": True}
        )
        served_while_held = not tok.release.is_set() and not tok.timed_out
        tok.release.set()
        assert (await held).status_code == 200
    assert other.status_code == 200 and other.text.endswith("data: [DONE]\n\n")
    assert other.text.count('"text"') >= 6
    assert served_while_held, "the other request waited for the held tokenizer"
    assert threading.get_ident() not in tok.threads, "the event loop's thread tokenized"

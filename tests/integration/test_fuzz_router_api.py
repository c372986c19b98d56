"""Fuzzing the OpenAI API: no 5xx ever, and every 4xx explains itself in the OpenAI shape.

The router app runs under uvicorn on 127.0.0.1 in front of a real ``both`` worker on
the tiny model (both in a background event loop); hypothesis sends bodies that range
from random JSON to near-valid requests with edge values, and raw bytes.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fuzz_profiles import scaled
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TOKEN = "fuzz-api-token"


@pytest.fixture(scope="module")
def base_url(tiny_model_path: Path) -> Iterator[str]:
    import torch
    from splitserve.roles import Role
    from splitserve_worker.commands.router import load_tokenizer
    from splitserve_worker.commands.up import serve_router
    from splitserve_worker.models import load_model
    from splitserve_worker.router.app import create_app
    from splitserve_worker.router.config import RouterConfig
    from splitserve_worker.router.discovery import StaticDiscovery, WorkerEndpoint
    from splitserve_worker.router.service import RouterService
    from splitserve_worker.server.app import start_worker
    from splitserve_worker.server.config import WorkerConfig

    torch.set_num_threads(1)
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    holder: dict[str, Any] = {}
    ready = threading.Event()

    async def main() -> None:
        try:
            cfg = WorkerConfig(role="both", model=str(tiny_model_path), token=TOKEN,
                               num_blocks=256, threads=1)  # fmt: skip
            w = await start_worker(cfg, loaded=load_model(str(tiny_model_path)))
            rcfg = RouterConfig.from_mapping({
                "model_name": "tiny", "worker_token": TOKEN, "max_model_len": 256,
                "queues": {"max_wait_s": 5.0}})  # fmt: skip
            ep = WorkerEndpoint(name=f"both@{w.address}", role=Role.BOTH, address=w.address)
            service = RouterService(rcfg, load_tokenizer(str(tiny_model_path)),
                                    StaticDiscovery([ep]))  # fmt: skip
            server, task, port = await serve_router(create_app(service), "127.0.0.1", 0)
            assert await service.wait_ready(30)
            holder["url"] = f"http://127.0.0.1:{port}"
        except BaseException as e:
            holder["error"] = e
            ready.set()
            return
        ready.set()
        await stop.wait()
        server.should_exit = True
        await asyncio.wait_for(task, 10)
        await w.stop(0.2)

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert ready.wait(120), "the router did not start"
    if "error" in holder:
        raise holder["error"]
    yield holder["url"]
    loop.call_soon_threadsafe(stop.set)
    thread.join(20)


def check(r: httpx.Response) -> None:
    assert r.status_code < 500, f"{r.status_code}: {r.text[:500]}"
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"].strip(), r.text
        assert isinstance(err["type"], str) and err["type"], r.text
        assert set(err) >= {"message", "type", "param", "code"}, r.text
        return
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        lines = [ln for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert lines and lines[-1] == "data: [DONE]", r.text[-300:]
        for ln in lines[:-1]:
            chunk = json.loads(ln[6:])
            if "error" in chunk:
                raise AssertionError(f"an error inside a 200 stream: {chunk}")
            assert "choices" in chunk
        return
    if r.request.url.path.endswith("completions"):
        body = r.json()
        assert body["choices"] and "usage" in body, r.text


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=8,
)  # fmt: skip
INTS = st.integers(-3, 300) | st.integers(-(2**64), 2**64) | JSON
FLOATS = st.floats(-3, 3, allow_nan=False) | JSON
TOKENS = st.lists(st.integers(-2, 300) | st.integers(2**31 - 2, 2**63), max_size=12)
STOP = st.none() | st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=20) | JSON
COMMON = {
    "model": st.sampled_from(["tiny", "", "other"]) | JSON,
    "max_tokens": st.integers(-2, 300) | JSON | st.integers(10**6, 10**7),
    "temperature": FLOATS,
    "top_p": FLOATS,
    "top_k": INTS,
    "seed": INTS,
    "stop": STOP,
    "n": INTS,
    "stream": st.booleans() | JSON,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | JSON,
    "presence_penalty": FLOATS,
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(-1, 40) | JSON,
    "return_token_ids": st.booleans(),
    "user": st.text(max_size=10) | JSON,
    "logit_bias": st.none() | st.dictionaries(st.text(max_size=3), st.floats(-2, 2), max_size=2),
    "prompt_logprobs": st.none() | st.integers(-1, 22) | JSON,
}
COMPLETION = st.fixed_dictionaries(
    {"prompt": st.text(max_size=40) | TOKENS | st.lists(TOKENS, max_size=2)
               | st.lists(st.text(max_size=5), max_size=2) | JSON},
    optional={**COMMON, "logprobs": st.none() | st.integers(-1, 3) | JSON,
              "echo": st.booleans(), "suffix": st.none() | st.text(max_size=3),
              "best_of": INTS},
)  # fmt: skip
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "developer"]) | JSON,
     "content": st.text(max_size=30)
                | st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                  "text": st.text(max_size=10)}), max_size=2)
                | JSON},
    optional={"name": st.text(max_size=5)},
)  # fmt: skip
CHAT = st.fixed_dictionaries(
    {"messages": st.lists(MESSAGE, max_size=3) | JSON},
    optional={**COMMON, "logprobs": st.booleans() | JSON, "top_logprobs": INTS,
              "max_completion_tokens": st.integers(-1, 300) | JSON},
)  # fmt: skip
SANE = {
    "model": st.just("tiny"),
    "max_tokens": st.integers(1, 40),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 50),
    "seed": st.integers(0, 2**63 - 1),
    "stop": st.none() | st.text(min_size=1, max_size=3)
            | st.lists(st.text(min_size=1, max_size=3), max_size=3),
    "stream": st.booleans(),
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 5),
    "return_token_ids": st.booleans(),
    "prompt_logprobs": st.none() | st.integers(0, 2),
}  # fmt: skip
NEAR_VALID_COMPLETION = st.fixed_dictionaries(
    {"prompt": st.text(min_size=1, max_size=40) | st.lists(st.integers(0, 258), min_size=1,
                                                            max_size=40)},
    optional={**SANE, "logprobs": st.none() | st.integers(0, 1)},
)  # fmt: skip
NEAR_VALID_CHAT = st.fixed_dictionaries(
    {"messages": st.lists(st.fixed_dictionaries({
        "role": st.sampled_from(["user", "system", "assistant"]),
        "content": st.text(max_size=30)}), min_size=1, max_size=3)},
    optional={**SANE, "logprobs": st.booleans(), "max_completion_tokens": st.integers(1, 30)},
)  # fmt: skip
FUZZ = settings(
    max_examples=scaled(80), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@FUZZ
@given(body=NEAR_VALID_COMPLETION | COMPLETION | JSON)
def test_completions_never_5xx(base_url: str, body: Any) -> None:
    with httpx.Client(timeout=60) as c:
        check(c.post(f"{base_url}/v1/completions", json=body))


@FUZZ
@given(body=NEAR_VALID_CHAT | CHAT | JSON)
def test_chat_completions_never_5xx(base_url: str, body: Any) -> None:
    with httpx.Client(timeout=60) as c:
        check(c.post(f"{base_url}/v1/chat/completions", json=body))


@settings(max_examples=scaled(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/x",
                          "/", "/v1/completions/", "/health"]),
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
    raw=st.binary(max_size=64),
    ctype=st.sampled_from(["application/json", "text/plain", "",
                           "application/x-www-form-urlencoded"]),
)  # fmt: skip
def test_raw_bytes_any_method_any_path_never_5xx(
    base_url: str, path: str, method: str, raw: bytes, ctype: str
) -> None:
    headers = {"Content-Type": ctype} if ctype else {}
    with httpx.Client(timeout=60) as c:
        r = c.request(method, f"{base_url}{path}", content=raw, headers=headers)
    if path == "/health" and method == "GET":
        assert r.status_code == 200
        return
    check(r)


def test_known_edge_requests_are_refused_with_a_reason(base_url: str) -> None:
    cases = [
        {"prompt": [300]},  # past the vocabulary
        {"prompt": "x", "max_tokens": 10**6},  # past max_model_len
        {"prompt": [5] * 300},  # prompt longer than max_model_len
        {"prompt": "x", "n": 17},  # more choices than a request may ask for
        {"prompt": "x", "temperature": -1},
        {"prompt": "x", "model": "other"},
        {"prompt": "x", "stream_options": {"include_usage": True}},
    ]
    with httpx.Client(timeout=60) as c:
        for body in cases:
            r = c.post(f"{base_url}/v1/completions", json=body)
            assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
            check(r)

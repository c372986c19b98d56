"""Requests built to break the router get a 4xx in the OpenAI shape that names the field,
never a 500 and never a worker's time: text that is not Unicode, numbers no wire carries,
values of the wrong JSON type; and a fault of the router's own is a 500 in the same shape
on a connection that stays open."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from mem_workers import MemWorker, mem_router
from raw_http import connect, read_answer, request_bytes
from splitserve_worker.router.app import create_app
from splitserve_worker.router.config import QueueConfig, RouterConfig
from splitserve_worker.router.discovery import StaticDiscovery, parse_static
from splitserve_worker.router.local import RouterThread
from splitserve_worker.router.service import RouterService
from tiny_models import tiny_tokenizer

pytestmark = pytest.mark.unit

LONE = "\\ud800"
"""A lone surrogate as JSON spells it: valid JSON, not valid text."""


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def client(tokenizer: Any) -> Iterator[TestClient]:
    config = RouterConfig(model_name="tiny", max_model_len=256,
                          queues=QueueConfig(max_wait_s=0.2))  # fmt: skip
    disc = StaticDiscovery(parse_static("decode=127.0.0.1:9"))  # nobody listens: no worker
    app = create_app(RouterService(config, tokenizer, disc))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def post_raw(c: TestClient, path: str, body: str) -> Any:
    return c.post(path, content=body.encode(), headers={"content-type": "application/json"})


def error_of(r: Any, status: int) -> dict[str, Any]:
    """The OpenAI error of an answer (TestClient's or httpx's)."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return dict(err)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", f'{{"prompt": "a{LONE}b"}}', "prompt"),
        ("/v1/completions", f'{{"prompt": ["fine", "{LONE}"]}}', "prompt"),
        ("/v1/completions", f'{{"prompt": "hi", "stop": "{LONE}"}}', "stop"),
        ("/v1/completions", f'{{"prompt": "hi", "stop": ["x", "{LONE}"]}}', "stop"),
        ("/v1/chat/completions",
         f'{{"messages": [{{"role": "user", "content": "{LONE}"}}]}}', "messages"),
        ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": '
         f'[{{"type": "text", "text": "{LONE}"}}]}}]}}', "messages"),
        ("/v1/chat/completions",
         f'{{"messages": [{{"role": "user", "content": "hi"}}], "stop": ["{LONE}"]}}', "stop"),
        ("/tokenize", f'{{"prompt": "{LONE}"}}', "prompt"),
        ("/tokenize", f'{{"messages": [{{"role": "user", "content": "x{LONE}"}}]}}', "messages"),
    ],
)  # fmt: skip
def test_a_lone_surrogate_anywhere_in_the_text_is_a_400(
    client: TestClient, path: str, body: str, param: str
) -> None:
    """It used to be a 500 in text/plain (the tokenizer or protobuf cannot encode it),
    or, in a stop string, a healthy decode worker marked unhealthy."""
    err = error_of(post_raw(client, path, body), 400)
    assert "lone surrogate" in err["message"] and err["param"].startswith(param), err


def test_a_logit_bias_key_too_long_for_a_token_id_is_a_400(client: TestClient) -> None:
    """4,301 digits is past what ``int()`` converts: it used to escape as a 500."""
    body = {"prompt": "hi", "logit_bias": {"7" * 4301: 1.0}}
    err = error_of(client.post("/v1/completions", json=body), 400)
    assert err["param"] == "logit_bias" and "4301 digits" in err["message"]


def test_tokenize_a_chat_with_the_tokenizers_special_tokens(
    client: TestClient, tokenizer: Any
) -> None:
    """``messages`` with ``add_special_tokens: true`` always failed (500): the templated
    text is tokenized with the tokenizer's special tokens added."""
    chat = [{"role": "user", "content": "name a colour"}]
    r = client.post("/tokenize", json={"messages": chat, "add_special_tokens": True})
    assert r.status_code == 200, r.text
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert r.json()["tokens"] == tokenizer(text, add_special_tokens=True)["input_ids"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": "2"}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": True}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2.5}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "n": "2"}, "n"),
        ("/v1/completions", {"prompt": "hi", "stream": "true"}, "stream"),
        ("/v1/completions", {"prompt": "hi", "temperature": "0.5"}, "temperature"),
        ("/v1/completions", {"prompt": "hi", "temperature": False}, "temperature"),
        ("/v1/completions", {"prompt": "hi", "logprobs": True}, "logprobs"),
        ("/v1/completions", {"prompt": [1, "2"]}, "prompt"),
        ("/v1/chat/completions",
         {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": "4"},
         "max_completion_tokens"),
        ("/detokenize", {"tokens": [1.0, 2]}, "tokens"),
        ("/detokenize", {"tokens": [True]}, "tokens"),
    ],
)  # fmt: skip
def test_values_of_the_wrong_json_type_are_not_coerced(
    client: TestClient, path: str, body: dict[str, Any], param: str
) -> None:
    err = error_of(client.post(path, json=body), 400)
    assert err["param"] is not None and err["param"].startswith(param), err


def test_an_integer_is_a_number(client: TestClient) -> None:
    """Strict where the API is typed, not stricter: ``temperature: 1`` is a number."""
    r = client.post("/v1/completions", json={"prompt": [1], "temperature": 1, "max_tokens": 1})
    assert error_of(r, 503)["code"] == "queue_timeout"  # valid: it waited for a worker


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("repetition_penalty", 1e308, "less than or equal to 100"),
        ("top_p", 1e-50, "as the 32-bit float the wire carries"),
        ("min_p", 1e-50, None),
    ],
)
def test_numbers_are_checked_as_the_worker_will_receive_them(
    client: TestClient, field: str, value: float, words: str | None
) -> None:
    """``repetition_penalty: 1e308`` was infinite on the worker; ``top_p: 1e-50`` is 0
    as a 32-bit float (refused there). The router says so before any worker is asked;
    a value that rounds to a valid one (``min_p``: 0) is served."""
    r = client.post("/v1/completions", json={"prompt": [1], field: value, "max_tokens": 1})
    if words is None:
        assert error_of(r, 503)["code"] == "queue_timeout"
        return
    err = error_of(r, 400)
    assert err["param"] == field and words in err["message"], err


class FaultyTokenizer:
    """The tiny tokenizer, with a fault of the router's own on one prompt."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __len__(self) -> int:
        return len(self._inner)

    def __call__(self, text: str, **kw: Any) -> Any:
        if text == "trip the fault":
            raise RuntimeError("test: a fault in the router")
        return self._inner(text, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def test_a_fault_of_the_router_is_a_500_in_the_openai_shape_on_a_kept_open_connection(
    tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    service = mem_router([MemWorker("b1", "both")], FaultyTokenizer(tokenizer))
    with RouterThread(service) as base, caplog.at_level(logging.ERROR):
        port = int(base.rsplit(":", 1)[1])
        sock = connect(port)
        try:
            sock.sendall(request_bytes("POST", "/v1/completions", {"prompt": "trip the fault"}))
            first = read_answer(sock)
            assert first.status == 500 and first.headers["content-type"] == "application/json"
            err = first.json()["error"]
            assert err["type"] == "server_error" and err["code"] == "internal_error"
            rid = first.headers["x-request-id"]
            assert rid in err["message"]
            assert first.headers.get("connection", "").lower() != "close"
            # the same connection serves the next request
            sock.sendall(request_bytes("POST", "/v1/completions",
                                       {"prompt": [1, 2], "max_tokens": 2}))  # fmt: skip
            second = read_answer(sock)
            assert second.status == 200, second.body
            assert len(json.loads(second.body)["choices"][0]["text"]) >= 0
        finally:
            sock.close()
    logged = [r for r in caplog.records if rid in r.getMessage()]
    assert logged and logged[0].exc_info is not None, "the fault is not logged with its id"

"""The HTTP API without workers: validation, errors in the OpenAI shape, auth, queues."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from splitserve_worker.router.app import create_app
from splitserve_worker.router.config import QueueConfig, RouterConfig
from splitserve_worker.router.discovery import StaticDiscovery, parse_static
from splitserve_worker.router.service import RouterService

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_path))


def make_client(tokenizer: Any, **cfg: Any) -> TestClient:
    config = RouterConfig(model_name="tiny", max_model_len=256, **cfg)
    # a worker address nobody listens on: the router sees no healthy worker
    disc = StaticDiscovery(parse_static("decode=127.0.0.1:9"))
    return TestClient(create_app(RouterService(config, tokenizer, disc)))


@pytest.fixture
def client(tokenizer: Any) -> Iterator[TestClient]:
    with make_client(
        tokenizer, queues=QueueConfig(decode_max_waiting=1, max_wait_s=0.2, retry_after_s=2)
    ) as c:
        yield c


def error_of(r: Any, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    return err


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"model": "tiny"}, "prompt", "Field required"),
        ({"prompt": "hi", "n": 17}, "n", "less than or equal to 16"),
        ({"prompt": "hi", "logprobs": 21}, "logprobs", "less than or equal to 20"),
        ({"prompt": "hi", "temperature": 5}, "temperature", "less than or equal to 2"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ({"prompt": "hi", "bogus": 1}, "bogus", "Extra inputs are not permitted"),
        ({"prompt": ""}, "prompt", "must not be empty"),
        ({"prompt": []}, "prompt", "must not be empty"),
        ({"prompt": ["a"] * 65}, "prompt", "at most 64 prompts per request"),
        ({"prompt": ["a", ""]}, "prompt", "prompt 1 of the batch is empty"),
        ({"prompt": ["a"] * 5, "n": 16}, None, "prompts x n is 80 completions"),
        ({"prompt": [1, -3]}, "prompt", "greater than or equal to 0"),
        ({"prompt": "hi", "stop": [""]}, "stop", "must not be empty"),
        ({"prompt": "hi", "presence_penalty": 3}, "presence_penalty", "less than or equal to 2"),
        ({"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
        ({"prompt": "hi", "min_p": 1.5}, "min_p", "less than or equal to 1"),
        ({"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids", "greater than or equal"),
        ({"prompt": "hi", "messages": []}, "messages", "belongs to /v1/chat/completions"),
        ({"prompt": "hi", "logit_bias": {"five": 1.0}}, "logit_bias", "must be token ids"),
        ({"prompt": "hi", "logit_bias": {"²": 1.0}}, "logit_bias", "must be token ids"),
        ({"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias", "must be in [-100, 100]"),
        ({"prompt": "hi", "logit_bias": {"9999": 1}}, "logit_bias", "outside the vocabulary"),
        ({"prompt": [[5], [9999]]}, "prompt", "prompt 1 of the batch: token id 9999 is outside"),
        ({"prompt": "hi", "stream_options": {"include_usage": True}}, None, "only allowed"),
        ({"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs", "less than or equal to 20"),
        ({"prompt": "hi", "prompt_logprobs": 1, "stream": True}, None, "not available with"),
    ],
)
def test_bad_completion_requests_say_what_is_wrong(
    client: TestClient, body: dict[str, Any], param: str | None, words: str
) -> None:
    err = error_of(client.post("/v1/completions", json=body), 400)
    assert words in err["message"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] is not None and err["param"].startswith(param)


@pytest.mark.parametrize(
    ("content", "content_type", "words"),
    [
        (b'{"prompt": ', "application/json", "not valid JSON: Expecting value at character 11"),
        (b"", "application/json", "the request body is empty"),
        (b"[1, 2]", "application/json", "must be a JSON object, not an array"),
        (b'"hi"', "application/json", "must be a JSON object, not a string"),
        (b'{"prompt": "hi"}', "application/x-www-form-urlencoded", "Content-Type: application/"),
    ],
)
def test_a_body_that_is_not_a_json_object_says_so(
    client: TestClient, content: bytes, content_type: str, words: str
) -> None:
    r = client.post("/v1/completions", content=content, headers={"content-type": content_type})
    err = error_of(r, 400)
    assert words in err["message"] and err["param"] is None


def test_the_sampling_options_load_generators_send_are_accepted(client: TestClient) -> None:
    """What vLLM's and SGLang's serving benchmarks and GuideLLM put in every request:
    valid, so it waits for a worker (none answers here) rather than failing validation."""
    vllm_bench = {"model": "tiny", "prompt": "hi", "repetition_penalty": 1.0, "max_tokens": 4,
                  "logprobs": None, "stream": True, "stream_options": {"include_usage": True},
                  "ignore_eos": True}  # fmt: skip
    sglang_bench = {"model": "tiny", "prompt": "hi", "temperature": 0.0, "best_of": 1,
                    "max_tokens": 4, "stream": True, "ignore_eos": True}  # fmt: skip
    usage_always = {"include_usage": True, "continuous_usage_stats": True}
    guidellm = {"model": "tiny", "prompt": "hi", "max_tokens": 4, "stop": None,
                "ignore_eos": True, "stream": True, "stream_options": usage_always}  # fmt: skip
    tuned = {"prompt": "hi", "presence_penalty": 0.5, "frequency_penalty": 0.3, "min_p": 0.05,
             "repetition_penalty": 1.1, "stop_token_ids": [2], "top_k": 20}  # fmt: skip
    for body in (vllm_bench, sglang_bench, guidellm, tuned):
        r = client.post("/v1/completions", json=body)
        assert r.status_code != 400, r.text
        assert r.status_code in (429, 503), r.text
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4,
            "stream": True, "stream_options": {"include_usage": True},
            "repetition_penalty": 1.0}  # fmt: skip
    r = client.post("/v1/chat/completions", json=chat)
    assert r.status_code in (429, 503), r.text
    err = error_of(client.post("/v1/chat/completions", json={**chat, "prompt": "x"}), 400)
    assert "belongs to /v1/completions" in err["message"]


def test_limits_checked_against_model_and_vocabulary(client: TestClient, tokenizer: Any) -> None:
    err = error_of(client.post("/v1/completions", json={"prompt": [1] * 300}), 400)
    assert err["code"] == "context_length_exceeded" and "300 tokens" in err["message"]
    err = error_of(
        client.post("/v1/completions", json={"prompt": [1] * 200, "max_tokens": 100}), 400
    )
    assert err["param"] == "max_tokens"
    err = error_of(client.post("/v1/completions", json={"prompt": [len(tokenizer) + 5]}), 400)
    assert "outside the vocabulary" in err["message"]
    bad_stop = {"prompt": [1], "stop_token_ids": [len(tokenizer)]}
    err = error_of(client.post("/v1/completions", json=bad_stop), 400)
    assert err["param"] == "stop_token_ids" and "outside the vocabulary" in err["message"]
    err = error_of(
        client.post("/v1/completions", json={"prompt": [1], "max_tokens": 2, "min_tokens": 3}),
        400,
    )
    assert err["param"] == "min_tokens"


def test_unknown_model_is_404(client: TestClient) -> None:
    err = error_of(client.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404)
    assert err["code"] == "model_not_found" and "'tiny'" in err["message"]


def test_bad_chat_requests(client: TestClient) -> None:
    err = error_of(client.post("/v1/chat/completions", json={"messages": []}), 400)
    assert err["param"] == "messages"
    bad_role = {"messages": [{"role": "wizard", "content": "hi"}]}
    assert error_of(client.post("/v1/chat/completions", json=bad_role), 400)["param"].startswith(
        "messages.0.role"
    )
    lp = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}
    assert error_of(client.post("/v1/chat/completions", json=lp), 400)["param"] == "top_logprobs"
    no_lp = {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}
    err = error_of(client.post("/v1/chat/completions", json=no_lp), 400)
    assert "top_logprobs needs logprobs: true" in err["message"]
    # no function calling: what SDKs send without tools is accepted, tools are refused
    hi = {"messages": [{"role": "user", "content": "hi"}]}
    none = {**hi, "tools": [], "tool_choice": "none", "parallel_tool_calls": False}
    assert client.post("/v1/chat/completions", json=none).status_code in (429, 503)
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    err = error_of(client.post("/v1/chat/completions", json={**hi, "tools": [tool]}), 400)
    assert "function calling is not served here" in err["message"]
    err = error_of(client.post("/v1/chat/completions", json={**hi, "tool_choice": "required"}),
                   400)  # fmt: skip
    assert err["param"] == "tool_choice"
    err = error_of(client.post("/v1/chat/completions", json={**hi, "functions": []}), 400)
    assert "function calling is not served here" in err["message"] and err["param"] == "functions"
    err = error_of(client.post("/v1/completions", json={"prompt": "x", "guided_json": {}}), 400)
    assert "constrained decoding is not served here" in err["message"]


def test_unknown_route_and_method(client: TestClient) -> None:
    error_of(client.get("/v1/nothing"), 404)
    error_of(client.get("/v1/completions"), 405)


def test_models_health_metrics_openapi(client: TestClient) -> None:
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert client.get("/v1/models/tiny").json() == models["data"][0]
    err = error_of(client.get("/v1/models/org/other"), 404)
    assert err["code"] == "model_not_found" and "'org/other'" in err["message"]
    h = client.get("/health")
    assert h.status_code == 503 and h.json()["workers"][0]["healthy"] is False
    text = client.get("/metrics").text
    assert "splitserve_decode_queue_depth" in text
    assert "splitserve_time_to_first_token_seconds_bucket" in text
    spec = client.get("/openapi.json").json()
    assert "/v1/completions" in spec["paths"] and "/v1/chat/completions" in spec["paths"]


def test_no_capacity_waits_bounded_then_503_with_retry_after(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
    err = error_of(r, 503)
    assert r.headers["retry-after"] == "2" and err["code"] == "queue_timeout"
    assert "requests_total" in client.get("/metrics").text


async def test_full_queue_is_429_with_retry_after(tokenizer: Any) -> None:
    import asyncio

    import httpx

    config = RouterConfig(model_name="tiny", queues=QueueConfig(decode_max_waiting=1, max_wait_s=3))
    disc = StaticDiscovery(parse_static("decode=127.0.0.1:9"))
    app = create_app(RouterService(config, tokenizer, disc))
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c,
    ):
        # one request waits (no capacity), so the queue of one is full for the next
        waiter = asyncio.create_task(c.post("/v1/completions", json={"prompt": [1]}))
        for _ in range(100):
            await asyncio.sleep(0.01)
            r = await c.post("/v1/completions", json={"prompt": [1], "max_tokens": 1})
            if r.status_code == 429:
                break
        err = error_of(r, 429)
        assert r.headers["retry-after"] == "1" and err["type"] == "rate_limit_error"
        r = await c.post("/v1/completions", json={"prompt": [1], "stream": True})
        assert error_of(r, 429)["code"] == "queue_full"
        assert (await asyncio.wait_for(waiter, 10)).status_code == 503


def test_api_key(tokenizer: Any) -> None:
    with make_client(tokenizer, api_key="s3cret") as c:
        err = error_of(c.get("/v1/models"), 401)
        assert err["code"] == "invalid_api_key"
        error_of(c.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        assert c.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        bare = c.get("/health")  # open to probes, and says no worker is ready
        assert bare.status_code == 503 and bare.json() == {"status": "no decode worker is healthy"}
        full = c.get("/health", headers={"Authorization": "Bearer s3cret"})
        assert full.status_code == 503 and full.json()["workers"][0]["name"] == "decode@127.0.0.1:9"
        assert error_of(c.get("/metrics"), 401)["code"] == "invalid_api_key"
        r = c.get("/metrics", headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200 and "splitserve_" in r.text


def test_health_shows_the_workers_to_anyone_when_no_key_is_set(tokenizer: Any) -> None:
    with make_client(tokenizer) as c:
        assert c.get("/health").json()["workers"][0]["healthy"] is False
        assert c.get("/metrics").status_code == 200


def test_the_router_serves_metrics_alone_on_its_metrics_port() -> None:
    from prometheus_client import CollectorRegistry, Counter
    from splitserve_worker.commands.router import serve_metrics

    registry = CollectorRegistry()
    Counter("splitserve_probe_total", "a counter", registry=registry).inc()
    server = serve_metrics("127.0.0.1", 0, registry)
    try:
        got = httpx.get(f"http://127.0.0.1:{server.port}/metrics").text
        assert "splitserve_probe_total 1.0" in got
        with pytest.raises(OSError, match="choose another --metrics-port"):
            serve_metrics("127.0.0.1", server.port, registry)
    finally:
        server.close()


def test_every_route_needs_the_key_unless_documented_open(tokenizer: Any) -> None:
    """Each route of the app, found by walking ``app.routes`` (so a new one cannot
    escape), is refused without the key and served with it, unless it is one of the
    documented open routes; every documented open route exists and answers without it."""
    from splitserve_worker.router.app import OPEN_PATHS

    key = {"Authorization": "Bearer s3cret"}
    with make_client(tokenizer, api_key="s3cret") as c:
        app: Any = c.app
        routes = [(m, r.path) for r in app.routes for m in sorted(getattr(r, "methods", ()))]
        paths = {p for _, p in routes}
        assert {"/v1/completions", "/detokenize", "/v1/models/{model_id:path}"} <= paths
        assert paths >= OPEN_PATHS, f"open routes the app does not have: {OPEN_PATHS - paths}"
        open_now = set()
        for method, path in routes:
            url = path.replace("{model_id:path}", "tiny")
            without = c.request(method, url)
            if without.status_code != 401:
                open_now.add(path)
                continue
            assert without.json()["error"]["code"] == "invalid_api_key", (method, path)
            assert c.request(method, url, headers=key).status_code != 401, (method, path)
        assert open_now == OPEN_PATHS, "routes served without the key: document them or guard them"


def test_tokenize_and_detokenize_use_the_served_tokenizer(tokenizer: Any) -> None:
    """vLLM's ``/tokenize`` and ``/detokenize``: the ids completions and chat would send."""
    from splitserve_worker.router.api_models import ChatTemplating
    from splitserve_worker.router.tokenizer_pool import chat_prompt

    with make_client(tokenizer, api_key="k") as c:
        key = {"Authorization": "Bearer k"}
        error_of(c.post("/tokenize", json={"prompt": "hi"}), 401)
        r = c.post("/tokenize", json={"prompt": "Once upon a time", "return_token_strs": True},
                   headers=key)  # fmt: skip
        assert r.status_code == 200, r.text
        ids = tokenizer("Once upon a time")["input_ids"]
        assert r.json() == {"count": len(ids), "max_model_len": 256, "tokens": ids,
                            "token_strs": tokenizer.convert_ids_to_tokens(ids)}  # fmt: skip
        chat = [{"role": "user", "content": "name a colour"}]
        r = c.post("/tokenize", json={"model": "tiny", "messages": chat}, headers=key)
        want = chat_prompt(tokenizer, "tiny", ChatTemplating.model_validate({"messages": chat}))
        assert r.json()["tokens"] == want and r.json()["token_strs"] is None
        r = c.post("/detokenize", json={"tokens": ids}, headers=key)
        assert r.json() == {"prompt": tokenizer.decode(ids)}
        # what is wrong is said
        err = error_of(c.post("/detokenize", json={"tokens": [5, 10**6]}, headers=key), 400)
        assert "outside the vocabulary" in err["message"] and err["param"] == "tokens"
        err = error_of(c.post("/tokenize", json={"model": "tiny"}, headers=key), 400)
        assert "either prompt or messages" in err["message"]
        error_of(c.post("/tokenize", json={"prompt": "x", "messages": chat}, headers=key), 400)
        assert error_of(c.post("/tokenize", json={"prompt": "x", "model": "other"},
                               headers=key), 404)["code"] == "model_not_found"  # fmt: skip


def test_chat_template_options_shape_the_prompt(tokenizer: Any) -> None:
    """vLLM's chat options: ``add_generation_prompt``, ``continue_final_message`` (the
    answer continues the assistant's last message) and ``chat_template_kwargs`` (more
    variables for the template), as /tokenize shows the prompt chat completions send."""
    import copy

    templated = copy.deepcopy(tokenizer)
    templated.chat_template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
        "{% if not (continue_final_message and loop.last) %}</{{ m.role }}>{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
        "{% if mood %}[{{ mood }}]{% endif %}"
    )

    def text(c: TestClient, **body: Any) -> str:
        r = c.post("/tokenize", json=body)
        assert r.status_code == 200, r.text
        return str(templated.decode(r.json()["tokens"]))

    chat = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi the"}]
    with make_client(templated) as c:
        assert (
            text(c, messages=chat) == "<user>Say hi</user><assistant>Hi the</assistant><assistant>"
        )
        assert text(c, messages=chat, add_generation_prompt=False).endswith("Hi the</assistant>")
        opened = text(c, messages=chat, add_generation_prompt=False, continue_final_message=True)
        assert opened == "<user>Say hi</user><assistant>Hi the"
        kwargs = {"chat_template_kwargs": {"mood": "calm"}}
        assert text(c, messages=chat[:1], **kwargs) == "<user>Say hi</user><assistant>[calm]"
        # the same checks on both endpoints, each saying what is wrong
        for route in ("/tokenize", "/v1/chat/completions"):
            err = error_of(c.post(route, json={"messages": chat, "continue_final_message": True}),
                           400)  # fmt: skip
            assert "needs add_generation_prompt: false" in err["message"]
            ends_with_user = {"messages": chat[:1], "continue_final_message": True,
                              "add_generation_prompt": False}  # fmt: skip
            err = error_of(c.post(route, json=ends_with_user), 400)
            assert "an assistant message last" in err["message"]
            reserved = {"messages": chat, "chat_template_kwargs": {"tokenize": True}}
            assert (
                "may not set ['tokenize']" in error_of(c.post(route, json=reserved), 400)["message"]
            )
        # a template that raises is the request's problem, said as such
        broken = copy.deepcopy(tokenizer)
        broken.chat_template = "{{ raise_exception('only one turn') if messages|length > 1 }}"
    with make_client(broken) as c:
        err = error_of(c.post("/v1/chat/completions", json={"messages": chat}), 400)
        assert "refused the chat" in err["message"] and "only one turn" in err["message"]
    with make_client(tokenizer) as c:
        plain = {"messages": chat[:1], "response_format": {"type": "text"}}
        assert c.post("/v1/chat/completions", json=plain).status_code in (429, 503)
        json_mode = {**plain, "response_format": {"type": "json_object"}}
        err = error_of(c.post("/v1/chat/completions", json=json_mode), 400)
        assert err["param"].startswith("response_format")


def test_a_body_over_the_limit_is_413_declared_or_chunked(tokenizer: Any) -> None:
    queues = QueueConfig(max_wait_s=0.2, retry_after_s=1)
    with make_client(tokenizer, max_request_bytes=2000, queues=queues) as c:
        big = {"prompt": [5] * 1000}  # about 3 KB of JSON
        err = error_of(c.post("/v1/completions", json=big), 413)
        assert "larger than this router accepts (2000 bytes" in err["message"]
        raw = json.dumps(big).encode()

        def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
            for i in range(0, len(raw), 500):
                yield raw[i : i + 500]

        headers = {"Content-Type": "application/json"}
        r = c.post("/v1/completions", content=chunks(), headers=headers)
        assert "larger than this router accepts" in error_of(r, 413)["message"]
        # under the limit the request goes on, to the queue (no worker is up here)
        small = {"prompt": [5] * 10, "max_tokens": 1}
        assert error_of(c.post("/v1/completions", json=small), 503)["code"] == "queue_timeout"
        assert c.post("/tokenize", json={"prompt": "x" * 3000}).status_code == 413

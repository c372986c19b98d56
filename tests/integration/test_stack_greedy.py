"""Greedy completions through the router equal transformers' generate, for disaggregated,
colocated and mixed stacks of real worker processes on 127.0.0.1 (with and without a
repetition penalty). What OpenAI clients and load generators send is in
``test_stack_api``."""

from __future__ import annotations

import json
import re
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from splitserve.roles import Role
from splitserve_worker.commands.up import WorkerProcs
from splitserve_worker.kv.transport import unavailable_reason
from splitserve_worker.router.config import QueueConfig
from splitserve_worker.router.discovery import WorkerEndpoint
from splitserve_worker.router.local import RouterThread
from stack_kit import (  # noqa: F401  (fixtures)
    ALWAYS_REMOTE,
    MAX_TOKENS,
    PROMPTS,
    complete,
    decisions,
    generate_reference,
    reference_fixture,
    router,
    tokenizer_fixture,
    workers_fixture,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PENALTY = 1.5
NIXL_SKIP = unavailable_reason("nixl")


@pytest.fixture(scope="module")
def penalized(tiny_model_path: Path) -> list[list[int]]:
    return generate_reference(tiny_model_path, repetition_penalty=PENALTY)


@pytest.fixture(scope="module")
def bias(reference: list[list[int]]) -> dict[int, float]:
    """Ban each prompt's first greedy token and lift one other a little: every answer
    changes, and the lifted token wins at some steps only."""
    out = {ref[0]: -100.0 for ref in reference}
    out[101] = 1.0
    return out


@pytest.fixture(scope="module")
def biased(tiny_model_path: Path, bias: dict[int, float]) -> list[list[int]]:
    return generate_reference(tiny_model_path, sequence_bias={(t,): b for t, b in bias.items()})


@pytest.fixture(scope="module")
def nixl_workers(tiny_model_path: Path) -> Iterator[tuple[str, WorkerProcs]]:
    token = secrets.token_hex(8)
    roles = [Role.PREFILL, Role.DECODE]
    with WorkerProcs(str(tiny_model_path), roles, token, threads=1, kv_backend="nixl",
                     extra_args=["--metrics-port", "0"], echo=False) as procs:  # fmt: skip
        procs.start(timeout_s=300)
        yield token, procs


def stack_router(
    stack: str, workers: tuple[str, list[WorkerEndpoint]], tokenizer: Any
) -> RouterThread:
    """A router over the module's workers: ``disaggregated`` (prefill + decode, every
    request moved), ``to-colocated`` (prefill + the ``both`` worker, every request moved
    into the colocated worker, as a switchable pair mid-rebalance does), ``colocated``
    (the ``both`` worker) or ``mixed`` (all three)."""
    token, eps = workers
    by_role = {e.role: e for e in eps}
    if stack in ("disaggregated", "to-colocated"):
        into = Role.DECODE if stack == "disaggregated" else Role.BOTH
        return router(token, tokenizer, [by_role[Role.PREFILL], by_role[into]],
                      disaggregation=ALWAYS_REMOTE)  # fmt: skip
    if stack == "colocated":
        return router(token, tokenizer, [by_role[Role.BOTH]])
    return router(token, tokenizer, eps)


@pytest.mark.parametrize("stack", ["disaggregated", "to-colocated", "colocated", "mixed"])
def test_greedy_tokens_equal_transformers(
    stack: str, workers: tuple[str, list[WorkerEndpoint]], tokenizer: Any, reference: Any
) -> None:
    rt = stack_router(stack, workers, tokenizer)
    with rt as base:
        for prompt, want in zip(PROMPTS, reference, strict=True):
            assert complete(base, prompt, stream=False) == want
            assert complete(base, prompt, stream=True) == want
        made = decisions(base)
    if stack in ("disaggregated", "to-colocated"):
        assert made.get("remote", 0) == 2 * len(PROMPTS) and made.get("local", 0) == 0
    elif stack == "colocated":
        assert made.get("local", 0) == 2 * len(PROMPTS) and made.get("remote", 0) == 0
    else:
        assert sum(made.values()) == 2 * len(PROMPTS)


@pytest.mark.parametrize("stack", ["disaggregated", "colocated"])
def test_repetition_penalty_tokens_equal_transformers(
    stack: str,
    workers: tuple[str, list[WorkerEndpoint]],
    tokenizer: Any,
    reference: Any,
    penalized: Any,
) -> None:
    """The prefill worker penalises the prompt for the first token, the decode worker the
    prompt and output for the rest: together, what transformers' generate does."""
    assert penalized != reference, "the penalty changes no token: pick a stronger one"
    rt = stack_router(stack, workers, tokenizer)
    with rt as base:
        for prompt, want in zip(PROMPTS, penalized, strict=True):
            assert complete(base, prompt, stream=True, repetition_penalty=PENALTY) == want


@pytest.mark.parametrize("stack", ["disaggregated", "colocated"])
def test_logit_bias_tokens_equal_transformers(
    stack: str,
    workers: tuple[str, list[WorkerEndpoint]],
    tokenizer: Any,
    reference: Any,
    bias: dict[int, float],
    biased: Any,
) -> None:
    """OpenAI's logit_bias against transformers' sequence_bias of single tokens: the
    prefill worker biases the first token, the decode worker the rest."""
    assert all(b != r for b, r in zip(biased, reference, strict=True))
    assert any(101 in b for b in biased), "the lift never wins: pick a stronger one"
    rt = stack_router(stack, workers, tokenizer)
    as_json = {str(t): b for t, b in bias.items()}
    with rt as base:
        for prompt, want in zip(PROMPTS, biased, strict=True):
            assert complete(base, prompt, stream=True, logit_bias=as_json) == want
            assert complete(base, prompt, stream=False, logit_bias=as_json) == want


@pytest.mark.nixl
@pytest.mark.skipif(NIXL_SKIP is not None, reason=NIXL_SKIP or "")
def test_greedy_tokens_equal_transformers_over_nixl(
    nixl_workers: tuple[str, WorkerProcs], tokenizer: Any, reference: Any
) -> None:
    """What `splitserve up --kv-backend nixl` runs: the router reserves with kv_backend=nixl
    and every prompt's KV moves by NIXL writes, none over gRPC."""
    token, procs = nixl_workers
    eps = [wp.endpoint for wp in procs.procs]
    with router(token, tokenizer, eps, disaggregation=ALWAYS_REMOTE, kv_backend="nixl") as base:
        for prompt, want in zip(PROMPTS, reference, strict=True):
            assert complete(base, prompt, stream=True) == want
        made = decisions(base)
    assert made.get("remote", 0) == len(PROMPTS) and made.get("local", 0) == 0
    moved = {}
    for wp in procs.procs:
        assert wp.metrics_port is not None
        moved.update(_kv_bytes(httpx.get(f"http://127.0.0.1:{wp.metrics_port}/metrics").text))
    assert moved.get(("nixl", "sent"), 0) > 0, moved
    assert moved.get(("nixl", "received")) == moved[("nixl", "sent")], moved
    assert not any(backend == "grpc" and n for (backend, _), n in moved.items()), moved


def _kv_bytes(text: str) -> dict[tuple[str, str], float]:
    """KV bytes a worker moved, by (backend, direction), from its Prometheus text."""
    found = re.findall(
        r'splitserve_kv_transfer_bytes_total\{backend="(\w+)",direction="(\w+)"\} (\S+)', text
    )
    return {(b, d): float(v) for b, d, v in found}


def test_chat_and_text_prompt_through_disaggregated_stack(
    workers: tuple[str, list[WorkerEndpoint]], tokenizer: Any
) -> None:
    with stack_router("disaggregated", workers, tokenizer) as base:
        r = httpx.post(
            f"{base}/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 5,
                "temperature": 0,
                "ignore_eos": True,
                "logprobs": True,
            },
            timeout=120,
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["role"] == "assistant"
        assert len(body["choices"][0]["logprobs"]["content"]) == 5
        assert all(t["logprob"] <= 0 for t in body["choices"][0]["logprobs"]["content"])
        assert body["usage"]["completion_tokens"] == 5
        r = httpx.post(
            f"{base}/v1/completions",
            json={
                "prompt": "hello",
                "max_tokens": 4,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
            timeout=120,
        )
        chunks = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
        # an answer that continues the assistant's last message, which echo puts first:
        # the same tokens as completions on the prompt /tokenize gives for that chat
        chat = {"messages": [{"role": "user", "content": "hello"},
                             {"role": "assistant", "content": "Hello! How"}],
                "add_generation_prompt": False, "continue_final_message": True}  # fmt: skip
        ids = httpx.post(f"{base}/tokenize", json=chat, timeout=60).json()["tokens"]
        assert tokenizer.decode(ids).endswith("Hello! How")  # the turn is left open
        greedy = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{base}/v1/completions", json={"prompt": ids, **greedy}, timeout=120)
        continued = r.json()["choices"][0]["text"]
        for stream in (False, True):
            body = {**chat, **greedy, "echo": True, "stream": stream}
            r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            if stream:
                deltas = [json.loads(ln[6:])["choices"][0]["delta"] for ln in r.text.splitlines()
                          if ln.startswith("data: {")]  # fmt: skip
                content = "".join(d.get("content") or "" for d in deltas)
            else:
                content = r.json()["choices"][0]["message"]["content"]
            assert content == "Hello! How" + continued


def test_prefix_index_follows_the_workers_block_events(
    workers: tuple[str, list[WorkerEndpoint]], tokenizer: Any
) -> None:
    from splitserve.prefix_hash import block_hashes

    prefill = next(e for e in workers[1] if e.role is Role.PREFILL)
    prompt = [(i * 13) % 200 + 7 for i in range(70)]  # 4 full blocks of 16
    hashes = block_hashes(prompt, 16)
    rt = stack_router("disaggregated", workers, tokenizer)
    with rt as base:
        assert rt.call(_match(rt, hashes)) == {}
        assert complete(base, prompt, stream=False)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            held = rt.call(_match(rt, hashes))
            if held.get(prefill.name) == 4:
                break
            time.sleep(0.1)
        assert held.get(prefill.name) == 4


async def _match(rt: RouterThread, hashes: list[int]) -> dict[str, int]:
    return rt.service.planner.index.match(hashes)


@pytest.mark.parametrize("stack", ["disaggregated", "colocated"])
def test_a_stream_outlives_its_worker_leaving_discovery(
    stack: str, workers: tuple[str, list[WorkerEndpoint]], tokenizer: Any
) -> None:
    """A pod being deleted leaves discovery while it drains: the router sends it nothing
    new, and the stream already running there goes on to its last token instead of being
    cut (and moved) when the router lets go of the worker."""

    async def forget_all(rt: RouterThread) -> None:
        rt.service.pool.set_endpoints([])

    n = 120
    token, eps = workers
    roles = (Role.PREFILL, Role.DECODE) if stack == "disaggregated" else (Role.BOTH,)
    rt = router(token, tokenizer, [e for e in eps if e.role in roles],
                disaggregation=ALWAYS_REMOTE, queues=QueueConfig(max_wait_s=1))  # fmt: skip
    with rt as base:
        body = {"prompt": PROMPTS[1], "max_tokens": n, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}  # fmt: skip
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
        expected = r.json()["choices"][0]["token_ids"]
        ids: list[int] = []
        finish = None
        with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True},
                          timeout=120) as r:  # fmt: skip
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                choice = json.loads(line[6:])["choices"][0]
                ids += choice.get("token_ids", [])
                finish = choice["finish_reason"] or finish
                if len(ids) >= 3 and rt.service.pool.snapshot():
                    rt.call(forget_all(rt))
        assert not rt.service.pool.snapshot()
        assert ids == expected and finish == "length"
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert r.status_code == 503  # nothing left to send new work to

"""Through the router over real worker processes, answers equal a reference made another
way: transformers' own ``generate`` for prompts of 700 to 4,000 tokens moved prefill ->
decode (through the router and through the worker client); the unstopped answer cut at a
stop string, streamed or not, colocated or disaggregated, with every block free after;
and choice ``i`` of a seeded request of ``n`` choices, the single request seeded
``seed + i``."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from splitserve.roles import Role
from splitserve.v1 import worker_pb2 as pb
from splitserve_worker.client import WorkerClient
from splitserve_worker.router.discovery import WorkerEndpoint
from splitserve_worker.router.local import RouterThread
from stack_kit import (  # noqa: F401  (fixtures)
    ALWAYS_REMOTE,
    decisions,
    router,
    tokenizer_fixture,
    workers_fixture,
)
from worker_kit import all_free, prompt_of, split_request

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LONG = (700, 2000, 4000)
"""Prompt lengths past the 600 tokens the other references stop at; 4,000 + 16 fits the
tiny model's 4,096 positions."""
LONG_NEW = 16
STOP_PROMPT = "The capital of France is"
STOP_NEW = 32
SEEDED = {"temperature": 1.0, "top_p": 0.9, "top_k": 40, "seed": 7}
STACKS = ["colocated", "disaggregated"]


@pytest.fixture(scope="module")
def long_reference(tiny_model_path: Path) -> list[list[int]]:
    """transformers' greedy ``generate`` of each long prompt (float32, EOS ignored)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32)
    model.generation_config.eos_token_id = None
    out = []
    with torch.inference_mode():
        for n in LONG:
            ids = torch.tensor([prompt_of(n)])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=LONG_NEW, pad_token_id=0)  # fmt: skip
            out.append(gen[0, n:].tolist())
    return out


def _by_role(workers: tuple[str, list[WorkerEndpoint]]) -> dict[Role, WorkerEndpoint]:
    return {e.role: e for e in workers[1]}


def stack_router(
    stack: str, workers: tuple[str, list[WorkerEndpoint]], tokenizer: Any
) -> RouterThread:
    token, _ = workers
    by_role = _by_role(workers)
    if stack == "disaggregated":
        return router(token, tokenizer, [by_role[Role.PREFILL], by_role[Role.DECODE]],
                      disaggregation=ALWAYS_REMOTE)  # fmt: skip
    return router(token, tokenizer, [by_role[Role.BOTH]])


def post(base: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{base}/v1/completions", json={**body, "stream": False}, timeout=300)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def streamed(base: str, body: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Each choice's text, token ids and finish reason, joined from the stream."""
    choices: dict[int, dict[str, Any]] = {}
    with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True},
                      timeout=300) as r:  # fmt: skip
        assert r.status_code == 200, r.read()
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    for line in lines[:-1]:
        chunk = json.loads(line)
        assert "error" not in chunk, chunk
        for ch in chunk["choices"]:
            got = choices.setdefault(ch["index"], {"text": "", "token_ids": []})
            got["text"] += ch.get("text") or ""
            got["token_ids"] += ch.get("token_ids") or []
            if ch.get("finish_reason"):
                got["finish_reason"] = ch["finish_reason"]
    return choices


async def _all_free(workers: tuple[str, list[WorkerEndpoint]]) -> list[pb.HealthResponse]:
    token, eps = workers
    out = []
    for ep in eps:
        async with WorkerClient(ep.address, token) as c:
            out.append(await all_free(c, 20))
    return out


def assert_all_free(workers: tuple[str, list[WorkerEndpoint]]) -> None:
    for h in asyncio.run(_all_free(workers)):
        assert (h.free_blocks, h.leases, h.running, h.waiting) == (h.total_blocks, 0, 0, 0), h


def test_long_prompts_moved_prefill_to_decode_equal_generate(
    workers: tuple[str, list[WorkerEndpoint]], tokenizer: Any, long_reference: list[list[int]]
) -> None:
    body = {"max_tokens": LONG_NEW, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    with stack_router("disaggregated", workers, tokenizer) as base:
        for n, want in zip(LONG, long_reference, strict=True):
            choice = post(base, {**body, "prompt": prompt_of(n)})["choices"][0]
            assert choice["token_ids"] == want, f"{n} tokens through the router"
        made = decisions(base)
    assert made.get("remote", 0) == len(LONG) and made.get("local", 0) == 0, made

    async def by_client() -> None:
        token, _ = workers
        by_role = _by_role(workers)
        sp = pb.SamplingParams(max_tokens=LONG_NEW, ignore_eos=True)
        async with (
            WorkerClient(by_role[Role.PREFILL].address, token) as p,
            WorkerClient(by_role[Role.DECODE].address, token) as d,
        ):
            for n, want in zip(LONG, long_reference, strict=True):
                got, resp = await split_request(p, d, f"long-{n}", prompt_of(n), sp,
                                                timeout=300)  # fmt: skip
                assert got == want, f"{n} tokens over the worker client"
                assert resp.first_token == want[0]

    asyncio.run(by_client())
    assert_all_free(workers)


def _stop_string(text: str) -> str:
    """Two characters of ``text`` from its fifth on, printable, first seen there: the
    answer before them is not empty and the stop cannot match earlier."""
    for i in range(4, len(text) - 1):
        s = text[i : i + 2]
        if s.strip() and "\ufffd" not in s and s.isprintable() and text.find(s) == i:
            return s
    raise AssertionError(f"no printable pair of characters in the answer: {text!r}")


@pytest.mark.parametrize("stack", STACKS)
def test_a_stop_string_cuts_the_text_streamed_or_not_and_frees_every_block(
    stack: str, workers: tuple[str, list[WorkerEndpoint]], tokenizer: Any
) -> None:
    body = {"prompt": STOP_PROMPT, "max_tokens": STOP_NEW, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    with stack_router(stack, workers, tokenizer) as base:
        whole = post(base, body)["choices"][0]
        assert whole["finish_reason"] == "length"
        stop = _stop_string(whole["text"])
        want = whole["text"][: whole["text"].find(stop)]
        cut = post(base, {**body, "stop": [stop]})["choices"][0]
        flowing = streamed(base, {**body, "stop": [stop]})
        # a stop string that never comes changes nothing
        never = post(base, {**body, "stop": ["\x7f\x7f\x7f"]})["choices"][0]
    assert (cut["text"], cut["finish_reason"]) == (want, "stop"), (stop, whole["text"])
    assert want and stop not in cut["text"]
    # the tokens end with the one that completed the stop string; fewer than max_tokens
    assert cut["token_ids"] == whole["token_ids"][: len(cut["token_ids"])]
    assert len(cut["token_ids"]) < STOP_NEW
    assert stop in tokenizer.decode(cut["token_ids"], skip_special_tokens=True)
    assert flowing == {0: {"text": cut["text"], "token_ids": cut["token_ids"],
                           "finish_reason": "stop"}}  # fmt: skip
    assert (never["text"], never["finish_reason"]) == (whole["text"], "length")
    assert_all_free(workers)


@pytest.mark.parametrize("stack", STACKS)
def test_choice_i_of_a_seeded_request_is_the_single_request_seeded_seed_plus_i(
    stack: str, workers: tuple[str, list[WorkerEndpoint]], tokenizer: Any
) -> None:
    n = 3
    body = {"prompt": prompt_of(30), "max_tokens": 12, "ignore_eos": True,
            "return_token_ids": True, **SEEDED}  # fmt: skip
    with stack_router(stack, workers, tokenizer) as base:
        together = {c["index"]: c["token_ids"] for c in post(base, {**body, "n": n})["choices"]}
        flowing = {i: c["token_ids"] for i, c in streamed(base, {**body, "n": n}).items()}
        alone = {
            i: post(base, {**body, "seed": SEEDED["seed"] + i})["choices"][0]["token_ids"]
            for i in range(n)
        }
    assert together == alone, "choice i differs from the request seeded seed + i"
    assert flowing == alone
    assert len({tuple(t) for t in alone.values()}) == n, "the seeds gave the same tokens"
    assert_all_free(workers)

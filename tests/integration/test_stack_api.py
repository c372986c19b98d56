"""What OpenAI clients and the field's load generators send, through stacks of real worker
processes on 127.0.0.1: top logprobs, echo, n choices, and the bodies of vllm bench serve
and GuideLLM."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from splitserve.roles import Role
from splitserve_worker.router.discovery import WorkerEndpoint
from stack_kit import (  # noqa: F401  (fixtures)
    ALWAYS_REMOTE,
    MAX_TOKENS,
    PROMPTS,
    decisions,
    reference_fixture,
    router,
    tokenizer_fixture,
    workers_fixture,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_top_logprobs_are_the_same_disaggregated_and_colocated(
    workers: tuple[str, list[WorkerEndpoint]], tokenizer: Any
) -> None:
    """The first token's alternatives come from the prefill worker (through Commit), the
    rest from the decode worker: the answer equals one worker's."""
    token, eps = workers
    by_role = {e.role: e for e in eps}
    chat = {"messages": [{"role": "user", "content": "name a colour"}], "max_tokens": 5,
            "temperature": 0, "ignore_eos": True, "logprobs": True, "top_logprobs": 3}  # fmt: skip
    text = {"prompt": "one two three", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "logprobs": 2}  # fmt: skip
    answers: list[Any] = []
    for stack, how in (([by_role[Role.PREFILL], by_role[Role.DECODE]], "remote"),
                       ([by_role[Role.BOTH]], "local")):  # fmt: skip
        with router(token, tokenizer, stack, disaggregation=ALWAYS_REMOTE) as base:
            for path, body in (("chat/completions", chat), ("completions", text)):
                for stream in (False, True):
                    r = httpx.post(f"{base}/v1/{path}", json={**body, "stream": stream},
                                   timeout=120)  # fmt: skip
                    assert r.status_code == 200, r.text
                    answers.append(r.text if stream else r.json()["choices"][0]["logprobs"])
            assert decisions(base) == {how: 4}
    disagg, coloc = answers[:4], answers[4:]
    chat_lp, text_lp = disagg[0], disagg[2]
    # the same tokens and alternatives; logprobs agree to float noise (a prefix-cache hit
    # computes the prompt in other chunks)
    assert same(chat_lp, coloc[0]) and same(text_lp, coloc[2])
    for entry in chat_lp["content"]:
        top = entry["top_logprobs"]
        assert len(top) == 3 and top[0]["token"] == entry["token"]
        assert top[0]["logprob"] == pytest.approx(entry["logprob"], abs=1e-5)
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
    assert len(text_lp["top_logprobs"]) == 4
    for tok, alts in zip(text_lp["tokens"], text_lp["top_logprobs"], strict=True):
        assert 1 <= len(alts) <= 2 and tok in alts

    def streamed(raw: str, chat: bool) -> list[Any]:
        chunks = [json.loads(ln[6:]) for ln in raw.splitlines() if ln.startswith("data: {")]
        lps = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
        if chat:
            return [e for lp in lps for e in lp["content"]]
        return [a for lp in lps for a in lp["top_logprobs"]]

    assert same(streamed(disagg[1], True), chat_lp["content"])
    assert same(streamed(coloc[1], True), chat_lp["content"])
    assert same(streamed(disagg[3], False), text_lp["top_logprobs"])
    assert same(streamed(coloc[3], False), text_lp["top_logprobs"])


def same(a: Any, b: Any) -> bool:
    """Equal, floats to within 1e-4."""
    if isinstance(a, float) or isinstance(b, float):
        return bool(a == pytest.approx(b, abs=1e-4))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def complete(base: str, **body: Any) -> httpx.Response:
    """POST /v1/completions to the router at ``base``; the answer must be a 200."""
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r


def test_echo_puts_the_prompt_before_the_completion(
    workers: tuple[str, list[WorkerEndpoint]], tokenizer: Any
) -> None:
    token, eps = workers
    head = "Once upon a time"
    base_body = {"max_tokens": 5, "temperature": 0, "ignore_eos": True}
    with router(token, tokenizer, eps) as base:
        post = functools.partial(complete, base, **base_body)
        for prompt in (head, tokenizer(head)["input_ids"]):
            text = post(prompt=prompt, echo=True).json()["choices"][0]["text"]
            plain = post(prompt=prompt).json()["choices"][0]["text"]
            assert plain and text == head + plain
            r = post(prompt=prompt, echo=True, stream=True)
            chunks = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")]
            assert "".join(c["choices"][0]["text"] for c in chunks) == text


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_reads_it(
    workers: tuple[str, list[WorkerEndpoint]], tokenizer: Any, tiny_model_path: Path
) -> None:
    """lm-evaluation-harness's loglikelihood requests (``local-completions``): the prompt
    as token ids, one token generated, ``echo`` and ``logprobs: 1``; it sums
    ``token_logprobs[ctxlen:-1]``, the continuation's logprobs given the context. Over
    prefill + decode workers (the prompt scored on the prefill worker, handed over with
    Commit) and over one worker, streamed or not: transformers' own logprobs."""
    import torch
    from transformers import AutoModelForCausalLM

    token, eps = workers
    by_role = {e.role: e for e in eps}
    prompt = PROMPTS[2][:60]
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32)
    with torch.inference_mode():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    want = ref[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()
    best = ref[:-1].argmax(-1).tolist()
    body = {"model": "tiny", "prompt": [prompt], "temperature": 0, "max_tokens": 1,
            "logprobs": 1, "seed": 1234, "echo": True}  # fmt: skip
    for stack, how in (([by_role[Role.PREFILL], by_role[Role.DECODE]], "remote"),
                       ([by_role[Role.BOTH]], "local")):  # fmt: skip
        with router(token, tokenizer, stack, disaggregation=ALWAYS_REMOTE) as base:
            r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            lp = r.json()["choices"][0]["logprobs"]
            r = httpx.post(f"{base}/v1/completions", json={**body, "stream": True}, timeout=120)
            assert decisions(base) == {how: 2}
        chunks = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")]
        # the prompt's tokens and logprobs come in the first chunk, with the echo
        assert same(chunks[0]["choices"][0]["logprobs"], lp)
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(prompt) + 1
        assert lp["tokens"][:-1] == [tokenizer.decode([t]) for t in prompt]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["token_logprobs"][1:-1] == pytest.approx(want, abs=1e-4)
        # logprobs: 1 gives the most likely token at each position, as lm-eval checks
        # whether the continuation is the greedy one
        tops = lp["top_logprobs"][1:-1]
        assert [next(iter(t)) for t in tops] == [tokenizer.decode([b]) for b in best]
        ctxlen = 40
        got = sum(lp["token_logprobs"][ctxlen:-1])
        assert got == pytest.approx(sum(want[ctxlen - 1 :]), abs=1e-3)


def test_vllm_prompt_logprobs_on_both_endpoints(
    workers: tuple[str, list[WorkerEndpoint]], tokenizer: Any, tiny_model_path: Path
) -> None:
    """vLLM's ``prompt_logprobs``: per prompt token after the first, its own logprob and
    rank and the most likely tokens there; the same over prefill + decode workers and
    over one worker, equal to transformers' own on a completion."""
    import torch
    from transformers import AutoModelForCausalLM

    token, eps = workers
    by_role = {e.role: e for e in eps}
    prompt = PROMPTS[1]
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32)
    with torch.inference_mode():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
    text = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 3}
    chat = {"messages": [{"role": "user", "content": "name a colour"}], "max_tokens": 2,
            "temperature": 0, "prompt_logprobs": 0}  # fmt: skip
    answers: list[Any] = []
    for stack, how in (([by_role[Role.PREFILL], by_role[Role.DECODE]], "remote"),
                       ([by_role[Role.BOTH]], "local")):  # fmt: skip
        with router(token, tokenizer, stack, disaggregation=ALWAYS_REMOTE) as base:
            for path, body in (("completions", text), ("chat/completions", chat)):
                r = httpx.post(f"{base}/v1/{path}", json=body, timeout=120)
                assert r.status_code == 200, r.text
                answers.append(r.json())
            assert decisions(base) == {how: 2}
    assert same(answers[0]["choices"], answers[2]["choices"])
    assert same(answers[1]["prompt_logprobs"], answers[3]["prompt_logprobs"])
    got = answers[0]["choices"][0]["prompt_logprobs"]
    assert len(got) == len(prompt) and got[0] is None
    for pos, entry in enumerate(got[1:]):
        tok, row = prompt[pos + 1], ref[pos]
        own = entry[str(tok)]
        assert own["logprob"] == pytest.approx(float(row[tok]), abs=1e-4)
        assert own["rank"] == int((row > row[tok]).sum()) + 1
        assert own["decoded_token"] == tokenizer.decode([tok])
        best = torch.topk(row, 3).indices.tolist()
        assert set(entry) == {str(t) for t in [tok, *best]}
        assert [entry[str(t)]["rank"] for t in best if t != tok] == [
            r for r, t in enumerate(best, 1) if t != tok
        ]
    # chat: one list for the request, the templated prompt's tokens, no alternatives
    lps = answers[1]["prompt_logprobs"]
    assert len(lps) == answers[1]["usage"]["prompt_tokens"] and lps[0] is None
    assert all(len(e) == 1 and next(iter(e.values()))["rank"] >= 1 for e in lps[1:])


def test_a_batch_of_prompts_is_answered_as_each_alone(
    workers: tuple[str, list[WorkerEndpoint]], tokenizer: Any
) -> None:
    """OpenAI's batched prompts (what lm-evaluation-harness sends with a batch size): each
    prompt gets its ``n`` choices, indexed prompt by prompt, the same as asked alone."""
    token, eps = workers
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2][:30]]
    base_body = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    with router(token, tokenizer, eps) as base:
        post = functools.partial(complete, base, **base_body)
        alone = [post(prompt=p).json()["choices"][0]["text"] for p in prompts]
        body = post(prompt=prompts, n=2).json()
        assert [c["index"] for c in body["choices"]] == list(range(6))
        assert [c["text"] for c in body["choices"]] == [t for t in alone for _ in range(2)]
        lengths = [len(p) for p in prompts]
        assert body["usage"] == {"prompt_tokens": sum(lengths), "completion_tokens": 24,
                                 "total_tokens": sum(lengths) + 24}  # fmt: skip
        r = post(prompt=prompts, n=2, stream=True)
        texts = [""] * 6
        for ln in r.text.splitlines():
            if ln.startswith("data: {"):
                for c in json.loads(ln[6:])["choices"]:
                    texts[c["index"]] += c["text"]
        assert texts == [c["text"] for c in body["choices"]]
        texts = ["Once upon a time", "hello there"]  # a batch of text prompts alike
        alone = [post(prompt=t, echo=True).json()["choices"][0]["text"] for t in texts]
        assert [c["text"] for c in post(prompt=texts, echo=True).json()["choices"]] == alone
        # lm-eval's loglikelihood batch: token-id prompts, echo, logprobs, one token each
        scored = post(prompt=prompts[:2], echo=True, logprobs=1, max_tokens=1).json()
        for c, n in zip(scored["choices"], lengths, strict=False):
            lp = c["logprobs"]
            assert len(lp["token_logprobs"]) == n + 1 and lp["token_logprobs"][0] is None


def test_what_vllm_bench_serve_sends(
    workers: tuple[str, list[WorkerEndpoint]], tokenizer: Any
) -> None:
    """The body of `vllm bench serve`'s completions requests, as it sends it: every token
    streams, and the last chunk before [DONE] is the usage, with no choice."""
    token, eps = workers
    body = {"model": "tiny", "prompt": "hello there", "repetition_penalty": 1.0,
            "max_tokens": 6, "logprobs": None, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}  # fmt: skip
    with (
        router(token, tokenizer, eps) as base,
        httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r,
    ):
        assert r.status_code == 200, r.read()
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert all(len(c["choices"]) == 1 for c in chunks[:-1])
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def _choices(base: str, body: dict[str, Any]) -> tuple[dict[int, list[int]], dict[str, Any]]:
    """Token ids of each choice, and the usage, of a completion, streamed or not."""
    if not body.get("stream"):
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        got = {c["index"]: c["token_ids"] for c in r.json()["choices"]}
        return got, r.json()["usage"]
    body = {**body, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        chunks = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
    streamed: dict[int, list[int]] = {}
    for c in chunks[:-1]:
        assert "error" not in c, c
        (ch,) = c["choices"]
        streamed.setdefault(ch["index"], []).extend(ch["token_ids"])
    assert chunks[-1]["choices"] == []
    return streamed, chunks[-1]["usage"]


def test_n_choices_each_run_as_a_request_of_their_own(
    workers: tuple[str, list[WorkerEndpoint]], tokenizer: Any, reference: Any
) -> None:
    token, eps = workers
    prompt = PROMPTS[1]
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    with router(token, tokenizer, eps) as base:
        # greedy: every choice is the greedy answer
        for stream in (False, True):
            got, use = _choices(base, {**body, "n": 2, "temperature": 0, "stream": stream})
            assert got == {0: reference[1], 1: reference[1]}
            assert use["completion_tokens"] == 2 * MAX_TOKENS
            assert use["prompt_tokens"] == len(prompt)
        # seeded sampling: the choices differ from each other, and repeat exactly
        seeded = {**body, "n": 3, "temperature": 1.0, "seed": 7}
        plain, _ = _choices(base, {**seeded, "stream": False})
        streamed, use = _choices(base, {**seeded, "stream": True})
        chat = {"messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 3,
                "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
        r = httpx.post(f"{base}/v1/chat/completions", json=chat, timeout=120)
        chunks = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")]
    assert sorted(plain) == [0, 1, 2] and plain == streamed
    assert len({tuple(t) for t in plain.values()}) == 3, plain
    assert all(len(t) == MAX_TOKENS for t in plain.values())
    assert use["completion_tokens"] == 3 * MAX_TOKENS
    # chat: the first chunk gives each choice its role; each choice finishes once
    assert [c["delta"]["role"] for c in chunks[0]["choices"]] == ["assistant", "assistant"]
    finished = [ch["index"] for c in chunks[1:] for ch in c["choices"] if ch["finish_reason"]]
    assert sorted(finished) == [0, 1]


def test_what_guidellm_sends(workers: tuple[str, list[WorkerEndpoint]], tokenizer: Any) -> None:
    """GuideLLM asks for vLLM's continuous usage: every chunk carries the usage so far."""
    token, eps = workers
    body = {"model": "tiny", "prompt": "hello there", "max_tokens": 6, "stop": None,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    with (
        router(token, tokenizer, eps) as base,
        httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r,
    ):
        assert r.status_code == 200, r.read()
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: {")]
    chunks = [json.loads(ln[6:]) for ln in lines]
    seen = [c["usage"]["completion_tokens"] for c in chunks]
    assert seen == sorted(seen) and seen[-1] == 6 and seen[0] >= 1, seen
    assert all(c["usage"]["prompt_tokens"] == chunks[0]["usage"]["prompt_tokens"] for c in chunks)
    assert chunks[-1]["choices"] == []

"""The OpenAI response bodies of one request: choices, envelopes, usage and SSE lines.

Functions of a :class:`Job` (what the request asked and has produced so far; only its
``text_offset`` moves as pieces are built); the HTTP layer in :mod:`.app` decides when
to send which.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from splitserve.sampling import SamplingParams

from splitserve_worker.router.api_models import MAX_SEED
from splitserve_worker.router.queues import Admission
from splitserve_worker.router.text import Detokenizer
from splitserve_worker.router.worker_conn import PromptScores

Top = Sequence[tuple[int, float]]
"""The most likely tokens at one position, with their logprobs, best first."""


@dataclass
class Job:
    """One request in flight: what it asked and what it has produced so far."""

    id: str
    kind: str  # "text_completion" | "chat.completion"
    model: str
    prompt: tuple[int, ...]
    sampling: SamplingParams
    detok: Detokenizer
    want_logprobs: bool
    return_token_ids: bool
    stream: bool
    index: int = 0
    """Which choice of the request this is (``n`` > 1 runs one job per choice, a batch of
    prompts ``n`` per prompt)."""
    prompt_index: int = 0
    """Which prompt of a batch this job answers."""
    echo: str = ""
    """Text put before the completion's (the prompt, for ``echo``); a stream sends it with
    its first text and then clears it."""
    include_usage: bool = False
    """Streaming: a last chunk, with no choice, carries the usage."""
    continuous_usage: bool = False
    """Streaming: every chunk carries the usage so far (vLLM's ``continuous_usage_stats``)."""
    arrived: float = field(default_factory=time.monotonic)
    created: int = field(default_factory=lambda: int(time.time()))
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[Top] = field(default_factory=list)
    echo_logprobs: bool = False
    """``echo`` with ``logprobs``: the prompt's tokens lead the logprobs."""
    prompt_logprobs: int | None = None
    """vLLM's ``prompt_logprobs``: alternatives per prompt position in the response's
    ``prompt_logprobs``."""
    prompt_scores: PromptScores | None = None
    """The prompt's logprobs (for either of the above), once the first token came."""
    text_offset: int = 0
    """Where the next token's text starts in the choice's text (completions' logprobs
    ``text_offset``: the lengths of the token strings returned so far)."""
    first_at: float | None = None
    finish_reason: str | None = None
    admission: Admission | None = None
    """A decode slot taken before a stream's 200 was sent."""


def choices_of(job: Job, n: int) -> list[Job]:
    """``job`` as ``n`` choices, indexed from ``job.index`` on; seeded sampling gets seed,
    seed + 1, ... so they differ."""
    seed = job.sampling.seed

    def sampling(i: int) -> SamplingParams:
        if seed is None:
            return job.sampling
        return replace(job.sampling, seed=(seed + i) % (MAX_SEED + 1))

    def fresh(i: int) -> Job:
        detok = Detokenizer(job.detok.tokenizer, job.detok.stop)
        return replace(job, index=job.index + i, sampling=sampling(i), detok=detok, tokens=[],
                       logprobs=[], top_logprobs=[], prompt_scores=None, text_offset=0)  # fmt: skip

    return [job] + [fresh(i) for i in range(1, n)]


def usage(jobs: Sequence[Job]) -> dict[str, int]:
    """Of a request's choices together: each prompt once, every choice's tokens."""
    prompt = sum({j.prompt_index: len(j.prompt) for j in jobs}.values())
    completion = sum(len(j.tokens) for j in jobs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def logprobs_of(
    job: Job,
    ids: list[int],
    lps: Sequence[float | None],
    tops: Sequence[Top | None],
    prompt: PromptScores | None = None,
) -> Any:
    """The ``logprobs`` of a choice or a piece of one (None unless asked for); a
    completion's advances ``job.text_offset``, so a stream's pieces count on."""
    if not job.want_logprobs:
        return None
    if prompt is not None:  # echo: the prompt's tokens first; the first has no logprob
        ids = [*job.prompt, *ids]
        lps = [None, *prompt.logprobs, *lps]
        if tops:
            k = job.sampling.top_logprobs  # the scores may hold more, for prompt_logprobs
            tops = [None, *(top[:k] for top in prompt.top_logprobs), *tops]
    decode = job.detok.tokenizer.decode
    toks = [decode([t]) for t in ids]
    # one entry per token: decoded alternatives where asked for, none otherwise
    alts = [None if top is None else [(decode([t]), lp) for t, lp in top] for top in tops]
    alts = alts or [[] for _ in ids]
    if job.kind == "chat.completion":

        def entry(s: str, lp: float | None) -> dict[str, Any]:
            return {"token": s, "logprob": lp, "bytes": list(s.encode())}

        return {
            "content": [
                {**entry(s, lp), "top_logprobs": [entry(a, alp) for a, alp in alt or ()]}
                for s, lp, alt in zip(toks, lps, alts, strict=False)
            ]
        }
    offsets = []
    for tok in toks:  # runs on across the pieces of a stream
        offsets.append(job.text_offset)
        job.text_offset += len(tok)
    return {
        "tokens": toks,
        "token_logprobs": list(lps),
        "top_logprobs": [None if alt is None else dict(alt) for alt in alts] if tops else None,
        "text_offset": offsets,
    }


def choice(
    job: Job,
    text: str,
    ids: list[int],
    lps: list[float],
    final: bool,
    tops: Sequence[Top] = (),
    prompt: PromptScores | None = None,
) -> Any:
    """One choice of a response or chunk; ``prompt``: the prompt's logprobs go first."""
    c: dict[str, Any] = {"index": job.index}
    if job.kind == "chat.completion" and job.stream:
        c["delta"] = {"content": text} if text else {}
    elif job.kind == "chat.completion":
        c["message"] = {"role": "assistant", "content": text}
    else:
        c["text"] = text
    c["logprobs"] = logprobs_of(job, ids, lps, tops, prompt)
    c["finish_reason"] = job.finish_reason if final else None
    if job.return_token_ids:
        c["token_ids"] = ids
    return c


def echo_scores(job: Job) -> PromptScores | None:
    """The prompt's scores where they lead the logprobs (``echo`` with ``logprobs``)."""
    return job.prompt_scores if job.echo_logprobs else None


def prompt_logprobs_of(job: Job) -> list[dict[str, Any] | None] | None:
    """vLLM's ``prompt_logprobs``: None for the first prompt token, then per token a map
    of token id to its logprob, rank and text: the prompt's own token and the most likely
    ones. None when not asked for."""
    scores, k = job.prompt_scores, job.prompt_logprobs
    if scores is None or k is None:
        return None
    decode = job.detok.tokenizer.decode
    out: list[dict[str, Any] | None] = [None]
    for i, tok in enumerate(job.prompt[1:]):
        ranked = [(tok, scores.logprobs[i], scores.ranks[i] if scores.ranks else None)]
        tops = scores.top_logprobs[i][:k] if scores.top_logprobs else []
        ranked += [(t, lp, r) for r, (t, lp) in enumerate(tops, 1) if t != tok]
        out.append({str(t): {"logprob": lp, "rank": r, "decoded_token": decode([t])}
                    for t, lp, r in ranked})  # fmt: skip
    return out


def final_choice(job: Job) -> Any:
    """The whole of one choice, once it has ended (a response that is not streamed)."""
    text = job.echo + job.detok.text
    c = choice(job, text, job.tokens, job.logprobs, True, job.top_logprobs, echo_scores(job))
    if job.kind == "text_completion" and job.prompt_logprobs is not None:
        c["prompt_logprobs"] = prompt_logprobs_of(job)
    return c


def response(jobs: Sequence[Job]) -> dict[str, Any]:
    """The whole answer of a request run as ``jobs``, once all have ended."""
    body = envelope(jobs[0], [final_choice(j) for j in jobs])
    if jobs[0].kind == "chat.completion" and jobs[0].prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs_of(jobs[0])  # one prompt, all choices
    body["usage"] = usage(jobs)
    return body


def envelope(job: Job, choices: list[Any]) -> dict[str, Any]:
    obj = job.kind + (".chunk" if job.kind == "chat.completion" and job.stream else "")
    return {
        "id": job.id,
        "object": obj,
        "created": job.created,
        "model": job.model,
        "choices": choices,
    }


def chunk(jobs: Sequence[Job], choices: list[Any]) -> dict[str, Any]:
    """One streamed chunk of the request run as ``jobs``: the envelope, with the usage so
    far when asked for."""
    body = envelope(jobs[0], choices)
    if jobs[0].continuous_usage:
        body["usage"] = usage(jobs)
    return body


def role_choice(job: Job) -> dict[str, Any]:
    """The chat stream's first choice of ``job``: the role, no content yet."""
    return {"index": job.index, "delta": {"role": "assistant", "content": ""},
            "logprobs": None, "finish_reason": None}  # fmt: skip


def sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()

r"""A request as the router runs it: the OpenAI body checked against this server's limits
and turned into :class:`~splitserve_worker.router.responses.Job`\ s (one per prompt; the
``n`` choices of each are made by ``responses.choices_of``)."""

from __future__ import annotations

import uuid

from splitserve.sampling import SamplingError, SamplingParams

from splitserve_worker.router.api_models import ChatCompletionRequest, CompletionRequest
from splitserve_worker.router.config import RouterConfig
from splitserve_worker.router.errors import APIError
from splitserve_worker.router.responses import Job
from splitserve_worker.router.text import Detokenizer
from splitserve_worker.router.tokenizer_pool import TokenizerPool


def check_model(name: str, cfg: RouterConfig) -> str:
    """The served model's name; 404 for another."""
    if name and name != cfg.model_name:
        raise APIError(
            404,
            f"model {name!r} is not served here; this server serves {cfg.model_name!r}",
            param="model",
            code="model_not_found",
        )
    return cfg.model_name


def make_job(
    kind: str,
    body: CompletionRequest | ChatCompletionRequest,
    prompt: list[int],
    cfg: RouterConfig,
    tok: TokenizerPool,
    job_id: str | None = None,
) -> Job:
    """One request as a :class:`Job`: its limits checked against the server's (an
    :class:`APIError` names the bad field), its sampling parameters as sent to workers
    (checked as the workers will check them)."""
    if not prompt:
        raise APIError(400, "the prompt is empty after tokenization", param="prompt")
    limit = body.token_limit() if isinstance(body, ChatCompletionRequest) else body.max_tokens
    room = cfg.max_model_len - len(prompt)
    if room < 1:
        raise APIError(
            400,
            f"the prompt has {len(prompt)} tokens; this server accepts at most "
            f"{cfg.max_model_len - 1} (max_model_len {cfg.max_model_len})",
            param="prompt",
            code="context_length_exceeded",
        )
    max_tokens = limit if limit is not None else min(cfg.default_max_tokens, room)
    if max_tokens > room:
        raise APIError(
            400,
            f"prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) exceeds "
            f"max_model_len {cfg.max_model_len}",
            param="max_tokens",
            code="context_length_exceeded",
        )
    if body.min_tokens > max_tokens:
        raise APIError(400, "min_tokens must not exceed max_tokens", param="min_tokens")
    vocab = tok.vocab_size
    bias = body.bias_pairs()
    for param, ids in (("prompt", prompt), ("stop_token_ids", body.stop_token_ids or ()),
                       ("logit_bias", [t for t, _ in bias])):  # fmt: skip
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise APIError(
                400, f"token id {bad} is outside the vocabulary (size {vocab})", param=param
            )
    want_lp = bool(body.logprobs) if kind == "chat.completion" else body.logprobs is not None
    # the prompt is scored for echo with logprobs and for vLLM's prompt_logprobs: with
    # as many alternatives as either asks for
    echo_lp = isinstance(body, CompletionRequest) and body.echo and want_lp
    asked = [k for k in (body.top_count() if echo_lp else None, body.prompt_logprobs)
             if k is not None]  # fmt: skip
    sampling = SamplingParams(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=max(0, body.top_k),
        seed=body.seed,
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,
        ignore_eos=body.ignore_eos,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        stop=body.stop_strings(),
        logprobs=want_lp,
        min_p=body.min_p,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        top_logprobs=body.top_count(),
        logit_bias=bias,
        prompt_logprobs=max(asked) if asked else None,
    )
    try:
        sampling.validate()
    except SamplingError as e:
        raise APIError(400, str(e), param=str(e).split(" ", 1)[0]) from None
    return Job(
        id=job_id or ("cmpl-" if kind == "text_completion" else "chatcmpl-") + uuid.uuid4().hex,
        kind=kind,
        model=check_model(body.model, cfg),
        prompt=tuple(prompt),
        sampling=sampling,
        detok=Detokenizer(tok.tokenizer, body.stop_strings()),
        want_logprobs=want_lp,
        return_token_ids=body.return_token_ids,
        stream=body.stream,
        include_usage=body.include_usage(),
        continuous_usage=body.continuous_usage(),
        echo_logprobs=echo_lp,
        prompt_logprobs=body.prompt_logprobs,
    )


async def completion_jobs(
    body: CompletionRequest, cfg: RouterConfig, tok: TokenizerPool
) -> list[Job]:
    """One job per prompt of a completion request (text prompts tokenized as the model's
    tokenizer does, with its special tokens, off the event loop), under the request's one
    id; a bad prompt of a batch is named by its place in it."""
    batch: list[Job] = []
    prompts = body.prompts()
    for i, given in enumerate(prompts):
        try:
            if isinstance(given, str):
                prompt = await tok.encode(given, add_special_tokens=True)
            else:
                prompt = list(given)
            job = make_job("text_completion", body, prompt, cfg, tok,
                           batch[0].id if batch else None)  # fmt: skip
        except APIError as e:
            if len(prompts) == 1 or e.status >= 500:
                raise
            raise APIError(e.status, f"prompt {i} of the batch: {e.message}",
                           param=e.param, code=e.code) from None  # fmt: skip
        job.index, job.prompt_index = i * body.n, i
        if body.echo:
            job.echo = (
                given if isinstance(given, str)
                else await tok.decode(prompt, skip_special_tokens=True)
            )  # fmt: skip
        batch.append(job)
    return batch

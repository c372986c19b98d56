"""OpenAI-compatible request models (pydantic), with the checks the engine relies on.

Unknown fields are refused with a message naming them, so a typo never goes
unnoticed. Sampling options the engine does not implement (best_of) are accepted
only at their neutral value.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator
from splitserve.sampling import MAX_LOGIT_BIAS, MAX_REPETITION_PENALTY, MAX_TOP_LOGPROBS

MAX_STOP_STRINGS = 16
MAX_SEED = 2**63 - 1
MAX_CHOICES = 16
"""Most choices (``n``) per request: each is a request of its own on the workers."""
MAX_COMPLETIONS = 64
"""Most completions per request, prompts of a batch times ``n``."""
MAX_BIASED_TOKENS = 1024
MAX_TOKEN_ID_DIGITS = 10
"""A token id is an int32: ``logit_bias`` keys longer than this are refused unread."""

STRICT = ConfigDict(extra="forbid", strict=True)
"""Every request model: unknown fields refused by name, and no coercion where the OpenAI
API is typed (``max_tokens: "2"`` or ``true`` is not an integer; an integer is a number)."""

_SURROGATE = re.compile(r"[\ud800-\udfff]")


def unicode_problem(text: str) -> str | None:
    """Why ``text`` cannot be sent as UTF-8 (a lone surrogate, which JSON's ``\\ud800``
    escapes can make), or None. Cheap for ASCII, which needs no look."""
    if text.isascii():
        return None
    bad = _SURROGATE.search(text)
    if bad is None:
        return None
    return (
        f"holds a lone surrogate ({bad.group()!r}) at character {bad.start()}: send valid "
        "Unicode (a surrogate pair's two escapes together, or the character itself)"
    )


def _text(value: str) -> str:
    problem = unicode_problem(value)
    if problem is not None:
        raise ValueError(f"the text {problem}")
    return value


Text = Annotated[str, AfterValidator(_text)]
"""A string the workers and the tokenizer can take: valid Unicode (no lone surrogates)."""


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = False
    """vLLM's: every chunk carries the usage so far."""


class _Sampling(BaseModel):
    """Fields shared by both endpoints."""

    model_config = STRICT

    model: str = Field(default="", max_length=512)
    max_tokens: int | None = Field(default=None, ge=1, le=1_000_000)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, le=1_000_000)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stop: Text | list[Text] | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_BIASED_TOKENS)
    """Token id (as a string, as OpenAI's) -> a bias added to its logit before sampling."""
    user: Text | None = Field(default=None, max_length=512)
    # vLLM extensions
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0, le=1_000_000)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=MAX_REPETITION_PENALTY)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(default=None, max_length=64)
    return_token_ids: bool = False
    """Also return the generated token ids in each choice (``token_ids``)."""
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    """vLLM's: each prompt token's logprob and rank, with this many of the most likely
    tokens at its position, in ``prompt_logprobs`` (not with ``stream``)."""

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        if any(s == "" for s in items):
            raise ValueError("stop strings must not be empty")
        if any(len(s) > 256 for s in items):
            raise ValueError("stop strings must be at most 256 characters")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            digits = key.strip()
            if not (digits.isascii() and digits.isdigit()):
                raise ValueError(f"logit_bias keys must be token ids such as '1234', got {key!r}")
            if len(digits) > MAX_TOKEN_ID_DIGITS:
                raise ValueError(
                    f"logit_bias keys must be token ids such as '1234', got a key of "
                    f"{len(digits)} digits"
                )
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:  # NaN fails this too
                raise ValueError(
                    f"logit_bias of token {key} must be in [-{MAX_LOGIT_BIAS:g}, "
                    f"{MAX_LOGIT_BIAS:g}], got {bias}"
                )
        return v

    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as sorted (token id, bias) pairs."""
        merged = {int(k): float(b) for k, b in (self.logit_bias or {}).items()}
        return tuple(sorted(merged.items()))

    @model_validator(mode="after")
    def _neutral(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is not available with stream: true")
        return self

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def continuous_usage(self) -> bool:
        """Usage in every chunk: vLLM's ``continuous_usage_stats``, with ``include_usage``."""
        return self.include_usage() and bool(
            self.stream_options and self.stream_options.continuous_usage_stats
        )


TokenIds = Annotated[list[Annotated[int, Field(ge=0, le=2**31 - 1)]], Field(min_length=1)]


def _is_batch(prompt: Any) -> bool:
    """A list of prompts (texts or token-id lists), not one prompt."""
    return isinstance(prompt, list) and isinstance(prompt[0], str | list)


class CompletionRequest(_Sampling):
    prompt: Text | TokenIds | list[Text] | list[TokenIds]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    """The chosen token's logprob and this many of the most likely ones at each position."""
    echo: bool = False
    """Put the prompt's text before the completion's (with ``logprobs``: the prompt's
    tokens and their logprobs before the completion's)."""
    best_of: int | None = Field(default=None, ge=1, le=1)
    suffix: Text | None = None

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v: Any) -> Any:
        if not v:
            raise ValueError("prompt must not be empty")
        if _is_batch(v):
            if len(v) > MAX_COMPLETIONS:
                raise ValueError(f"at most {MAX_COMPLETIONS} prompts per request, got {len(v)}")
            empty = next((i for i, p in enumerate(v) if not p), None)
            if empty is not None:
                raise ValueError(f"prompt {empty} of the batch is empty")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request: one, or a batch (each answered by its own choices)."""
        p = self.prompt
        return list(p) if _is_batch(p) else [p]  # type: ignore[arg-type,list-item]

    def top_count(self) -> int:
        """How many of the most likely tokens to return per position."""
        return self.logprobs or 0

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        total = len(self.prompts()) * self.n
        if total > MAX_COMPLETIONS:
            raise ValueError(
                f"prompts x n is {total} completions; at most {MAX_COMPLETIONS} per request"
            )
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart]
    name: Text | None = Field(default=None, max_length=256)

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


TEMPLATE_ARGS = frozenset(
    {"conversation", "tools", "documents", "chat_template", "add_generation_prompt",
     "continue_final_message", "tokenize", "padding", "truncation", "max_length",
     "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
     "messages"}
)  # fmt: skip
"""What the router itself passes to the chat template: not settable by a request."""


class ChatTemplating(BaseModel):
    """How a chat becomes a prompt: vLLM's options over the model's chat template."""

    model_config = STRICT
    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    add_generation_prompt: bool = True
    """End the prompt with the template's opening of an assistant turn."""
    continue_final_message: bool = False
    """Leave the final (assistant) message open, so the answer continues it."""
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, max_length=32)
    """More variables for the template (such as Qwen3's ``enable_thinking``)."""

    @model_validator(mode="after")
    def _template_options(self) -> ChatTemplating:
        check_template_options(self)
        return self


def check_template_options(chat: Any) -> None:
    """The rules between a chat's templating options (on any model holding them)."""
    if chat.continue_final_message:
        if chat.add_generation_prompt:
            raise ValueError(
                "continue_final_message needs add_generation_prompt: false (the final "
                "message is continued, no new turn is opened)"
            )
        if chat.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs an assistant message last")
    taken = sorted(TEMPLATE_ARGS & set(chat.chat_template_kwargs or {}))
    if taken:
        raise ValueError(f"chat_template_kwargs may not set {taken}")


class ResponseFormat(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    """Plain text only: no JSON mode or schema-constrained decoding."""


class ChatCompletionRequest(_Sampling, ChatTemplating):
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=1_000_000)
    echo: bool = False
    """vLLM's: when the last message is the assistant's, its text leads the answer's."""
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    """Accepted empty only (what some SDKs always send): no function calling here."""
    tool_choice: Literal["none", "auto"] | None = None
    """With no tools, ``none`` and ``auto`` alike mean a plain answer."""
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _unsupported(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.tools:
            raise ValueError(
                "tools: function calling is not served here; send the request without tools"
            )
        return self

    def echoed(self) -> str:
        """What ``echo`` puts before the answer: the last message, if the assistant's."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == "assistant" else ""

    def top_count(self) -> int:
        """How many of the most likely tokens to return per position."""
        return self.top_logprobs or 0

    def token_limit(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else (self.max_tokens)
        )

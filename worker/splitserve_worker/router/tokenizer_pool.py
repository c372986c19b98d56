"""The served tokenizer, used off the event loop and within bounds: texts and chats to
token ids, ids back to text.

Tokenizing is the one thing a request makes the router compute in proportion to its
size, so a prompt of tens of megabytes must never stall the streams of everyone else:

- a text (or a chat's messages) longer than any prompt this model could accept is
  refused before it is tokenized: no token of this tokenizer spells more than
  :attr:`TokenizerPool.token_chars` characters, so a text of more than
  ``max_model_len x token_chars`` characters (twice that, for what normalizers fold) has
  more tokens than the model takes;
- what is tokenized (or templated, or decoded) runs on a few threads of its own
  (``tokenizer_threads``), with at most :data:`MAX_WAITING` calls queued: past that the
  router answers 503 with Retry-After rather than queue without bound. The tokenizer
  releases the interpreter while it splits a text, so the event loop goes on serving.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from jinja2 import TemplateError

from splitserve_worker.router.api_models import ChatTemplating, unicode_problem
from splitserve_worker.router.errors import APIError

T = TypeVar("T")

MAX_WAITING = 256
"""Tokenizer calls queued for its threads at most; more are answered 503."""
SAFETY = 2
"""Normalizers may fold characters (``e`` + a combining accent is one character after
NFC): the character bound is this many times the plain one."""
UNKNOWN_TOKEN_CHARS = 64
"""Characters per token assumed of a tokenizer whose vocabulary cannot be listed."""
RETRY_AFTER_S = 1


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token of ``tokenizer`` spells (its longest vocabulary
    entry; a byte-level entry has a character per byte, never fewer than it decodes to)."""
    vocab = getattr(tokenizer, "get_vocab", None)
    if vocab is None:
        return UNKNOWN_TOKEN_CHARS
    return max((len(t) for t in vocab()), default=UNKNOWN_TOKEN_CHARS) or 1


def chat_text(tokenizer: Any, model_name: str, chat: ChatTemplating) -> str:
    """A chat as its completion is prompted: the model's chat template over it."""
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, f"model {model_name!r} has no chat template; use /v1/completions")
    turns = [{"role": m.role, "content": m.text()} for m in chat.messages]
    try:
        text: str = tokenizer.apply_chat_template(
            turns,
            tokenize=False,
            add_generation_prompt=chat.add_generation_prompt,
            continue_final_message=chat.continue_final_message,
            **(chat.chat_template_kwargs or {}),
        )
    except (TemplateError, ValueError, TypeError) as e:  # the template refused the chat
        raise APIError(400, f"the chat template of {model_name!r} refused the chat: {e}") from e
    return text


def encode(tokenizer: Any, text: str, add_special_tokens: bool, param: str) -> list[int]:
    """``text``'s token ids; a text no tokenizer can take is the request's 400."""
    problem = unicode_problem(text)
    if problem is not None:
        raise APIError(400, f"the {param} {problem}", param=param)
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def chat_prompt(
    tokenizer: Any, model_name: str, chat: ChatTemplating, add_special_tokens: bool = False
) -> list[int]:
    """A chat's token ids (the template holds the special tokens unless asked for)."""
    return encode(tokenizer, chat_text(tokenizer, model_name, chat), add_special_tokens,
                  "messages")  # fmt: skip


class TokenizerPool:
    """``tokenizer`` behind the bounds above, for a model of ``max_model_len`` tokens."""

    def __init__(self, tokenizer: Any, max_model_len: int, *, threads: int = 2) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = len(tokenizer)
        self.token_chars = longest_token_chars(tokenizer)
        self.max_chars = max_model_len * self.token_chars * SAFETY
        """Longest text tokenized: any longer one has more tokens than the model takes."""
        self._threads = ThreadPoolExecutor(threads, thread_name_prefix="tokenize")
        self._waiting = 0

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)

    def check_length(self, chars: int, param: str) -> None:
        """Refuse a text of ``chars`` characters that cannot fit the model (unread)."""
        if chars > self.max_chars:
            raise APIError(
                400,
                f"the {param} is {chars} characters long; this server accepts at most "
                f"{self.max_model_len - 1} tokens (max_model_len {self.max_model_len}), and "
                f"no text of more than {self.max_chars} characters has that few with this "
                "model's tokenizer",
                param=param,
                code="context_length_exceeded",
            )

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the tokenizer's threads; 503 when too many calls wait."""
        if self._waiting >= MAX_WAITING:
            raise APIError(
                503,
                f"the router is tokenizing {self._waiting} requests already; retry after "
                f"{RETRY_AFTER_S} s",
                code="tokenizer_busy",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        self._waiting += 1
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._threads, functools.partial(fn, *args))
        finally:
            self._waiting -= 1

    async def encode(self, text: str, add_special_tokens: bool, param: str = "prompt") -> list[int]:
        self.check_length(len(text), param)
        return await self.run(encode, self.tokenizer, text, add_special_tokens, param)

    async def chat(
        self, model_name: str, chat: ChatTemplating, add_special_tokens: bool = False
    ) -> list[int]:
        self.check_length(sum(len(m.text()) for m in chat.messages), "messages")
        return await self.run(self._chat, model_name, chat, add_special_tokens)

    def _chat(self, model_name: str, chat: ChatTemplating, add_special_tokens: bool) -> list[int]:
        text = chat_text(self.tokenizer, model_name, chat)
        self.check_length(len(text), "messages")  # what the template and its kwargs added
        return encode(self.tokenizer, text, add_special_tokens, "messages")

    async def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        text: str = await self.run(
            functools.partial(self.tokenizer.decode, skip_special_tokens=skip_special_tokens),
            list(ids),
        )
        return text

    async def token_strs(self, ids: Sequence[int]) -> list[str]:
        strs: list[str] = await self.run(self.tokenizer.convert_ids_to_tokens, list(ids))
        return strs

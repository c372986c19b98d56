"""vLLM's ``/tokenize`` and ``/detokenize``: the served model's own tokenizer over HTTP,
for clients that count or cut tokens without a copy of it (a prompt's length before
sending it, a chat's templated prompt)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import FastAPI
from fastapi.params import Depends
from pydantic import BaseModel, Field, model_validator

from splitserve_worker.router.api_models import (
    STRICT,
    ChatMessage,
    ChatTemplating,
    Text,
    check_template_options,
)
from splitserve_worker.router.errors import APIError
from splitserve_worker.router.jobs import check_model
from splitserve_worker.router.service import RouterService

MAX_DETOKENIZE = 1_000_000


class TokenizeRequest(BaseModel):
    """A text (``prompt``) or a chat (``messages`` and the options of chat completions,
    templated as they are)."""

    model_config = STRICT
    model: str = Field(default="", max_length=512)
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=4096)
    add_special_tokens: bool | None = None
    """Default: true for a prompt (as completions tokenize it), false for a chat (the
    template holds them; true adds the tokenizer's own to the templated text too)."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, max_length=32)
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send either prompt or messages")
        if self.messages is not None:
            check_template_options(self)
        return self

    def chat(self) -> ChatTemplating:
        """The chat with its options (checked already, as chat completions check them)."""
        return ChatTemplating.model_construct(
            messages=self.messages,
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
            chat_template_kwargs=self.chat_template_kwargs,
        )


class DetokenizeRequest(BaseModel):
    model_config = STRICT
    model: str = Field(default="", max_length=512)
    tokens: list[Annotated[int, Field(ge=0)]] = Field(max_length=MAX_DETOKENIZE)


def install(app: FastAPI, service: RouterService, api_key: Depends) -> None:
    """Add the two routes to ``app``, behind ``api_key`` (the app's key check)."""
    cfg, tok = service.config, service.tokenizing

    @app.post("/tokenize", dependencies=[api_key])
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        check_model(body.model, cfg)
        if body.messages is not None:
            ids = await tok.chat(cfg.model_name, body.chat(), bool(body.add_special_tokens))
        else:
            assert body.prompt is not None  # one of the two, by the model's check
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await tok.encode(body.prompt, special)
        strs = await tok.token_strs(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": cfg.max_model_len, "tokens": ids,
                "token_strs": strs}  # fmt: skip

    @app.post("/detokenize", dependencies=[api_key])
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        check_model(body.model, cfg)
        size = tok.vocab_size
        bad = next((t for t in body.tokens if t >= size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary (size {size})",
                           param="tokens")  # fmt: skip
        return {"prompt": await tok.decode(body.tokens)}

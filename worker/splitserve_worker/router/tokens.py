"""vLLM's ``/tokenize`` and ``/detokenize``: the served model's own tokenizer over HTTP,
for clients that count or cut tokens without a copy of it (a prompt's length before
sending it, a chat's templated prompt)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import FastAPI
from fastapi.params import Depends
from jinja2 import TemplateError
from pydantic import BaseModel, ConfigDict, Field, model_validator

from splitserve_worker.router.api_models import (
    ChatMessage,
    ChatTemplating,
    check_template_options,
)
from splitserve_worker.router.errors import APIError
from splitserve_worker.router.jobs import check_model
from splitserve_worker.router.service import RouterService

MAX_DETOKENIZE = 1_000_000


class TokenizeRequest(BaseModel):
    """A text (``prompt``) or a chat (``messages`` and the options of chat completions,
    templated as they are)."""

    model_config = ConfigDict(extra="forbid")
    model: str = Field(default="", max_length=512)
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=4096)
    add_special_tokens: bool | None = None
    """Default: true for a prompt (as completions tokenize it), false for a chat (the
    template holds them)."""
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
    model_config = ConfigDict(extra="forbid")
    model: str = Field(default="", max_length=512)
    tokens: list[Annotated[int, Field(ge=0)]] = Field(max_length=MAX_DETOKENIZE)


def chat_prompt(tokenizer: Any, model_name: str, chat: ChatTemplating) -> list[int]:
    """A chat's token ids, as its completion is prompted: the model's chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, f"model {model_name!r} has no chat template; use /v1/completions")
    turns = [{"role": m.role, "content": m.text()} for m in chat.messages]
    try:
        text = tokenizer.apply_chat_template(
            turns,
            tokenize=False,
            add_generation_prompt=chat.add_generation_prompt,
            continue_final_message=chat.continue_final_message,
            **(chat.chat_template_kwargs or {}),
        )
    except (TemplateError, ValueError, TypeError) as e:  # the template refused the chat
        raise APIError(400, f"the chat template of {model_name!r} refused the chat: {e}") from e
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def install(app: FastAPI, service: RouterService, api_key: Depends) -> None:
    """Add the two routes to ``app``, behind ``api_key`` (the app's key check)."""
    cfg, tok = service.config, service.tokenizer

    @app.post("/tokenize", dependencies=[api_key])
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        check_model(body.model, cfg)
        if body.messages is not None:
            ids = chat_prompt(tok, cfg.model_name, body.chat())
            if body.add_special_tokens:
                ids = list(tok.build_inputs_with_special_tokens(ids))
        else:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = list(tok(body.prompt, add_special_tokens=special)["input_ids"])
        strs = tok.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": cfg.max_model_len, "tokens": ids,
                "token_strs": strs}  # fmt: skip

    @app.post("/detokenize", dependencies=[api_key])
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        check_model(body.model, cfg)
        bad = next((t for t in body.tokens if t >= len(tok)), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary (size {len(tok)})",
                           param="tokens")  # fmt: skip
        return {"prompt": tok.decode(body.tokens)}

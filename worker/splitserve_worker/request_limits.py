"""Bounds a request's sampling options must keep, checked by the router's API models
(a 400 before any worker is asked) and again by the engine (for gRPC callers)."""

from __future__ import annotations

MAX_TOP_LOGPROBS = 20
"""Most alternatives per position a request may ask for (``logprobs`` / ``top_logprobs``
/ ``prompt_logprobs``)."""
MAX_LOGIT_BIAS = 100.0
"""A logit bias is within +-this, as OpenAI's (-100 bans a token, 100 all but forces it)."""

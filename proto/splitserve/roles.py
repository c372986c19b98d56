"""The roles a splitserve worker process serves (``splitserve worker --role``)."""

from __future__ import annotations

from enum import StrEnum


class Role(StrEnum):
    PREFILL = "prefill"
    """Runs prompts and pushes their KV cache to a decode worker."""
    DECODE = "decode"
    """Takes prompts' KV caches (or prefills short ones itself) and streams tokens."""
    BOTH = "both"
    """Colocated: one engine doing chunked prefill and decode."""

    @property
    def can_prefill(self) -> bool:
        return self in PREFILL_ROLES

    @property
    def can_decode(self) -> bool:
        return self in DECODE_ROLES


PREFILL_ROLES = frozenset({Role.PREFILL, Role.BOTH})
DECODE_ROLES = frozenset({Role.DECODE, Role.BOTH})

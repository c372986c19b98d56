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


SWITCHING_METADATA = "splitserve-switching"
"""Trailing-metadata key of a call a worker refused or ended because it is switching its
role (the value: the role it is switching to). A router plans such a request elsewhere
(migrating a stream with the tokens so far) without counting it a failure."""

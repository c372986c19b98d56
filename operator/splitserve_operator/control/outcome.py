"""What one reconcile reports: the action taken on each object, the problems it
met, and the failures that end it early (retry later, or a name conflict)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from splitserve_operator.api.status import Problem


class RetryLater(Exception):
    """A transient failure (API unreachable, a conflict, throttled, 5xx): try again, after a
    backoff (:class:`~.backoff.Backoff`) of at least ``retry_after`` s when the server
    asked for one."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Action(StrEnum):
    CREATED = "created"
    PATCHED = "patched"
    UNCHANGED = "unchanged"
    FAILED = "failed"


@dataclass
class Outcome:
    """What one reconcile did (for events, logs and tests)."""

    actions: dict[str, Action] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)
    status: dict[str, Any] | None = None
    service: dict[str, Any] | None = None
    """The InferenceService as the status write answered (None: no status written)."""
    skipped: str | None = None

    @property
    def created(self) -> list[str]:
        return [k for k, a in self.actions.items() if a == Action.CREATED]

    @property
    def patched(self) -> list[str]:
        return [k for k, a in self.actions.items() if a == Action.PATCHED]


class NameConflict(Exception):
    """An object with our name exists and is not ours."""

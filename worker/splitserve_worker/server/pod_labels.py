"""A pod's own labels from the downward API, and the role a switchable worker takes
from them at start.

The kubelet writes ``metadata.labels`` to a file as ``key="value"`` lines, each value
quoted as Go quotes strings. The operator gives a switchable pod its role as a label; a
container that restarts reads the label again and comes back in the role its pod was
last given, not the one the Deployment's template names.
"""

from __future__ import annotations

import ast
import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

log = logging.getLogger(__name__)


class LabelsError(ValueError):
    """The labels file is missing, unreadable, or names a role the worker has not."""


def parse_labels(text: str) -> dict[str, str]:
    """The ``key="value"`` lines of a downward-API labels file as a mapping."""
    out: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        key, sep, quoted = line.partition("=")
        if not sep or len(quoted) < 2 or quoted[0] != '"' or quoted[-1] != '"':
            raise LabelsError(f'line {number}: {line!r} is not key="value"')
        try:
            value = ast.literal_eval(quoted)
        except (SyntaxError, ValueError) as e:
            raise LabelsError(f"line {number}: {quoted} is not a quoted string ({e})") from e
        out[key.strip()] = str(value)
    return out


def role_from_labels(path: Path, label: str, roles: Iterable[str], default: str) -> str:
    """The role ``label`` names in the labels file at ``path``; ``default`` when the pod
    carries no such label."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise LabelsError(
            f"cannot read the pod's labels at {path} ({e.strerror}): mount the downward "
            f"API's metadata.labels there, or drop --role-labels-file"
        ) from e
    role = parse_labels(text).get(label)
    if role is None:
        return default
    allowed = tuple(roles)
    if role not in allowed:
        raise LabelsError(
            f"the pod's label {label}={role!r} is not a role: set it to one of {', '.join(allowed)}"
        )
    return role


async def follow_role_label(
    path: Path,
    label: str,
    roles: Iterable[str],
    current: Callable[[], str | None],
    switch: Callable[[str], Awaitable[object]],
    *,
    poll_seconds: float,
    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
) -> None:
    """Read the labels file every ``poll_seconds`` and ``switch`` to the role ``label``
    names when it differs from ``current()`` (``None`` while a switch is under way: the
    file is read again once it is over). A file that cannot be read or a label that names
    no role is logged and the worker keeps serving the role it has; the label is read
    again at the next poll."""
    allowed = tuple(roles)
    while True:
        await sleep(poll_seconds)
        serving = current()
        if serving is None:
            continue
        try:
            wanted = role_from_labels(path, label, allowed, serving)
        except LabelsError as e:
            log.warning("keeping the role %s: %s", serving, e)
            continue
        if wanted != serving:
            log.info("the pod's label %s says %s: switching from %s", label, wanted, serving)
            await switch(wanted)

"""Label selectors as the API server reads them (``?labelSelector=`` on a list or a
watch): ``a=b``, ``a==b``, ``a!=b``, ``a in (x,y)``, ``a notin (x)``, ``a``, ``!a``,
joined by commas. Test support for :mod:`kube_emulator`; pure."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

Requirement = Callable[[Mapping[str, str]], bool]

_SET = re.compile(r"^\s*(!?)\s*([A-Za-z0-9./_-]+)\s*(?:(notin|in)\s*\(([^)]*)\))?\s*$")
_EQUALITY = re.compile(r"^\s*([A-Za-z0-9./_-]+)\s*(==|=|!=)\s*([A-Za-z0-9._-]*)\s*$")


class SelectorError(ValueError):
    """Not a label selector (the server answers 400)."""


def _split(selector: str) -> list[str]:
    """Split on the commas outside parentheses."""
    parts, depth, current = [], 0, ""
    for char in selector:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return [p for p in parts if p.strip()]


def _requirement(text: str) -> Requirement:
    equality = _EQUALITY.match(text)
    if equality:
        key, op, value = equality.groups()
        if op == "!=":
            return lambda labels: labels.get(key) != value
        return lambda labels: labels.get(key) == value
    found = _SET.match(text)
    if found is None:
        raise SelectorError(f"unable to parse requirement: {text!r}")
    negated, key, op, values = found.groups()
    if op is None:
        return (lambda labels: key not in labels) if negated else (lambda labels: key in labels)
    if negated:
        raise SelectorError(f"unable to parse requirement: {text!r}")
    allowed = {v.strip() for v in values.split(",") if v.strip()}
    if op == "in":
        return lambda labels: labels.get(key) in allowed
    return lambda labels: labels.get(key) not in allowed


def parse(selector: str | None) -> Requirement:
    """A predicate on an object's labels; an empty selector matches everything."""
    requirements = [_requirement(part) for part in _split(selector or "")]
    return lambda labels: all(r(labels) for r in requirements)

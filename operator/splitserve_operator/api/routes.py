"""``router.httpRoute``: a Gateway API HTTPRoute from a Gateway to the router Service."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import Field, StringConstraints, field_validator

from splitserve_operator.api.base import SpecModel
from splitserve_operator.api.durations import parse_duration

GATEWAY_DURATION = re.compile(r"^([0-9]{1,5}(h|m|s|ms)){1,4}$")
"""The duration syntax the Gateway API takes (GEP-2257: ``30s``, ``1h``, ``500ms``), a
subset of Go's."""
HOSTNAME = re.compile(r"^(\*\.)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
"""What an HTTPRoute's ``hostnames`` entry must be (a leading ``*.`` wildcard allowed)."""

Name = Annotated[str, StringConstraints(min_length=1, max_length=253)]


class ParentRef(SpecModel):
    """A Gateway (or a listener of one) the route attaches to, as in the Gateway API."""

    name: Name
    namespace: Annotated[str, StringConstraints(min_length=1, max_length=63)] | None = None
    section_name: Annotated[str, StringConstraints(min_length=1, max_length=253)] | None = None
    port: Annotated[int, Field(ge=1, le=65535)] | None = None
    group: Annotated[str, StringConstraints(max_length=253)] | None = None
    kind: Annotated[str, StringConstraints(min_length=1, max_length=63)] | None = None


class HttpRouteSpec(SpecModel):
    """Routes ``/v1`` (the OpenAI API) of ``hostnames`` on the ``parentRefs`` Gateways to
    the router Service; the router's ``/metrics`` and ``/health`` stay inside."""

    parent_refs: Annotated[list[ParentRef], Field(min_length=1, max_length=32)]
    hostnames: (
        Annotated[
            list[Annotated[str, StringConstraints(min_length=1, max_length=253)]],
            Field(max_length=16),
        ]
        | None
    ) = None
    """The hosts the route answers for; ``None``: whatever the listener accepts."""
    request_timeout: Annotated[str, StringConstraints(max_length=32)] | None = None
    """The gateway's bound on one request (``rules[].timeouts.request``); a streamed
    completion may take minutes. ``None``: the gateway's default."""

    @field_validator("hostnames")
    @classmethod
    def _hostnames(cls, value: list[str] | None) -> list[str] | None:
        for host in value or []:
            if not HOSTNAME.match(host):
                raise ValueError(f"{host!r} is not a hostname such as api.example.com")
        return value

    @field_validator("request_timeout")
    @classmethod
    def _timeout(cls, value: str | None) -> str | None:
        if value is not None and (not GATEWAY_DURATION.match(value) or not parse_duration(value)):
            raise ValueError(
                f"{value!r} is not a Gateway API duration above 0 such as 300s or 10m "
                "(whole numbers, units h, m, s, ms)"
            )
        return value

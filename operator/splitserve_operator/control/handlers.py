"""The kopf handlers: thin. Each one hands its trigger to the :class:`Controller`.

Built into a fresh :class:`kopf.OperatorRegistry` per operator instance (no global
registry), so tests and the bench can run several operators in one process.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Mapping, Sequence
from typing import Any

import kopf
import kubernetes.client

from splitserve_operator.api.fields import as_map
from splitserve_operator.api.values import GROUP
from splitserve_operator.control.controller import Controller
from splitserve_operator.control.outcome import RetryLater
from splitserve_operator.render.names import LABEL_MANAGED_BY, MANAGED_BY, PLURAL, VERSION


def connection_info(configuration: kubernetes.client.Configuration) -> kopf.ConnectionInfo:
    """kopf's credentials from the same client configuration the adapter uses."""
    header = configuration.get_api_key_with_prefix(
        "BearerToken"
    ) or configuration.get_api_key_with_prefix("authorization")
    parts: Sequence[str] = header.split(" ", 1) if header else []
    scheme, token = (
        (None, None) if not parts else (None, parts[0]) if len(parts) == 1 else (parts[0], parts[1])
    )
    return kopf.ConnectionInfo(
        server=configuration.host,
        ca_path=configuration.ssl_ca_cert,
        insecure=not configuration.verify_ssl,
        username=configuration.username or None,
        password=configuration.password or None,
        scheme=scheme,
        token=token,
        certificate_path=configuration.cert_file,
        private_key_path=configuration.key_file,
    )


def _plain(body: Mapping[str, Any]) -> dict[str, Any]:
    return copy.deepcopy(dict(body))


def _raw(event: Mapping[str, Any]) -> Mapping[str, Any]:
    """The object of a raw watch event (read only: nothing here mutates it)."""
    return as_map(event.get("object"))


def build_registry(controller: Controller) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    services = {"group": GROUP, "version": VERSION, "plural": PLURAL, "registry": registry}

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return connection_info(controller.client.configuration)

    # The two event handlers run on kopf's loop (no thread hop per event): their common
    # path is a cache update and a comparison; only a needed reconcile goes to a thread.

    @kopf.on.event(**services)  # type: ignore[arg-type]
    async def service_event(event: Mapping[str, Any], **_: Any) -> None:
        key = controller.observe_service(event.get("type"), _raw(event))
        if key is not None:
            await asyncio.get_running_loop().run_in_executor(None, controller.nudge, key)

    @kopf.on.resume(**services)  # type: ignore[arg-type]
    @kopf.on.create(**services)  # type: ignore[arg-type]
    @kopf.on.update(**services)  # type: ignore[arg-type]
    def reconcile(body: kopf.Body, **_: Any) -> None:
        try:
            controller.reconcile(_plain(body))
        except RetryLater as exc:
            raise kopf.TemporaryError(str(exc), delay=exc.delay) from exc

    @kopf.on.event(  # type: ignore[arg-type]
        "apps", "v1", "deployments", labels={LABEL_MANAGED_BY: MANAGED_BY}, registry=registry
    )
    async def deployment_event(event: Mapping[str, Any], **_: Any) -> None:
        triaged = controller.triage_deployment(event.get("type"), _raw(event))
        if triaged is not None:
            await asyncio.get_running_loop().run_in_executor(
                None, controller.follow_up, event.get("type"), *triaged
            )

    return registry

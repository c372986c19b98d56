"""The kopf handlers: thin. Each one hands its trigger to the :class:`Controller`.

Built into a fresh :class:`kopf.OperatorRegistry` per operator instance (no global
registry), so tests and the bench can run several operators in one process.

No handler here needs a finalizer (no timers, daemons or deletion handlers: children go
with their owner through the garbage collector), so kopf puts none on InferenceServices
and removes the one an older operator version may have left: deleting an
InferenceService never waits for the operator.

The first startup handler is the leadership gate: kopf starts no watch and no handler
until it returns, which it does once this replica holds the lease.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import kopf
import kubernetes.client

from splitserve_operator.api.fields import as_map
from splitserve_operator.api.values import GROUP
from splitserve_operator.control.controller import Controller
from splitserve_operator.render.names import PLURAL, POOL_PLURAL, VERSION


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


def _raw(event: Mapping[str, Any]) -> Mapping[str, Any]:
    """The object of a raw watch event (read only: nothing here mutates it)."""
    return as_map(event.get("object"))


def build_registry(
    controller: Controller,
    *,
    lead: Callable[[], bool] = lambda: True,
    step_down: Callable[[], None] = lambda: None,
) -> kopf.OperatorRegistry:
    """``lead``: blocks until this replica may act (False: it is stopping); ``step_down``:
    stops what ``lead`` started, when kopf stops."""
    registry = kopf.OperatorRegistry()
    services = {"group": GROUP, "version": VERSION, "plural": PLURAL, "registry": registry}

    @kopf.on.startup(registry=registry)
    async def take_the_lead(**_: Any) -> None:
        if not await asyncio.to_thread(lead):
            raise kopf.PermanentError("stopping before this replica became the leader")

    @kopf.on.cleanup(registry=registry)
    def stand_down(**_: Any) -> None:
        step_down()

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return connection_info(controller.client.configuration)

    # The event handlers run on kopf's loop (no thread hop per event): their common path
    # is a cache update or a comparison; only a needed reconcile goes to a thread.

    # Level-triggered: an InferenceService is reconciled when its status has not observed
    # its spec's generation, or when the watch lists it (start, restart, new leader). No
    # kopf change handler, so kopf writes no state of its own on the object (a request
    # and a watch event less per change); retries back off in the controller.
    @kopf.on.event(**services)  # type: ignore[arg-type]
    async def service_event(event: Mapping[str, Any], **_: Any) -> None:
        body = _raw(event)
        key = controller.observe_service(event.get("type"), body)
        if controller.wants_reconcile(event.get("type"), body):
            await asyncio.get_running_loop().run_in_executor(None, controller.nudge, key)

    # Only the operator's Deployments reach this handler: the watch carries a label
    # selector (settings.watching.label_selectors, see OperatorConfig.kopf_settings), so
    # the API server filters, not kopf.
    @kopf.on.event("apps", "v1", "deployments", registry=registry)  # type: ignore[arg-type]
    async def deployment_event(event: Mapping[str, Any], **_: Any) -> None:
        triaged = controller.triage_deployment(event.get("type"), _raw(event))
        if triaged is not None:
            await asyncio.get_running_loop().run_in_executor(
                None, controller.follow_up, event.get("type"), *triaged
            )

    @kopf.on.event(GROUP, VERSION, POOL_PLURAL, registry=registry)  # type: ignore[arg-type]
    async def pool_event(event: Mapping[str, Any], **_: Any) -> None:
        triaged = controller.triage_pool(event.get("type"), _raw(event))
        if triaged is not None:
            await asyncio.get_running_loop().run_in_executor(
                None, controller.follow_up, event.get("type"), *triaged
            )

    return registry

"""Wires an :class:`~.loop.Autoscaler` into kopf: the per-service timer, and starting
and stopping the operator's ``/metrics``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import kopf

from splitserve_operator.api.fields import as_map
from splitserve_operator.api.values import GROUP
from splitserve_operator.control.autoscaling.loop import Autoscaler
from splitserve_operator.render.names import PLURAL, VERSION


def install(registry: kopf.OperatorRegistry, autoscaler: Autoscaler) -> None:
    """Registers the autoscaling timer and the metrics endpoint on ``registry``."""

    def enabled(body: Mapping[str, Any], **_: Any) -> bool:
        # From the raw body: kopf's `spec` view raises on a spec that is not an object.
        return bool(as_map(as_map(as_map(body).get("spec")).get("autoscaling")).get("enabled"))

    @kopf.on.startup(registry=registry)
    def start_autoscaler_metrics(**_: Any) -> None:
        autoscaler.start_metrics_server()

    @kopf.on.cleanup(registry=registry)
    def stop_autoscaler(**_: Any) -> None:
        autoscaler.close()

    @kopf.timer(  # type: ignore[arg-type]
        GROUP,
        VERSION,
        PLURAL,
        interval=autoscaler.config.resolution_s,
        when=enabled,  # type: ignore[arg-type]
        registry=registry,
    )
    def autoscale(body: kopf.Body, **_: Any) -> None:
        autoscaler.tick(dict(body))

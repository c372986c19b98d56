"""How clients reach the router: its in-cluster URL, and the optional Gateway API
HTTPRoute (``router.httpRoute``) from a Gateway to its Service."""

from __future__ import annotations

from typing import Any

from splitserve_operator.api.models import InferenceServiceSpec
from splitserve_operator.api.values import Pool
from splitserve_operator.render import commands
from splitserve_operator.render.names import ServiceRef

GATEWAY_API_VERSION = "gateway.networking.k8s.io/v1"
API_PREFIX = "/v1"
"""What the route exposes: the OpenAI API. ``/metrics`` and ``/health`` stay inside."""


def router_url(ref: ServiceRef) -> str:
    """The router Service's URL inside the cluster (``status.url``)."""
    return f"http://{ref.service(Pool.ROUTER)}.{ref.namespace}.svc:{commands.ROUTER_HTTP_PORT}"


def http_route(ref: ServiceRef, spec: InferenceServiceSpec) -> dict[str, Any]:
    """The HTTPRoute ``router.httpRoute`` asks for. Without one, a route made before is
    detached from every Gateway (no ``parentRefs``), so nothing outside reaches the
    router through it any more (the operator deletes nothing)."""
    wanted = spec.router.http_route
    rule: dict[str, Any] = {
        "matches": [{"path": {"type": "PathPrefix", "value": API_PREFIX}}],
        "backendRefs": [{"name": ref.service(Pool.ROUTER), "port": commands.ROUTER_HTTP_PORT}],
    }
    body: dict[str, Any] = {"parentRefs": [], "rules": [rule]}
    if wanted is not None:
        body["parentRefs"] = [
            p.model_dump(by_alias=True, exclude_none=True, mode="json") for p in wanted.parent_refs
        ]
        if wanted.hostnames:
            body["hostnames"] = list(wanted.hostnames)
        if wanted.request_timeout:
            rule["timeouts"] = {"request": wanted.request_timeout}
    return {
        "apiVersion": GATEWAY_API_VERSION,
        "kind": "HTTPRoute",
        "metadata": ref.metadata(ref.http_route, "router"),
        "spec": body,
    }

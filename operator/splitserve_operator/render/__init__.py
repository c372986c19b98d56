"""Pure rendering: an InferenceService spec in, the desired Kubernetes objects out.

No kopf, no Kubernetes client, no gRPC here (``.importlinter`` enforces it), so
every field's effect is testable with plain dicts.
"""

from splitserve_operator.render.manifests import Desired, RenderInputs, render, render_deployment
from splitserve_operator.render.names import ServiceRef
from splitserve_operator.render.replicas import owns_desired_replicas, plan_replicas

__all__ = [
    "Desired",
    "RenderInputs",
    "ServiceRef",
    "owns_desired_replicas",
    "plan_replicas",
    "render",
    "render_deployment",
]

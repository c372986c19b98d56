"""What the API server fills in when a built-in object is stored without it: the
defaults that matter to an operator comparing what it applied with what it reads back
(a Deployment's rollout strategy, progress deadline and revision history; a pod
template's restart and DNS policy, probes and volume modes; a Service's type, ports
and cluster IP). Test support for :mod:`kube_emulator`; pure. Defaulting only fills
what is missing, and running it twice changes nothing."""

from __future__ import annotations

import ipaddress
import zlib
from collections.abc import Callable
from typing import Any

_PROBE = {"timeoutSeconds": 1, "periodSeconds": 10, "successThreshold": 1, "failureThreshold": 3}


def _image_pull_policy(image: str) -> str:
    last = image.rsplit("/", 1)[-1]
    tagged = ":" in last and not last.endswith(":latest")
    return "IfNotPresent" if tagged or "@" in image else "Always"


def _container(c: dict[str, Any]) -> None:
    c.setdefault("terminationMessagePath", "/dev/termination-log")
    c.setdefault("terminationMessagePolicy", "File")
    c.setdefault("imagePullPolicy", _image_pull_policy(str(c.get("image") or "")))
    for port in c.get("ports") or []:
        port.setdefault("protocol", "TCP")
    for name in ("livenessProbe", "readinessProbe", "startupProbe"):
        probe = c.get(name)
        if isinstance(probe, dict):
            for key, value in _PROBE.items():
                probe.setdefault(key, value)
            if isinstance(probe.get("httpGet"), dict):
                probe["httpGet"].setdefault("scheme", "HTTP")


def pod_spec(pod: dict[str, Any]) -> None:
    pod.setdefault("restartPolicy", "Always")
    pod.setdefault("dnsPolicy", "ClusterFirst")
    pod.setdefault("schedulerName", "default-scheduler")
    pod.setdefault("terminationGracePeriodSeconds", 30)
    pod.setdefault("securityContext", {})
    for c in [*(pod.get("initContainers") or []), *(pod.get("containers") or [])]:
        if isinstance(c, dict):
            _container(c)
    for volume in pod.get("volumes") or []:
        for source in ("configMap", "secret"):
            if isinstance(volume.get(source), dict):
                volume[source].setdefault("defaultMode", 0o644)


def deployment(obj: dict[str, Any]) -> None:
    spec = obj.setdefault("spec", {})
    spec.setdefault("replicas", 1)
    spec.setdefault("progressDeadlineSeconds", 600)
    spec.setdefault("revisionHistoryLimit", 10)
    strategy = spec.setdefault("strategy", {})
    strategy.setdefault("type", "RollingUpdate")
    if strategy["type"] == "RollingUpdate":
        rolling = strategy.setdefault("rollingUpdate", {})
        rolling.setdefault("maxSurge", "25%")
        rolling.setdefault("maxUnavailable", "25%")
    template = spec.setdefault("template", {})
    pod_spec(template.setdefault("spec", {}))


def _cluster_ip(obj: dict[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    seed = zlib.crc32(f"{meta.get('namespace')}/{meta.get('name')}".encode()) % 65000
    return str(ipaddress.IPv4Address("10.96.0.0") + 10 + seed)


def service(obj: dict[str, Any]) -> None:
    spec = obj.setdefault("spec", {})
    spec.setdefault("type", "ClusterIP")
    spec.setdefault("sessionAffinity", "None")
    spec.setdefault("internalTrafficPolicy", "Cluster")
    spec.setdefault("ipFamilyPolicy", "SingleStack")
    spec.setdefault("ipFamilies", ["IPv4"])
    if "clusterIP" not in spec:
        spec["clusterIP"] = _cluster_ip(obj)
    spec.setdefault("clusterIPs", [spec["clusterIP"]])
    for port in spec.get("ports") or []:
        port.setdefault("protocol", "TCP")
        port.setdefault("targetPort", port.get("port"))


DEFAULTERS: dict[str, Callable[[dict[str, Any]], None]] = {
    "apps/v1/deployments": deployment,
    "v1/services": service,
}
"""Resource (``group/version/plural``) -> what the server defaults in it."""

"""Security settings that make every operator-made pod meet the "restricted"
Pod Security Standard: non-root, no privilege escalation, no capabilities,
RuntimeDefault seccomp, read-only root filesystem.

User and group IDs are left out unless the spec sets them (``podSecurityContext``):
the images run as a numeric non-root user (``USER 10001:10001`` in
``Dockerfile.worker``), which ``runAsNonRoot`` accepts, and platforms that assign IDs
per namespace (OpenShift's restricted-v2) refuse fixed ones. An RDMA pool that asks for
``IPC_LOCK`` leaves the restricted profile: its namespace must allow that capability.
"""

from __future__ import annotations

from typing import Any

from splitserve_operator.api.pods import PodSecurity

IPC_LOCK = "IPC_LOCK"
"""Lets a process pin memory (RDMA memory registration) beyond its memlock limit."""


def pod_security_context(ids: PodSecurity | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    if ids is not None:
        out.update(ids.model_dump(by_alias=True, exclude_none=True, mode="json"))
    return out


def container_security_context(*, ipc_lock: bool = False) -> dict[str, Any]:
    capabilities: dict[str, Any] = {"drop": ["ALL"]}
    if ipc_lock:
        capabilities["add"] = [IPC_LOCK]
    return {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": capabilities,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


_ALLOWED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
_SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """Where a pod spec breaks the "restricted" Pod Security Standard (empty: it meets it).

    The checks of https://kubernetes.io/docs/concepts/security/pod-security-standards/
    (baseline and restricted), as the admission controller applies them.
    """
    out: list[str] = []
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(flag):
            out.append(f"{flag} must not be set")
    psc = pod.get("securityContext") or {}
    for volume in pod.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= _ALLOWED_VOLUMES:
            out.append(f"volume {volume.get('name')}: type {sorted(kinds)} is not allowed")
    for sysctl in psc.get("sysctls") or []:
        if sysctl.get("name") not in _SAFE_SYSCTLS:
            out.append(f"sysctl {sysctl.get('name')} is not allowed")
    pod_seccomp = (psc.get("seccompProfile") or {}).get("type")
    containers = list(pod.get("initContainers") or []) + list(pod.get("containers") or [])
    if not containers:
        out.append("no containers")
    for c in containers:
        name = c.get("name")
        csc = c.get("securityContext") or {}
        if csc.get("privileged"):
            out.append(f"{name}: privileged")
        if csc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation must be false")
        caps = csc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"{name}: capabilities must drop ALL")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            out.append(f"{name}: capabilities may only add NET_BIND_SERVICE")
        non_root = csc.get("runAsNonRoot", psc.get("runAsNonRoot"))
        if non_root is not True:
            out.append(f"{name}: runAsNonRoot must be true")
        if csc.get("runAsUser", psc.get("runAsUser")) == 0:
            out.append(f"{name}: runAsUser must not be 0")
        seccomp = (csc.get("seccompProfile") or {}).get("type") or pod_seccomp
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: seccompProfile must be RuntimeDefault or Localhost")
        for port in c.get("ports") or []:
            if port.get("hostPort"):
                out.append(f"{name}: hostPort must not be set")
        if csc.get("procMount") not in (None, "Default"):
            out.append(f"{name}: procMount must be Default")
        if not csc.get("readOnlyRootFilesystem"):
            out.append(
                f"{name}: readOnlyRootFilesystem (splitserve's own rule, beyond the profile)"
            )
    return out

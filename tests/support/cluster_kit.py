"""A real cluster through ``kubectl`` and ``helm``, for the e2e suite (test support; it
runs only with ``KUBECONFIG`` set): calling kubectl, reading objects, waiting."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")


def kubectl_binary() -> str:
    local = ROOT / ".venv" / "bin" / "kubectl"
    found = str(local) if local.exists() else shutil.which("kubectl")
    if not found:
        raise FileNotFoundError("kubectl is not installed (bash .ci/install-tools.sh .venv)")
    return found


def kubectl(
    *args: str, check: bool = True, input_: str | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [kubectl_binary(), *args],
        capture_output=True,
        text=True,
        check=check,
        timeout=timeout,
        input=input_,
    )


def get(kind: str, name: str, namespace: str) -> dict[str, Any] | None:
    """The object as JSON, or None when it does not exist."""
    out = kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
    return json.loads(out.stdout) if out.returncode == 0 else None


def items(kind: str, namespace: str, selector: str = "") -> list[dict[str, Any]]:
    args = ["get", kind, "-n", namespace, "-o", "json"]
    if selector:
        args += ["-l", selector]
    return list(json.loads(kubectl(*args).stdout)["items"])


def wait_until(what: str, timeout: float, fn: Callable[[], T | None], interval: float = 2) -> T:
    """``fn()``'s first truthy value; fails after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def split_image(image: str) -> tuple[str, str]:
    """``repository:tag`` -> (repository, tag)."""
    repo, _, tag = image.rpartition(":")
    return (repo, tag) if repo and "/" not in tag else (image, "latest")


def condition(body: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    for c in ((body or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == type_:
            return dict(c)
    return {}

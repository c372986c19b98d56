"""The chart's ``helm test`` Pod, run here: its script, exactly as ``helm template``
renders it, asks a real router (in front of a real decode worker on the tiny model) for
``/v1/models`` over HTTP, with the API key the router requires, and passes only when a
model is listed."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import helm_chart as chart
import pytest
from splitserve.roles import Role
from splitserve_worker.commands.up import WorkerProcs
from stack_kit import router

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def test_pod() -> dict[str, Any]:
    if chart.find_helm() is None:
        if os.environ.get("CI"):
            pytest.fail("helm is missing in CI: run bash .ci/install-tools.sh .venv")
        pytest.skip("helm is not installed (bash .ci/install-tools.sh .venv)")
    documents = chart.template(
        sets=["tests.inferenceService.name=tiny", "tests.apiKeySecret.name=tiny-api-key"]
    )
    (pod,) = [d for d in documents if d["kind"] == "Pod"]
    return dict(pod)


def _run(
    pod: dict[str, Any], router_url: str, api_key: str | None
) -> subprocess.CompletedProcess[str]:
    """The Pod's container, as a process here: its command, args and plain env, the URL
    pointed at the router on 127.0.0.1 and the key as its Secret would give it."""
    (container,) = pod["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    assert env["ROUTER_URL"].startswith("http://tiny-router.")
    env["ROUTER_URL"] = router_url
    if api_key is not None:
        env["API_KEY"] = api_key
    command = [sys.executable if c == "python" else c for c in container["command"]]
    return subprocess.run(
        [*command, *container["args"]],
        env={**env, "PATH": os.environ.get("PATH", "")},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_helm_test_passes_against_a_router_and_fails_without_its_key(
    test_pod: dict[str, Any], tiny_model_path: Path
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_path))
    token = secrets.token_hex(8)
    with (
        WorkerProcs(str(tiny_model_path), [Role.DECODE], token, threads=1, echo=False) as procs,
        router(token, tokenizer, procs.start(timeout_s=300), api_key="s3cret") as url,
    ):
        passed = _run(test_pod, url, "s3cret")
        assert passed.returncode == 0, passed.stderr
        assert "serves ['tiny']" in passed.stdout
        refused = _run(test_pod, url, None)  # the Secret missing: 401
        assert refused.returncode != 0 and "401" in refused.stderr


def test_the_helm_test_fails_where_no_router_answers(test_pod: dict[str, Any]) -> None:
    gone = _run(test_pod, "http://127.0.0.1:9", None)
    assert gone.returncode != 0 and "Connection refused" in gone.stderr

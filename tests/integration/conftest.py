"""Shared fixtures for tests against the Kubernetes API emulator (kmock over HTTP).

Reuse them from any integration test (the planner's too):

- ``kube``: an :class:`emulator_thread.EmulatorThread` serving a fresh
  :class:`kube_emulator.KubeEmulator` on 127.0.0.1 (server-set
  metadata, resourceVersions, status subresource, garbage collection, fault
  injection with ``kube.add_fault``). ``kube.objects("apps/v1/deployments")`` reads
  its state; ``kube.requests()`` lists what was served.
- ``kube_client``: the operator's own adapter (:class:`~splitserve_operator.control.k8s.KubeClient`,
  the official client underneath) pointed at it with a configuration object, never
  ``$KUBECONFIG``.
- ``start_operator``: starts the real kopf operator in a thread against the emulator,
  cluster-wide, with test-friendly settings; stopped at teardown. Call it again
  after stopping one to restart, or beside a running one (with ``leader_election``) for a
  standby (``wait_for_lead=False`` returns before it leads). ``clock=`` /
  ``wall_clock=`` hand the autoscaling loop a test's clock (see
  ``manual_clock.ManualClock``), so a test decides when a tick is due.
- ``wait_for(predicate, timeout)``: poll until ``predicate()`` is truthy and return it.
- ``inference_service(name, namespace, **spec)``: a manifest with a valid minimal spec.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest
from emulator_thread import EmulatorThread
from operator_thread import OperatorThread
from splitserve_operator.control.config import OperatorConfig
from splitserve_operator.control.k8s import KubeClient

T = TypeVar("T")


def wait_for(
    predicate: Callable[[], T],
    timeout: float = 30.0,
    interval: float = 0.05,
    message: str = "condition",
) -> T:
    """``predicate()`` once it is truthy. ``timeout`` only bounds a failure: the operator's
    chain of watch events and writes takes well over 10 s on a loaded two-core machine."""
    deadline = time.monotonic() + timeout
    last: T = predicate()
    while not last:
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {message}")
        time.sleep(interval)
        last = predicate()
    return last


def inference_service(
    name: str = "demo", namespace: str = "default", **spec: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": {"name": "smollm2-135m", "dtype": "float32"},
        "image": "splitserve/worker:0.1.0",
        "prefill": {"replicas": 1, "gpus": 0},
        "decode": {"replicas": 1, "gpus": 0},
    }
    body.update(spec)
    return {
        "apiVersion": "splitserve.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": namespace},
        "spec": body,
    }


@pytest.fixture(name="wait_for")
def wait_for_fixture() -> Callable[..., Any]:
    return wait_for


@pytest.fixture(name="inference_service")
def inference_service_fixture() -> Callable[..., dict[str, Any]]:
    return inference_service


@pytest.fixture
def kube() -> Iterator[EmulatorThread]:
    with EmulatorThread() as emulator:
        yield emulator


@pytest.fixture
def kube_client(kube: EmulatorThread) -> Iterator[KubeClient]:
    client = KubeClient(kube.configuration(), timeout=10, user_agent="splitserve-tests")
    yield client
    client.close()


def operator_config(**overrides: Any) -> OperatorConfig:
    """Operator settings for tests: short timeouts, no periodic resync unless asked."""
    values: dict[str, Any] = {
        "resync_seconds": 0,
        "workers": 4,
        "request_timeout": 5,
        "watch_timeout": None,
    }
    values.update(overrides)
    return OperatorConfig(**values)


@pytest.fixture
def start_operator(kube: EmulatorThread) -> Iterator[Callable[..., OperatorThread]]:
    started: list[OperatorThread] = []

    def start(
        *,
        wait_for_lead: bool = True,
        clock: Callable[[], float] | None = None,
        wall_clock: Callable[[], dt.datetime] | None = None,
        **overrides: Any,
    ) -> OperatorThread:
        op = OperatorThread(
            operator_config(**overrides),
            kube.configuration(),
            timeout=20,
            clock=clock,
            wall_clock=wall_clock,
        )
        started.append(op)
        op.start(wait_for_lead=wait_for_lead)
        return op

    yield start
    for op in started:
        op.stop()

"""Switching instead of scaling, in the real operator (kopf, the official client) against
the Kubernetes API emulator, from the real Prometheus.

Prometheus scrapes a target whose router and worker series follow the mix the test
sets (:mod:`synthetic_series`): prompt-heavy (TTFT above its SLO, TPOT well under), then
generation-heavy (the reverse), then prompt-heavy again. The service has one fixed
prefill and one fixed decode pod and two switchable pods (the emulator has no
ReplicaSet controller: the test makes the pods from the flex Deployment's template and
marks them Ready). Each load turn switches one pod by its role label, seen in the label
and in ``status.flex``, while the fixed pools keep their size; no two switches come
closer than the dwell.

The planner's clock is the test's (:class:`ManualClock`): a tick is due only when the
test moves it, after Prometheus scraped again, and only once the PromQL windows hold
nothing but the current mix. Waits are for conditions, never fixed sleeps.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import helm_chart as chart
import pytest
from manual_clock import ManualClock
from operator_helpers import mark_ready
from prom_fixture import PrometheusServer, ScrapeTarget, prometheus  # noqa: F401
from splitserve.role_balance import BalanceConfig
from splitserve_operator.control.autoscaling.config import AutoscaleConfig, FlexConfig
from splitserve_operator.control.k8s import DEPLOYMENT, INFERENCE_SERVICE, POD, WORKER_POOL
from splitserve_operator.control.prometheus import PrometheusSource, Target
from splitserve_operator.planner.model import Observation
from synthetic_series import Mix, SyntheticTarget

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NAMESPACE, NAME = "default", "demo"
ROLE = "splitserve.io/role"
WINDOW_S = 10.0
"""Seconds the planner's PromQL windows look back."""
INTERVAL_S = 5
DWELL_S = 30.0
SUSTAIN_S = 5.0
TTFT_SLO, TPOT_SLO = 1.0, 0.05
MAX_TICKS = 12
"""Ticks a load turn may take to switch (sustain and dwell need at most seven)."""

CALM = Mix(requests_per_s=2, prompt_tokens=256, output_tokens=32, ttft_s=0.2, tpot_s=0.02,
           kv_used=0.3)  # fmt: skip
PROMPTS = Mix(requests_per_s=2, prompt_tokens=1024, output_tokens=8, ttft_s=3.0, tpot_s=0.02,
              kv_used=0.2)  # fmt: skip
ANSWERS = Mix(requests_per_s=2, prompt_tokens=64, output_tokens=256, ttft_s=0.2, tpot_s=0.2,
              kv_used=0.5)  # fmt: skip

FLEX = FlexConfig(
    balance=BalanceConfig(min_dwell_s=DWELL_S, sustain_s=SUSTAIN_S),
    drain_s=5.0,
    prefix_hit_ratio=0.5,
    cold_start_s=300.0,
)


def _prompt_heavy(o: Observation) -> bool:
    return (o.ttft_s or 0.0) > TTFT_SLO and (o.tpot_s or TPOT_SLO) < TPOT_SLO / 2


def _generation_heavy(o: Observation) -> bool:
    return (o.tpot_s or 0.0) > TPOT_SLO and (o.ttft_s or TTFT_SLO) < TTFT_SLO / 2


@dataclass(frozen=True)
class Seen:
    """What one tick wrote: the clock's time, ``status.flex`` and the fixed pools' targets."""

    at: float
    flex: dict[str, Any]
    targets: dict[str, int]


def _status(kube_client: Any) -> dict[str, Any]:
    return (kube_client.get(INFERENCE_SERVICE, NAMESPACE, NAME) or {}).get("status") or {}


def _roles(kube_client: Any) -> dict[str, str]:
    pods = kube_client.list(POD, NAMESPACE, "app.kubernetes.io/component=flex")
    return {p["metadata"]["name"]: p["metadata"]["labels"][ROLE] for p in pods}


def _make_pods(kube_client: Any, wait_for: Callable[..., Any]) -> None:
    """Two pods as the flex Deployment's ReplicaSet would make them, Ready."""
    flex = wait_for(lambda: kube_client.get(DEPLOYMENT, NAMESPACE, f"{NAME}-flex"),
                    message="the flex Deployment")  # fmt: skip
    labels = dict(flex["spec"]["template"]["metadata"]["labels"])
    assert labels[ROLE] == "both"
    for suffix in ("a", "b"):
        name = f"{NAME}-flex-{suffix}"
        kube_client.create({"apiVersion": "v1", "kind": "Pod",
                            "metadata": {"name": name, "namespace": NAMESPACE, "labels": labels},
                            "spec": flex["spec"]["template"]["spec"]})  # fmt: skip
        ready = {"status": {"phase": "Running",
                            "conditions": [{"type": "Ready", "status": "True"}]}}  # fmt: skip
        kube_client.patch(POD, NAMESPACE, name, ready, subresource="status")


class Ticks:
    """One planner tick at a time, through the operator's own autoscaling loop, each on
    a fresh scrape of a window that holds only the mix set last."""

    def __init__(
        self,
        clock: ManualClock,
        kube_client: Any,
        prometheus: PrometheusServer,  # noqa: F811
        series: SyntheticTarget,
        wait_for: Callable[..., Any],
    ) -> None:
        self.clock = clock
        self.kube_client = kube_client
        self.prometheus = prometheus
        self.series = series
        self.wait_for = wait_for
        self.source = PrometheusSource(prometheus.url)
        self.target = Target(NAMESPACE, NAME, 0.9, WINDOW_S, 5.0)
        self.seen: list[Seen] = []

    def close(self) -> None:
        self.source.close()

    def _scraped_after(self, since: float) -> float:
        got = self.prometheus.wait_for(
            f'timestamp(up{{inferenceservice="{NAME}"}})',
            lambda v: v is not None and v > since,
            timeout_s=60,
        )
        assert got is not None
        return got

    def turn(self, mix: Mix, shows: Callable[[Observation], bool]) -> None:
        """Sets the series to ``mix`` and waits until every sample the windows read was
        scraped under it and the planner's own query ``shows`` it."""
        self.series.service.set(mix)
        now = self.prometheus.value("time()")
        assert now is not None
        self._scraped_after(now + WINDOW_S + 1)
        self.wait_for(lambda: shows(self.source.observe(self.target)), timeout=30,
                      interval=0.5, message=f"Prometheus shows {mix}")  # fmt: skip

    def _landed(self) -> Seen:
        stamp = self.clock.stamp()

        def written() -> dict[str, Any] | None:
            status = _status(self.kube_client)
            done = (status.get("autoscaling") or {}).get("lastTickTime") == stamp
            return status if done and "flex" in status else None

        status = self.wait_for(written, timeout=60, interval=0.1, message=f"the tick at {stamp}")
        targets = {}
        for pool in ("prefill", "decode"):
            body = self.kube_client.get(WORKER_POOL, NAMESPACE, f"{NAME}-{pool}")
            targets[pool] = body["spec"]["replicas"]
            assert status["autoscaling"]["pools"][pool]["desiredReplicas"] == targets[pool]
        seen = Seen(self.clock.monotonic(), dict(status["flex"]), targets)
        self.seen.append(seen)
        return seen

    def first(self) -> Seen:
        return self._landed()

    def next(self) -> Seen:
        self._scraped_after(self.prometheus.value("time()") or 0.0)
        self.clock.advance(INTERVAL_S)
        return self._landed()

    def until_switch(self, what: str) -> Seen:
        before = len(self.switches())
        for _ in range(MAX_TICKS):
            seen = self.next()
            if len(self.switches()) > before:
                return seen
        raise AssertionError(f"{what}: no switch after {MAX_TICKS} ticks: {self.seen[-4:]}")

    def switches(self) -> list[Seen]:
        return [s for s in self.seen if s.flex["reason"] == "switch"]


def _events(kube: Any, reason: str) -> list[str]:
    return [
        e["message"]
        for e in kube.objects("v1/events", NAMESPACE)
        if e.get("reason") == reason and e["involvedObject"]["name"] == NAME
    ]


def test_a_load_turn_switches_a_flex_pod_instead_of_scaling_and_back_at_most_once_a_dwell(
    kube: Any,
    kube_client: Any,
    start_operator: Callable[..., Any],
    inference_service: Callable[..., dict[str, Any]],
    wait_for: Callable[..., Any],
    prometheus: PrometheusServer,  # noqa: F811
) -> None:
    clock = ManualClock()
    with SyntheticTarget(CALM) as series:
        prometheus.set_targets(
            [ScrapeTarget(series.address, {"namespace": NAMESPACE, "inferenceservice": NAME})]
        )
        start_operator(
            autoscale=AutoscaleConfig(
                resolution_s=0.3, window_s=WINDOW_S, fast_window_s=5.0, flex=FLEX
            ),
            clock=clock.monotonic,
            wall_clock=clock.wall,
        )
        ticks = Ticks(clock, kube_client, prometheus, series, wait_for)
        try:
            ticks.turn(CALM, lambda o: o.ttft_s is not None and o.tpot_s is not None)
            kube_client.create(
                inference_service(
                    NAME,
                    NAMESPACE,
                    flex={"replicas": 2, "gpus": 0},
                    slo={"ttft": f"{TTFT_SLO}s", "tpot": f"{TPOT_SLO}s", "percentile": 90},
                    autoscaling={
                        "enabled": True,
                        "prometheusUrl": prometheus.url,
                        "interval": f"{INTERVAL_S}s",
                        "prefill": {"minReplicas": 1, "maxReplicas": 4},
                        "decode": {"minReplicas": 1, "maxReplicas": 4},
                    },
                )
            )
            _make_pods(kube_client, wait_for)
            wait_for(lambda: kube_client.get(DEPLOYMENT, NAMESPACE, f"{NAME}-router"),
                     message="the router Deployment")  # fmt: skip
            mark_ready(kube_client)
            calm = ticks.first()
            if calm.flex["both"] != 2:  # the first tick may have run before the pods existed
                calm = ticks.next()
            assert (calm.flex["both"], calm.flex["reason"]) == (2, "balanced"), calm

            # Prompt-heavy: a colocated pod gives up decode once the pressure is sustained.
            ticks.turn(PROMPTS, _prompt_heavy)
            first = ticks.until_switch("prompt-heavy")
            assert _roles(kube_client) == {"demo-flex-a": "prefill", "demo-flex-b": "both"}
            assert (first.flex["prefill"], first.flex["both"]) == (1, 1)
            assert first.flex["lastSwitch"]["pod"] == "demo-flex-a"
            assert (first.flex["lastSwitch"]["from"], first.flex["lastSwitch"]["to"]) == (
                "both", "prefill")  # fmt: skip
            assert ticks.seen[-2].flex["reason"] == "not_sustained"

            # Generation-heavy at once: the same pod moves to decode, but only a dwell on.
            ticks.turn(ANSWERS, _generation_heavy)
            second = ticks.until_switch("generation-heavy")
            assert _roles(kube_client) == {"demo-flex-a": "decode", "demo-flex-b": "both"}
            assert (second.flex["prefill"], second.flex["decode"]) == (0, 1)
            held = [s for s in ticks.seen if first.at < s.at < second.at]
            assert held and all(s.flex["reason"] in ("dwell", "not_sustained") for s in held)
            assert any(s.flex["reason"] == "dwell" for s in held), held

            # Prompt-heavy again: it switches back.
            ticks.turn(PROMPTS, _prompt_heavy)
            third = ticks.until_switch("prompt-heavy again")
            assert _roles(kube_client) == {"demo-flex-a": "prefill", "demo-flex-b": "both"}
            assert third.flex["lastSwitch"]["from"] == "decode"
        finally:
            ticks.close()

        # never more than one switch per dwell, and not one new pod: the fixed pools held
        times = [s.at for s in ticks.switches()]
        assert len(times) == 3 and all(b - a >= DWELL_S for a, b in itertools.pairwise(times)), (
            times
        )
        assert all(s.targets == {"prefill": 1, "decode": 1} for s in ticks.seen), ticks.seen
        wait_for(lambda: len(_events(kube, "RoleSwitched")) == 3, message="three RoleSwitched")
        messages = sorted(_events(kube, "RoleSwitched"))
        assert any("pod demo-flex-a decode -> prefill" in m for m in messages), messages
        assert not _events(kube, "ScaledUp")

    # every call the operator made for it (the pods' list and relabels among them) is one
    # the chart's RBAC allows
    calls = set(
        chart.api_calls(
            [
                (s.method, s.path, s.watch)
                for s in kube.requests()
                if s.agent.startswith(("splitserve-operator/", "kopf/"))
            ]
        )
    )
    assert ("", "pods", "patch", NAMESPACE, "demo-flex-a") in calls
    assert ("", "pods", "list", NAMESPACE, None) in calls
    if chart.find_helm() is None:
        if os.environ.get("CI"):
            pytest.fail("helm is missing in CI: run bash .ci/install-tools.sh .venv")
        pytest.skip("the switches passed; the RBAC check needs helm (bash .ci/install-tools.sh)")
    rules = chart.rules(chart.template(), "splitserve")
    missing = [c for c in sorted(calls, key=str) if not chart.allows(rules, *c[:3])]
    assert not missing, f"the chart's RBAC lacks: {missing}"

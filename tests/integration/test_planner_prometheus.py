"""The whole loop on real parts: real worker and router processes under load, the real
Prometheus scraping them every second, and the real operator (kopf, the official
client) against the Kubernetes API emulator. The decode pool scales up when TPOT
breaks the SLO and back down when the load stops, from what Prometheus shows (the
test injects no metric). Then every dashboard query runs against that Prometheus.

The planner's clock is the test's (:class:`ManualClock`): each tick runs in the
operator's own autoscaling loop, but only when the test moves the clock, after the Deployments
followed the last decision and Prometheus scraped again, so no outcome depends on
how many ticks a stretch of wall-clock time holds. Waits are for conditions (a fresh
scrape, a full PromQL window of the current load, a tick's status), never fixed sleeps.

The only stand-in is the Deployment controller: the emulator has none, so a thread
here marks a Deployment's replicas ready as soon as it asks for them. The worker
processes themselves do not multiply; the planner's decision is what is checked.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from manual_clock import ManualClock
from prom_fixture import PrometheusServer, ScrapeTarget, free_port, prometheus  # noqa: F401
from prom_stack import LiveStack, Load
from splitserve.metric_names import exported_series_names
from splitserve_operator.control.autoscaling.config import AutoscaleConfig
from splitserve_operator.control.k8s import DEPLOYMENT, INFERENCE_SERVICE, KubeClient
from splitserve_operator.dashboards.export import build_all
from splitserve_operator.dashboards.grafana import expressions
from splitserve_operator.planner.config import PlannerConfig

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NAMESPACE, NAME = "default", "demo"
LABELS = {"namespace": NAMESPACE, "inferenceservice": NAME}
TPOT_P90 = (
    "histogram_quantile(0.9, sum by (le) (rate("
    f'splitserve_time_per_output_token_seconds_bucket{{inferenceservice="{NAME}"}}[10s])))'
)
LIGHT, HEAVY = 1, 16
"""Concurrent streaming clients in the light and the heavy phase."""
WINDOW_S = 10.0
"""Seconds the PromQL windows look back (the TPOT query here and the planner's)."""
INTERVAL_S = 5
"""The service's ``autoscaling.interval``: one tick per this many clock seconds."""
CALIBRATION_TRIES = 3
LIGHT_TICKS = 4
"""Ticks under light load, each on a fresh scrape, with no scale-up unless TPOT broke."""
MAX_TICKS = 120
"""Ticks a phase may take at most (each waits for a fresh scrape: about a second)."""
SLO_POSITION = 0.6
"""Where the TPOT SLO sits between the light and heavy p90, on a log scale: light
load runs at (light/heavy)^0.6 of it, heavy load at (heavy/light)^0.4 of it."""
PLANNER = PlannerConfig(down_stabilization_s=10, cooldown_after_up_s=15, cooldown_after_down_s=5)
METRIC = re.compile(r"\b(splitserve_[a-z0-9_]+)\b")


@pytest.fixture(scope="module")
def stack(
    tiny_model_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    prometheus: PrometheusServer,  # noqa: F811
) -> Iterator[LiveStack]:
    live = LiveStack(tiny_model_path, tmp_path_factory.mktemp("stack"), LABELS)
    try:
        live.start()
        prometheus.set_targets(live.targets())
        prometheus.wait_for(
            f'count(up{{inferenceservice="{NAME}"}} == 1)', lambda v: v == 3, timeout_s=60
        )
        yield live
    finally:
        live.stop()


def _scraped_since(prometheus: PrometheusServer, since: float) -> float:  # noqa: F811
    """Waits until Prometheus scraped every target of the service after ``since``
    (Prometheus time, s); returns the oldest of those scrapes."""
    got = prometheus.wait_for(
        f'min(timestamp(up{{inferenceservice="{NAME}"}}))',
        lambda v: v is not None and v > since,
        timeout_s=60,
    )
    assert got is not None
    return got


def _hold_for_a_window(prometheus: PrometheusServer) -> None:  # noqa: F811
    """Waits until every sample the 10 s PromQL windows read was scraped from now on
    (under the load the caller runs), however late the scrapes come on a busy machine."""
    now = prometheus.value("time()")
    assert now is not None
    _scraped_since(prometheus, now + WINDOW_S + 1)


def _measure(prometheus: PrometheusServer, stack: LiveStack, clients: int) -> float:  # noqa: F811
    with Load(stack.base_url, clients) as load:
        _hold_for_a_window(prometheus)
        value = prometheus.value(TPOT_P90)
    assert not load.errors, load.errors[:3]
    assert value is not None, "no TPOT reading under load"
    return value


class ReadyMirror:
    """The Deployment controller the emulator lacks: ready = asked, at once."""

    def __init__(self, client: KubeClient, names: list[str]) -> None:
        self.client = client
        self.names = names
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            for name in self.names:
                d = self.client.get(DEPLOYMENT, NAMESPACE, name)
                if d is None:
                    continue
                want = d["spec"].get("replicas", 1)
                if (d.get("status") or {}).get("readyReplicas") == want:
                    continue
                status = {
                    "observedGeneration": d["metadata"].get("generation"),
                    "replicas": want,
                    "readyReplicas": want,
                    "updatedReplicas": want,
                    "availableReplicas": want,
                }
                self.client.patch(
                    DEPLOYMENT, NAMESPACE, name, {"status": status}, subresource="status"
                )

    def __enter__(self) -> ReadyMirror:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _start(
    start_operator: Callable[..., Any],
    kube_client: KubeClient,
    inference_service: Callable[..., dict[str, Any]],
    prometheus: PrometheusServer,  # noqa: F811
    stack: LiveStack,
    tpot_slo: float,
    clock: ManualClock | None = None,
) -> None:
    """The operator with a fast planner, its /metrics scraped, and the service created.
    With ``clock``, the planner's time is that clock's: a tick is due only when the
    test moves it."""
    port = free_port()
    clocks: dict[str, Any] = {}
    if clock is not None:
        clocks = {"clock": clock.monotonic, "wall_clock": clock.wall}
    start_operator(
        autoscale=AutoscaleConfig(
            resolution_s=0.5 if clock is not None else 1.0,
            window_s=WINDOW_S,
            fast_window_s=5.0,
            metrics_port=port,
            metrics_host="127.0.0.1",
            planner=PLANNER,
        ),
        **clocks,
    )
    prometheus.set_targets([*stack.targets(), ScrapeTarget(f"127.0.0.1:{port}", {})])
    kube_client.create(
        inference_service(
            NAME,
            NAMESPACE,
            prefill={"replicas": 1, "gpus": 0},
            decode={"replicas": 1, "gpus": 0},
            slo={"ttft": "30s", "tpot": f"{tpot_slo}s", "percentile": 90},
            autoscaling={
                "enabled": True,
                "prometheusUrl": prometheus.url,
                "interval": f"{INTERVAL_S}s",
                "prefill": {"minReplicas": 1, "maxReplicas": 2},
                "decode": {"minReplicas": 1, "maxReplicas": 4},
            },
        )
    )


def _status(kube_client: KubeClient) -> dict[str, Any]:
    body = kube_client.get(INFERENCE_SERVICE, NAMESPACE, NAME)
    return (body or {}).get("status") or {}


def _decode_target(kube_client: KubeClient) -> int | None:
    return ((_status(kube_client).get("pools") or {}).get("decode") or {}).get("desiredReplicas")


def _planner(kube_client: KubeClient) -> dict[str, Any]:
    return ((_status(kube_client).get("autoscaling") or {}).get("pools") or {}).get("decode") or {}


def _scaling_active(kube_client: KubeClient) -> bool:
    return any(
        c["type"] == "ScalingActive" and c["status"] == "True"
        for c in _status(kube_client).get("conditions") or []
    )


def _events(kube: Any, reason: str) -> list[str]:
    return [
        e["message"]
        for e in kube.objects("v1/events", NAMESPACE)
        if e.get("reason") == reason and e["involvedObject"]["name"] == NAME
    ]


@dataclass(frozen=True)
class Decision:
    """What one planner tick wrote for the decode pool."""

    target: int
    reason: str
    message: str
    slo_ratio: float | None


class Ticks:
    """The planner's ticks, one at a time, through the operator's own autoscaling loop.

    The planner's clock is a :class:`ManualClock`: the loop wakes every half second but
    finds a tick due only after :meth:`next` moved the clock by the interval, and the
    status that tick wrote carries the clock's stamp. Before each tick the Deployments
    have followed the last decision and Prometheus has scraped every target again, so
    each tick sees the pool as it was asked to be and new metrics; how long any of that
    takes on a busy machine does not matter."""

    def __init__(
        self,
        clock: ManualClock,
        kube_client: KubeClient,
        prometheus: PrometheusServer,  # noqa: F811
        wait_for: Callable[..., Any],
    ) -> None:
        self.clock = clock
        self.kube_client = kube_client
        self.prometheus = prometheus
        self.wait_for = wait_for
        self.scraped = 0.0
        self.seen: list[Decision] = []

    def _landed(self) -> Decision:
        stamp = self.clock.stamp()

        def written() -> dict[str, Any] | None:
            status = _status(self.kube_client)
            done = (status.get("autoscaling") or {}).get("lastTickTime") == stamp
            return status if done else None

        status = self.wait_for(written, timeout=60, interval=0.1, message=f"the tick at {stamp}")
        entry = status["autoscaling"]["pools"]["decode"]
        decision = Decision(
            target=entry["desiredReplicas"],
            reason=entry["reason"],
            message=entry["message"],
            slo_ratio=entry.get("sloRatio"),
        )
        self.seen.append(decision)
        return decision

    def first(self) -> Decision:
        """The tick the service gets as soon as its Deployments exist."""
        return self._landed()

    def _settled(self) -> bool:
        status = _status(self.kube_client)
        for pool in ("prefill", "decode"):
            want = ((status.get("pools") or {}).get(pool) or {}).get("desiredReplicas")
            d = self.kube_client.get(DEPLOYMENT, NAMESPACE, f"{NAME}-{pool}") or {}
            asked = (d.get("spec") or {}).get("replicas")
            ready = (d.get("status") or {}).get("readyReplicas")
            if (want is not None and asked != want) or ready != asked:
                return False
        return True

    def next(self) -> Decision:
        self.wait_for(self._settled, timeout=60, interval=0.1, message="Deployments follow")
        self.scraped = _scraped_since(self.prometheus, self.scraped)
        self.clock.advance(INTERVAL_S)
        return self._landed()

    def until(self, done: Callable[[Decision], bool], what: str) -> Decision:
        for _ in range(MAX_TICKS):
            decision = self.next()
            if done(decision):
                return decision
        raise AssertionError(f"{what}: not after {MAX_TICKS} ticks; the last: {self.seen[-5:]}")


def test_decode_scales_up_when_tpot_breaks_the_slo_and_down_when_load_stops(
    stack: LiveStack,
    prometheus: PrometheusServer,  # noqa: F811
    kube: Any,
    kube_client: KubeClient,
    start_operator: Callable[..., Any],
    inference_service: Callable[..., dict[str, Any]],
    wait_for: Callable[..., Any],
) -> None:
    # Calibrate on this machine: TPOT p90 with 1 and with 16 concurrent streams. They are
    # usually 2x apart here; a noisy spell can hide that, so a close pair is measured again.
    calibrations: list[tuple[float, float]] = []
    for _ in range(CALIBRATION_TRIES):
        light = _measure(prometheus, stack, LIGHT)
        heavy = _measure(prometheus, stack, HEAVY)
        calibrations.append((light, heavy))
        if heavy >= 1.5 * light:
            break
    assert heavy >= 1.5 * light, f"16 streams barely slower than 1: (light, heavy) s {calibrations}"
    slo = light * (heavy / light) ** SLO_POSITION
    clock = ManualClock()
    ticks = Ticks(clock, kube_client, prometheus, wait_for)

    with ReadyMirror(kube_client, [f"{NAME}-prefill", f"{NAME}-decode"]):
        # Light load: the SLO holds and the decode pool stays at one replica.
        with Load(stack.base_url, LIGHT):
            _hold_for_a_window(prometheus)  # the windows no longer hold the heavy calibration
            _start(start_operator, kube_client, inference_service, prometheus, stack, slo, clock)
            first = ticks.first()
            assert _scaling_active(kube_client), first
            for _ in range(LIGHT_TICKS):
                # No scale-up while the SLO holds (on a machine that slows down under
                # other work, a real breach may come, and then scaling is right).
                seen = ticks.next()
                assert seen.target == 1 or (seen.slo_ratio or 0) > 1, seen

        # Heavy load: TPOT breaks the SLO, the decode pool grows.
        with Load(stack.base_url, HEAVY) as load:
            up = ticks.until(lambda d: d.target >= 2, "decode scaled up under heavy load")
            if not any((d.slo_ratio or 0) > 1 for d in ticks.seen):
                # grown on arrivals ahead of the percentiles: the breach must still show
                ticks.until(lambda d: (d.slo_ratio or 0) > 1, "TPOT above the SLO")
            wait_for(
                lambda: (
                    (kube_client.get(DEPLOYMENT, NAMESPACE, f"{NAME}-decode") or {})
                    .get("spec", {})
                    .get("replicas", 0)
                    >= 2
                ),
                timeout=30,
                message="the Deployment follows the planner",
            )
        assert not load.errors, load.errors[:3]
        assert up.reason in {"SLOBreach", "DemandAboveCapacity", "KVPressure", "QueueBacklog"}, up
        # events are posted after the status and the scale: wait for them, not read once
        wait_for(lambda: any(m.startswith("decode 1 -> ") for m in _events(kube, "ScaledUp")),
                 timeout=15, message="a ScaledUp event from 1")  # fmt: skip

        # Load stops: the pool goes back to its minimum. (The planner may still scale up
        # once after the load ends, while its rate window holds the breach: the event
        # checked is the last step down, from whatever the peak was, to 1.)
        down = ticks.until(lambda d: d.target == 1, "decode back to 1")
        assert down.reason in {"Idle", "Surplus"}, down
        # the planner then sees no traffic at all (the Idle step itself, or the ticks
        # after it once the windows hold no request) and stays at its minimum
        if "no traffic" not in down.message:
            ticks.until(lambda d: "no traffic" in d.message, "the planner sees no traffic")
        assert ticks.seen[-1].target == 1, ticks.seen[-1]

        def stepped_down_to_one() -> bool:
            found = [re.match(r"decode (\d+) -> (\d+):", m) for m in _events(kube, "ScaledDown")]
            return any(int(d[1]) >= 2 and int(d[2]) == 1 for d in found if d)

        wait_for(stepped_down_to_one, timeout=15, message="a ScaledDown event to 1")
        assert _scaling_active(kube_client)


def test_every_dashboard_query_runs_against_live_prometheus(
    stack: LiveStack,
    prometheus: PrometheusServer,  # noqa: F811
    kube_client: KubeClient,
    start_operator: Callable[..., Any],
    inference_service: Callable[..., dict[str, Any]],
    wait_for: Callable[..., Any],
) -> None:
    # A TPOT SLO no CPU meets: the planner scales, so its panels have data too.
    _start(start_operator, kube_client, inference_service, prometheus, stack, 0.001)
    with ReadyMirror(kube_client, [f"{NAME}-prefill", f"{NAME}-decode"]), Load(stack.base_url, 4):
        wait_for(lambda: _scaling_active(kube_client), timeout=60, message="planner active")
        wait_for(lambda: (_decode_target(kube_client) or 0) >= 2, timeout=60, message="a scale-up")
        prometheus.wait_for(
            f'splitserve_pool_replicas_desired{{service="{NAME}",pool="decode"}}', timeout_s=30
        )
        # a few more scrapes, so every series the stack exports has samples
        now = prometheus.value("time()")
        assert now is not None
        _scraped_since(prometheus, now + 3)
        names_now = prometheus.query('group by (__name__) ({__name__=~"splitserve_.+"})')
        present = {r["metric"]["__name__"] for r in names_now["data"]["result"]}
        exported = exported_series_names()
        values = {
            "namespace": NAMESPACE, "service": NAME, "__rate_interval": "1m",
            "ttft_slo": "1.0", "tpot_slo": "0.05",
        }  # fmt: skip
        checked = empty = 0
        for file, model in build_all().items():
            for title, expr in expressions(model):
                query = re.sub(r"\$(\w+)", lambda m: values[m.group(1)], expr)
                named = set(METRIC.findall(expr))
                assert named <= exported, f"{file} / {title} names {named - exported}"
                answer = prometheus.query(query)
                assert answer.get("status") == "success", f"{file} / {title}: {answer}"
                checked += 1
                if named <= present:
                    result = answer["data"]["result"]
                    assert result, f"{file} / {title}: no data although {named} exist: {query}"
                else:
                    empty += 1  # e.g. GPU series on a CPU host, KV failures that never happened
        assert checked > 30
        assert empty < checked / 3, json.dumps(sorted(exported - present))
        # what the workers and router export is a subset of what the code declares
        assert present <= exported, sorted(present - exported)

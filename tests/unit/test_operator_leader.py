"""Leader election on a Lease (client-go's rules), with a fake API and injected clocks;
the backoff of transient failures; the liveness endpoint."""

from __future__ import annotations

import copy
import datetime as dt
import threading
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

import pytest
from splitserve_operator.control.backoff import Backoff
from splitserve_operator.control.config import LeaseConfig
from splitserve_operator.control.health import HealthServer, Heartbeats
from splitserve_operator.control.k8s import AlreadyExists, ApiError, Conflict, Kind
from splitserve_operator.control.leader import LeaderElector, Step, decide

pytestmark = pytest.mark.unit


class FakeLeases:
    """One Lease, with resourceVersion preconditions as the API server checks them."""

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.version = 0
        self.down = False

    def _up(self) -> None:
        if self.down:
            raise ApiError(0, "ConnectionRefused", "no answer")

    def get(self, kind: Kind, namespace: str, name: str) -> dict[str, Any] | None:
        self._up()
        return copy.deepcopy(self.lease)

    def create(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        self._up()
        if self.lease is not None:
            raise AlreadyExists(409, "AlreadyExists", "exists")
        self.version += 1
        self.lease = copy.deepcopy(dict(manifest))
        self.lease["metadata"]["resourceVersion"] = str(self.version)
        return copy.deepcopy(self.lease)

    def patch(self, kind: Kind, namespace: str, name: str, patch: Any) -> dict[str, Any]:
        self._up()
        assert self.lease is not None
        if patch["metadata"]["resourceVersion"] != self.lease["metadata"]["resourceVersion"]:
            raise Conflict(409, "Conflict", "modified")
        self.version += 1
        for key, value in patch["spec"].items():
            if value is None:
                self.lease["spec"].pop(key, None)
            else:
                self.lease["spec"][key] = value
        self.lease["metadata"]["resourceVersion"] = str(self.version)
        return copy.deepcopy(self.lease)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


WALL = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)


def _elector(leases: FakeLeases, clock: Clock, identity: str) -> LeaderElector:
    config = LeaseConfig(namespace="sys", identity=identity, duration_s=15,
                         renew_deadline_s=10, retry_period_s=2)  # fmt: skip
    return LeaderElector(leases, config, clock=clock, wall_clock=lambda: WALL)


def test_decide_follows_the_holder_and_the_observed_age() -> None:
    held = {"holderIdentity": "a", "leaseDurationSeconds": 15}
    assert decide(held, "a", unchanged_for=100, duration_s=15) is Step.RENEW
    assert decide(held, "b", unchanged_for=14, duration_s=15) is Step.WAIT
    assert decide(held, "b", unchanged_for=15, duration_s=15) is Step.TAKE
    assert decide({}, "b", unchanged_for=0, duration_s=15) is Step.TAKE  # released


def test_one_leader_and_a_standby_that_waits_a_full_duration_after_the_last_change() -> None:
    leases, clock = FakeLeases(), Clock()
    a, b = _elector(leases, clock, "a"), _elector(leases, clock, "b")
    assert a.try_once() and leases.lease is not None
    assert leases.lease["spec"]["holderIdentity"] == "a"
    assert not b.try_once()
    clock.t += 10
    assert a.try_once()  # renewed: the record changed
    assert not b.try_once()  # b sees the change: it waits again from now
    clock.t += 14
    assert not b.try_once()
    clock.t += 1.5  # a stopped renewing 15.5 s ago as b saw it
    assert b.try_once()
    spec = leases.lease["spec"]
    assert spec["holderIdentity"] == "b" and spec["leaseTransitions"] == 1
    assert not a.try_once() and not a.leading  # a is no longer the holder


def test_a_race_to_take_the_lease_has_one_winner() -> None:
    leases, clock = FakeLeases(), Clock()
    a, b, c = (_elector(leases, clock, n) for n in "abc")
    assert a.try_once()
    assert not b.try_once() and not c.try_once()  # both see a's lease now
    clock.t += 16  # a is gone
    stale = copy.deepcopy(leases.lease)
    assert b.try_once()  # b takes it
    real_get = leases.get
    leases.get = lambda *args: copy.deepcopy(stale)  # type: ignore[method-assign]
    try:
        assert not c.try_once()  # c read before b wrote: its write is refused (409)
    finally:
        leases.get = real_get  # type: ignore[method-assign]
    assert leases.lease is not None and leases.lease["spec"]["holderIdentity"] == "b"
    assert not c.leading


def test_the_leader_gives_up_when_it_cannot_renew_within_the_deadline() -> None:
    leases, clock = FakeLeases(), Clock()
    a = _elector(leases, clock, "a")
    assert a.try_once()
    lost: list[str] = []
    leases.down = True

    class Ticking(threading.Event):
        """Instead of sleeping, time moves 2 s per wait."""

        def wait(self, timeout: float | None = None) -> bool:
            clock.t += 2
            return clock.t > 1000  # a bound, should it never give up

    a.keep(Ticking(), lambda: lost.append("lost"))
    assert lost == ["lost"] and a.lost.is_set() and not a.leading
    assert clock.t - 100 >= 10  # it kept going until the renew deadline passed


def test_a_clean_release_frees_the_lease_at_once() -> None:
    leases, clock = FakeLeases(), Clock()
    a, b = _elector(leases, clock, "a"), _elector(leases, clock, "b")
    assert a.try_once()
    assert not b.try_once()
    a.release()
    assert leases.lease is not None and "holderIdentity" not in leases.lease["spec"]
    assert b.try_once()  # no waiting out the duration


def test_bad_timings_are_refused() -> None:
    with pytest.raises(ValueError, match="renew deadline < lease duration"):
        LeaseConfig(namespace="n", identity="i", duration_s=5, renew_deadline_s=10)


def test_backoff_doubles_with_jitter_up_to_a_cap_and_honours_retry_after() -> None:
    backoff = Backoff(base_s=1, cap_s=60)
    assert [backoff.delay(n, rng=lambda: 1.0) for n in range(8)] == [1, 2, 4, 8, 16, 32, 60, 60]
    assert [backoff.delay(n, rng=lambda: 0.0) for n in range(3)] == [0.5, 1, 2]
    assert backoff.delay(0, retry_after=9, rng=lambda: 0.0) == 9
    assert backoff.delay(0, retry_after=900, rng=lambda: 0.0) == 60


def test_liveness_answers_from_the_heartbeats() -> None:
    clock = Clock()
    beats = Heartbeats(clock=clock)
    server = HealthServer("http://127.0.0.1:0/healthz", beats).start()
    try:
        url = f"http://127.0.0.1:{server.port}/healthz"
        beats.beat("event-loop", 30)
        assert urllib.request.urlopen(url, timeout=5).status == 200
        clock.t += 31
        with pytest.raises(urllib.error.HTTPError) as exc:
            urllib.request.urlopen(url, timeout=5)
        assert exc.value.code == 503 and b"event-loop" in exc.value.read()
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/other", timeout=5)
        assert missing.value.code == 404
    finally:
        server.close()

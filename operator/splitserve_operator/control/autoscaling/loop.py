"""The autoscaling loop: Prometheus in, the planner's decision out to the cluster.

Every ``autoscaling.interval`` (per InferenceService; :mod:`.schedule` wakes
every ``AutoscaleConfig.resolution_s`` and skips services whose interval has
not passed) :meth:`Autoscaler.tick`:

1. reads each worker pool's WorkerPool (its ``spec.replicas``, and who wrote it) and
   Deployment (ready replicas);
2. asks the :class:`~splitserve_operator.control.prometheus.MetricsSource` for one
   observation (PromQL over Prometheus's HTTP API);
3. runs the pure planner (:func:`splitserve_operator.planner.core.plan`);
4. reads the router's correctness-guard mismatches over ``integrity_window_s`` into the
   ``KVIntegrity`` condition (False after any mismatch, True with none, Unknown when
   Prometheus or the guard's series cannot be read);
5. applies each changed decision to the pool's WorkerPool ``spec.replicas`` under its
   own field manager (:data:`~splitserve_operator.control.k8s.PLANNER`; the reconciler
   then applies it to the Deployment, clamped to the bounds, see ``render/replicas.py``),
   applies its records under ``status.autoscaling`` and the ``ScalingActive`` condition,
   records an Event on every change, and updates the operator's metrics.

A service with switchable workers (``spec.flex``) gets one more step between 3 and 5:
its pods' role labels give the split (:mod:`.flex`), the policy of
:func:`splitserve_operator.planner.flex.rebalance` decides from the same observation
whether one pod switches instead of a fixed pool growing, and a switch is applied by
relabelling that pod (under the planner's field manager; the worker follows its
label). The split goes into ``status.flex``, a ``RoleSwitched`` Event announces each
switch. At most one switch per ``FlexConfig.balance.min_dwell_s``, counted on the
loop's clock and carried over an operator restart by ``status.flex.lastSwitch``.

Prometheus unreachable or the series missing: the planner holds, the
condition ``ScalingActive`` turns False with reason ``MetricsUnavailable``,
one Warning event says why, and no replica count moves. A pool whose ``spec.replicas``
another writer has taken (``kubectl scale``, an HPA) is not fought: the planner leaves
it alone and says so (``ScalingActive`` False, reason ``ScaledOutside``, one Warning).
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from splitserve.metric_server import MetricsServer, start_metrics_server
from splitserve.role_balance import BalanceDecision, BalanceMemory, Costs, Split, gave_to
from splitserve.roles import Role

from splitserve_operator.api.durations import format_duration
from splitserve_operator.api.fields import as_int, as_map, count, timestamp
from splitserve_operator.api.models import InferenceServiceSpec
from splitserve_operator.api.parse import SpecError, parse_spec
from splitserve_operator.api.status import kv_integrity_condition
from splitserve_operator.api.values import Pool
from splitserve_operator.control.autoscaling.config import AutoscaleConfig
from splitserve_operator.control.autoscaling.flex import flex_pods, pick, relabel, split_of
from splitserve_operator.control.autoscaling.metrics import OperatorMetrics
from splitserve_operator.control.autoscaling.status import (
    EVENT_ROLE_SWITCHED,
    POOLS,
    REASON_ACTIVE,
    REASON_HOLDING,
    REASON_OUTSIDE,
    event_message,
    event_reason,
    flex_status,
    hold_message,
    outside_message,
    planner_status,
    switch_message,
)
from splitserve_operator.control.k8s import (
    DEPLOYMENT,
    FIELD_MANAGER,
    PLANNER,
    WORKER_POOL,
    ApiError,
    Cluster,
)
from splitserve_operator.control.ownership import owners
from splitserve_operator.control.prometheus import (
    IntegritySource,
    MetricsSource,
    MetricsUnavailable,
    PrometheusSource,
    Target,
)
from splitserve_operator.planner.core import plan
from splitserve_operator.planner.flex import rebalance
from splitserve_operator.planner.model import Bounds, Plan, PlannerState, PoolStatus, Slo, Tick
from splitserve_operator.planner.model import Pool as PlannerPool
from splitserve_operator.render.names import API_VERSION, KIND, POOL_KIND

log = logging.getLogger(__name__)

SCALERS = frozenset({PLANNER, FIELD_MANAGER})
"""Field managers whose ``spec.replicas`` on a WorkerPool the planner may take over: its
own, and the operator's seed (the size the pool was made with)."""


@dataclass(frozen=True)
class PoolView:
    """One worker pool as a tick sees it."""

    status: PoolStatus
    name: str
    """The WorkerPool's name."""
    others: tuple[str, ...]
    """Field managers other than ours that own its ``spec.replicas``."""


@dataclass
class _Memory:
    state: PlannerState
    last_tick: float
    scaling_active: bool | None = None
    outside: frozenset[Pool] = frozenset()
    last_scale: dict[str, str] = field(default_factory=dict)
    balance: BalanceMemory = field(default_factory=BalanceMemory)
    last_switch: dict[str, str] | None = None
    """The last switch of a flex pod: ``time``, ``pod``, ``from``, ``to``."""


@dataclass(frozen=True)
class FlexTick:
    """What one tick did with a service's switchable pods."""

    split: Split
    """Pods per role once this tick's switch (if any) is applied."""
    decision: BalanceDecision
    switched: str | None
    """The pod relabelled this tick; None: none."""


@dataclass(frozen=True)
class TickResult:
    plan: Plan
    patched: bool
    hold_reason: str | None
    """Why the tick held for missing data, else None."""
    flex: FlexTick | None = None
    """The switchable pods' part (a service with ``spec.flex``), else None."""


class Autoscaler:
    """Runs planner ticks for every InferenceService with autoscaling enabled."""

    def __init__(
        self,
        cluster: Cluster,
        config: AutoscaleConfig | None = None,
        *,
        source_factory: Callable[[str], MetricsSource] | None = None,
        metrics: OperatorMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
        record_events: bool = True,
    ) -> None:
        self.cluster = cluster
        self.config = config or AutoscaleConfig()
        self.metrics = metrics or OperatorMetrics()
        self._source_factory = source_factory or self._prometheus
        self._sources: dict[str, MetricsSource] = {}
        self._memory: dict[tuple[str, str, str], _Memory] = {}
        self._lock = threading.Lock()
        self._clock = clock
        self._wall = wall_clock
        self._record_events = record_events
        self._server: MetricsServer | None = None

    def _prometheus(self, url: str) -> MetricsSource:
        return PrometheusSource(
            url, selector_template=self.config.selector_template, auth=self.config.prometheus_auth
        )

    def _source(self, url: str) -> MetricsSource:
        with self._lock:
            source = self._sources.get(url)
            if source is None:
                source = self._sources[url] = self._source_factory(url)
            return source

    # -- the operator's own /metrics ------------------------------------------------

    def start_metrics_server(self) -> int | None:
        if self.config.metrics_port is None or self._server is not None:
            return self._server.port if self._server else None
        self._server = start_metrics_server(
            self.config.metrics_port, self.metrics.registry, host=self.config.metrics_host
        )
        log.info("operator metrics on %s", self._server.url)
        return self._server.port

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for source in self._sources.values():
            close = getattr(source, "close", None)
            if callable(close):
                close()
        self._sources.clear()

    # -- one tick ----------------------------------------------------------------------

    def due(self, body: Mapping[str, Any]) -> bool:
        """Whether ``body``'s interval has passed since its last tick."""
        try:
            spec = parse_spec(body.get("spec"))
        except SpecError:
            return False
        if not spec.autoscaling.enabled:
            return False
        memory = self._memory.get(self._key(body))
        return memory is None or (
            self._clock() - memory.last_tick >= spec.autoscaling.interval - 0.5
        )

    @staticmethod
    def _key(body: Mapping[str, Any]) -> tuple[str, str, str]:
        meta = as_map(body.get("metadata"))
        return (
            str(meta.get("namespace") or ""),
            str(meta.get("name") or ""),
            str(meta.get("uid") or ""),
        )

    def tick(self, body: Mapping[str, Any], *, force: bool = False) -> TickResult | None:
        """One planner tick for ``body`` if it is due (or ``force``); None if skipped."""
        if not force and not self.due(body):
            return None
        try:
            spec = parse_spec(body.get("spec"))
        except SpecError:
            return None
        if not spec.autoscaling.enabled or spec.autoscaling.prometheus_url is None:
            return None
        namespace, name, _uid = key = self._key(body)
        now = self._clock()
        self._forget_stale(now)
        views = self._pools(spec, namespace, name)
        if views is None:
            return None  # pools not created yet: the reconciler is still at work
        statuses = {p: v.status for p, v in views.items()}
        slo = Slo(
            ttft_s=float(spec.slo.ttft or 0.0),
            tpot_s=float(spec.slo.tpot or 0.0),
            percentile=spec.slo.quantile,
        )
        target = Target(
            namespace, name, slo.percentile, self.config.window_s, self.config.fast_window_s
        )
        hold_reason: str | None = None
        source = self._source(spec.autoscaling.prometheus_url)
        try:
            observation = source.observe(target)
        except MetricsUnavailable as exc:
            observation, hold_reason = None, str(exc)
        integrity = self._integrity(body, source, target)
        memory = self._memory.get(key)
        if memory is None:
            memory = _Memory(
                state=PlannerState.initial(
                    self.config.planner.prefill_capacity_hint,
                    self.config.planner.decode_capacity_hint,
                ),
                last_tick=now,
            )
            self._memory[key] = memory
        tick = Tick(
            now=now,
            slo=slo,
            prefill=statuses[PlannerPool.PREFILL],
            decode=statuses[PlannerPool.DECODE],
            observation=observation,
        )
        result = plan(memory.state, tick, self.config.planner_config())
        flex = None
        if spec.flex is not None:
            result, flex = self._rebalance(body, tick, result, memory)
        memory.state = result.state
        memory.last_tick = now
        if not result.metrics_ok and hold_reason is None:
            hold_reason = (
                "; ".join(
                    d.detail.removeprefix("holding: ")
                    for d in result.decisions()
                    if d.reason.value == REASON_HOLDING
                )
                or "metrics missing"
            )
        outside = {POOLS[p]: list(v.others) for p, v in views.items() if v.others}
        patched = self._write(body, views, result, memory, hold_reason, outside, integrity, flex)
        ready = {p: s.ready for p, s in statuses.items()}
        self.metrics.record(namespace, name, result, ready, slo)
        self._events(body, result, memory, hold_reason, outside, views, flex)
        for d in result.decisions():
            if d.changed and POOLS[d.pool] not in outside:
                log.info(
                    "%s/%s %s %d -> %d: %s: %s",
                    namespace,
                    name,
                    d.pool.value,
                    d.previous,
                    d.replicas,
                    d.reason.value,
                    d.detail,
                )
        return TickResult(plan=result, patched=patched, hold_reason=hold_reason, flex=flex)

    def _rebalance(
        self, body: Mapping[str, Any], tick: Tick, result: Plan, memory: _Memory
    ) -> tuple[Plan, FlexTick | None]:
        """Whether one flex pod switches this tick, and the plan with the scale-up it
        replaces held; the switch is applied here (the pod relabelled). None: the pods
        could not be read (the planner scales as without them; the next tick retries)."""
        namespace, name, _ = self._key(body)
        try:
            pods = flex_pods(self.cluster, namespace, name)
        except ApiError as exc:
            log.warning("could not read the flex pods of %s/%s: %s", namespace, name, exc)
            return result, None
        if memory.last_switch is None:
            self._recall_switch(body, memory, tick.now)
        split = split_of(pods, tick.prefill.ready, tick.decode.ready)
        cfg = self.config.flex
        costs = Costs(
            drain_s=cfg.drain_s,
            prefix_hit_ratio=cfg.prefix_hit_ratio,
            cold_start_s=cfg.cold_start_s,
            can_scale=any(s.replicas < s.bounds.max_replicas for s in (tick.prefill, tick.decode)),
        )
        got = rebalance(
            result, tick, split, costs, memory.balance, self.config.planner_config(), cfg.balance
        )
        decision = got.balance
        frm, to = decision.switch_from, decision.switch_to
        if frm is None or to is None:
            memory.balance = decision.memory
            return got.plan, FlexTick(split, decision, None)
        pod = pick(pods, frm)
        if pod is None:  # split_of counted it serving, so pick finds it: never here
            raise AssertionError(f"the policy switches a {frm} pod, and {split} has none")
        try:
            relabel(self.cluster, namespace, pod.name, to)
        except ApiError as exc:  # nothing switched: the policy's memory stays, next tick retries
            log.warning("could not switch pod %s of %s/%s to %s: %s", pod.name, namespace, name,
                        to, exc)  # fmt: skip
            return result, FlexTick(split, decision, None)
        memory.balance = decision.memory
        memory.last_switch = {"time": timestamp(self._wall()), "pod": pod.name,
                              "from": frm.value, "to": to.value}  # fmt: skip
        log.info("%s/%s switched pod %s: %s", namespace, name, pod.name, decision.detail)
        return got.plan, FlexTick(split.after(frm, to), decision, pod.name)

    def _recall_switch(self, body: Mapping[str, Any], memory: _Memory, now: float) -> None:
        """After an operator restart: the last switch from ``status.flex.lastSwitch``, so
        the dwell holds across it (its wall time turned into the loop's clock), and the
        side it gave a worker to is known."""
        last = as_map(as_map(as_map(body.get("status")).get("flex")).get("lastSwitch"))
        try:
            at = dt.datetime.fromisoformat(str(last.get("time")))
        except ValueError:
            return
        if at.tzinfo is None:
            return
        memory.last_switch = {str(k): str(v) for k, v in last.items()}
        ago = (self._wall() - at).total_seconds()
        try:
            gave: Role | None = gave_to(Role(str(last.get("from"))), Role(str(last.get("to"))))
        except ValueError:  # roles not written by us: the dwell alone holds
            gave = None
        memory.balance = BalanceMemory(last_switch_at=now - max(0.0, ago), last_gave=gave)

    def _integrity(
        self, body: Mapping[str, Any], source: MetricsSource, target: Target
    ) -> dict[str, Any]:
        """The ``KVIntegrity`` condition from the guard's mismatches in Prometheus."""
        window = self.config.integrity_window_s
        mismatches, why = None, None
        if not isinstance(source, IntegritySource):
            why = "the metrics source does not serve the correctness guard's series"
        else:
            try:
                mismatches = source.kv_mismatches(target, window)
            except MetricsUnavailable as exc:
                why = str(exc)
        status = as_map(body.get("status"))
        previous = [c for c in status.get("conditions") or [] if isinstance(c, Mapping)]
        return kv_integrity_condition(
            mismatches,
            format_duration(window),
            why,
            generation=count(as_map(body.get("metadata")).get("generation")),
            now=self._wall(),
            previous=previous,
        )

    def _forget_stale(self, now: float) -> None:
        stale = [
            k for k, m in self._memory.items() if now - m.last_tick > self.config.forget_after_s
        ]
        for k in stale:
            del self._memory[k]

    def _pools(
        self, spec: InferenceServiceSpec, namespace: str, name: str
    ) -> dict[PlannerPool, PoolView] | None:
        out: dict[PlannerPool, PoolView] = {}
        for planner_pool, pool in POOLS.items():
            pool_name = f"{name}-{pool.value}"
            worker_pool = self.cluster.get(WORKER_POOL, namespace, pool_name)
            deployment = self.cluster.get(DEPLOYMENT, namespace, pool_name)
            if worker_pool is None or deployment is None:
                return None
            target = as_int(as_map(worker_pool.get("spec")).get("replicas"))
            applied = as_int(as_map(deployment.get("spec")).get("replicas"))
            ready = as_int(as_map(deployment.get("status")).get("readyReplicas")) or 0
            bounds = spec.autoscaling.bounds(pool)
            current = target if target is not None else (applied if applied is not None else 1)
            others = tuple(m for m in owners(worker_pool, ("spec", "replicas")) if m not in SCALERS)
            # a pool another writer scales is held where it is: the planner neither plans
            # a change for it nor counts one (no cooldown from a resize it never made)
            limits = (
                Bounds(current, current)
                if others
                else Bounds(bounds.min_replicas, bounds.max_replicas)
            )
            out[planner_pool] = PoolView(
                PoolStatus(replicas=current, ready=ready, bounds=limits),
                pool_name,
                others,
            )
        return out

    # -- writing the decision ------------------------------------------------------------

    def _write(
        self,
        body: Mapping[str, Any],
        views: Mapping[PlannerPool, PoolView],
        result: Plan,
        memory: _Memory,
        hold_reason: str | None,
        outside: Mapping[Pool, list[str]],
        integrity: Mapping[str, Any] | None = None,
        flex: FlexTick | None = None,
    ) -> bool:
        """Apply the changed decisions to the WorkerPools and the planner's status; False
        when a write failed (the next tick tries again)."""
        namespace, name, _ = self._key(body)
        stamp = timestamp(self._wall())
        ok = True
        for d in result.decisions():
            pool = POOLS[d.pool]
            if not d.changed or pool in outside:
                continue
            manifest = {
                "apiVersion": API_VERSION,
                "kind": POOL_KIND,
                "metadata": {"name": views[d.pool].name, "namespace": namespace},
                "spec": {"replicas": d.replicas},
            }
            try:
                self.cluster.apply(manifest, field_manager=PLANNER, force=True)
            except ApiError as exc:
                log.warning("could not scale %s on %s/%s: %s", views[d.pool].name, namespace,
                            name, exc)  # fmt: skip
                ok = False
        status = planner_status(
            body,
            result,
            memory.last_scale,
            hold_reason=hold_reason,
            outside=outside,
            names={POOLS[p]: v.name for p, v in views.items()},
            stamp=stamp,
            integrity=integrity,
            flex=None
            if flex is None
            else flex_status(flex.split, flex.decision, last_switch=memory.last_switch),
        )
        manifest = {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "metadata": {"name": name, "namespace": namespace},
            "status": status,
        }
        try:
            self.cluster.apply(manifest, field_manager=PLANNER, force=True, subresource="status")
        except ApiError as exc:  # the next tick retries
            log.warning("could not write the planner's status on %s/%s: %s", namespace, name, exc)
            return False
        return ok

    def _events(
        self,
        body: Mapping[str, Any],
        result: Plan,
        memory: _Memory,
        hold_reason: str | None,
        outside: Mapping[Pool, list[str]],
        views: Mapping[PlannerPool, PoolView],
        flex: FlexTick | None = None,
    ) -> None:
        active = hold_reason is None
        was = memory.scaling_active
        memory.scaling_active = active
        newly_outside = {p: m for p, m in outside.items() if p not in memory.outside}
        memory.outside = frozenset(outside)
        if not self._record_events:
            return
        if newly_outside:
            names = {POOLS[p]: v.name for p, v in views.items()}
            self.cluster.event(
                body, "Warning", REASON_OUTSIDE, outside_message(newly_outside, names)
            )
        if not active and was is not False:
            self.cluster.event(
                body,
                "Warning",
                REASON_HOLDING,
                hold_message(hold_reason),
            )
        elif active and was is False:
            self.cluster.event(body, "Normal", REASON_ACTIVE, "metrics are back; planning again")
        for d in result.decisions():
            if d.changed and POOLS[d.pool] not in outside:
                self.cluster.event(body, "Normal", event_reason(d), event_message(d))
        if flex is not None and flex.switched is not None:
            self.cluster.event(
                body, "Normal", EVENT_ROLE_SWITCHED, switch_message(flex.switched, flex.decision)
            )

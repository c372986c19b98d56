"""Where the planner's observations come from: a :class:`MetricsSource`.

:class:`PrometheusSource` asks Prometheus's HTTP API (``/api/v1/query``) one
instant PromQL query per signal. Every query is built here from the metric
names in :mod:`splitserve.metric_names` (the single source of the
names; a test checks that each one is exported by the code), scoped to one
InferenceService by a label selector.

A series that is absent comes back as ``None`` (never as 0): the planner holds
on missing data instead of reading silence as "idle". Prometheus unreachable,
an HTTP error or a query error raises :class:`MetricsUnavailable`.
"""

from __future__ import annotations

import math
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import httpx
import splitserve.metric_names as names

from splitserve_operator.api.series import DEFAULT_SELECTOR
from splitserve_operator.planner.model import Observation

QUERY_TIMEOUT_S = 5.0
"""Seconds (s) one HTTP query may take; a tick asks about a dozen."""


class MetricsUnavailable(Exception):
    """The metrics source could not be read (unreachable, HTTP error, bad query)."""


@dataclass(frozen=True)
class PrometheusAuth:
    """Credentials of the cluster's Prometheus, from the operator's own flags.

    They belong to the operator (its service account token is often the credential, as
    for OpenShift's Thanos querier), not to a tenant: they go only to queries whose URL
    is under ``url`` (scheme, host and port as given), never to another URL a spec's
    ``autoscaling.prometheusUrl`` names."""

    url: str
    """The Prometheus (or querier) the credentials are for: ``https://thanos-querier.openshift-monitoring.svc:9091``."""
    bearer_token_file: str | None = None
    """A file holding the bearer token, read again for every query (projected service
    account tokens are rotated on disk)."""
    ca_file: str | None = None
    """A PEM bundle of the CAs that sign the Prometheus server's certificate."""

    def covers(self, url: str) -> bool:
        base = self.url.rstrip("/")
        return url.rstrip("/") == base or url.startswith(base + "/")

    def token(self) -> str:
        """The current bearer token; MetricsUnavailable when the file cannot be read."""
        assert self.bearer_token_file is not None
        try:
            return Path(self.bearer_token_file).read_text().strip()
        except OSError as exc:
            raise MetricsUnavailable(
                f"cannot read the Prometheus bearer token file {self.bearer_token_file}: {exc}; "
                "check the operator's --prometheus-bearer-token-file and its mount"
            ) from exc

    def verify(self) -> ssl.SSLContext | bool:
        """How TLS is checked: against ``ca_file`` when given, else the system's CAs."""
        if self.ca_file is None:
            return True
        try:
            return ssl.create_default_context(cafile=self.ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(
                f"cannot load the Prometheus CA bundle {self.ca_file}: {exc}; check the "
                "operator's --prometheus-ca-file"
            ) from exc


@dataclass(frozen=True)
class Target:
    """Which service to observe and how."""

    namespace: str
    name: str
    quantile: float
    """0..1, e.g. 0.9: the SLO's percentile."""
    window_s: float
    """Window (s) for rates and percentiles."""
    fast_window_s: float
    """Short window (s) for the arrival rate that reacts to a load step."""


class MetricsSource(Protocol):
    """What the autoscaler reads observations from (Prometheus; fakes in tests)."""

    def observe(self, target: Target) -> Observation:
        """One observation of ``target``; raises :class:`MetricsUnavailable`."""
        ...


@runtime_checkable
class IntegritySource(Protocol):
    """A metrics source that also serves the router's correctness guard (Prometheus)."""

    def kv_mismatches(self, target: Target, window_s: float) -> float | None:
        """Guard mismatches of ``target`` over the last ``window_s`` seconds; None when the
        guard's series are absent. Raises :class:`MetricsUnavailable`."""
        ...


def _dur(seconds: float) -> str:
    return f"{max(1, round(seconds))}s"


@dataclass(frozen=True)
class Queries:
    """The PromQL for each :class:`Observation` field, for one selector."""

    selector: str
    quantile: float
    window_s: float
    fast_window_s: float

    def _sel(self, extra: str = "") -> str:
        inner = ",".join(part for part in (self.selector, extra) if part)
        return "{" + inner + "}"

    def _quantile(self, spec: names.MetricSpec) -> str:
        return (
            f"histogram_quantile({self.quantile:g}, sum by (le) "
            f"(rate({spec.name}_bucket{self._sel()}[{_dur(self.window_s)}])))"
        )

    def _rate(self, spec: names.MetricSpec, extra: str = "", window: float | None = None) -> str:
        w = _dur(self.window_s if window is None else window)
        return f"sum(rate({spec.name}{self._sel(extra)}[{w}]))"

    def _gauge(self, spec: names.MetricSpec, extra: str = "") -> str:
        # Averaged over the fast window: a single scrape of a queue is noisy.
        return f"sum(avg_over_time({spec.name}{self._sel(extra)}[{_dur(self.fast_window_s)}]))"

    def kv_mismatches(self, window_s: float) -> str:
        """The correctness guard's mismatches over ``window_s``: absent when the router's
        guard series are not scraped (every outcome is exported from the router's start)."""
        mismatch = 'outcome="mismatch"'
        return f"sum(increase({names.GUARD_CHECKS.name}{self._sel(mismatch)}[{_dur(window_s)}]))"

    def all(self) -> dict[str, str]:
        """Observation field name -> PromQL."""
        prefill = 'role="prefill"'
        decode = 'role="decode"'
        used = f"sum({names.KV_BLOCKS_USED.name}{self._sel(decode)})"
        free = f"sum({names.KV_BLOCKS_FREE.name}{self._sel(decode)})"
        return {
            "ttft_s": self._quantile(names.TTFT),
            "tpot_s": self._quantile(names.TPOT),
            "request_rate": self._rate(names.REQUESTS),
            "prompt_token_rate": self._rate(names.PROMPT_TOKENS),
            "prompt_token_rate_fast": self._rate(names.PROMPT_TOKENS, window=self.fast_window_s),
            "generation_token_rate": self._rate(names.GENERATION_TOKENS),
            # Requests wait in the router's queue and inside the workers.
            "prefill_queue": f"{self._gauge(names.PREFILL_QUEUE)} + "
            f"({self._gauge(names.WAITING, prefill)} or vector(0))",
            "decode_queue": f"{self._gauge(names.DECODE_QUEUE)} + "
            f"({self._gauge(names.WAITING, decode)} or vector(0))",
            "kv_utilization": f"{used} / ({used} + {free})",
            "prefill_served_token_rate": self._rate(names.WORKER_PREFILL_TOKENS, prefill),
            "decode_served_token_rate": self._rate(names.WORKER_DECODE_TOKENS, decode),
        }


def queries_for(target: Target, selector_template: str = DEFAULT_SELECTOR) -> Queries:
    selector = selector_template.format(namespace=target.namespace, name=target.name)
    return Queries(selector, target.quantile, target.window_s, target.fast_window_s)


def parse_scalar(payload: Mapping[str, Any]) -> float | None:
    """The single value of an instant-query answer; None when empty or NaN.

    Raises :class:`MetricsUnavailable` for an error answer or one that is not
    a single-sample vector or scalar.
    """
    if payload.get("status") != "success":
        raise MetricsUnavailable(
            f"query failed: {payload.get('errorType', '?')}: {payload.get('error', payload)}"
        )
    data = payload.get("data") or {}
    kind, result = data.get("resultType"), data.get("result")
    if kind == "scalar" and isinstance(result, list) and len(result) == 2:
        value = result[1]
    elif kind == "vector" and isinstance(result, list):
        if not result:
            return None
        if len(result) > 1:
            raise MetricsUnavailable(f"expected one series, got {len(result)}")
        value = (result[0].get("value") or [None, None])[1]
    else:
        raise MetricsUnavailable(f"unexpected result type {kind!r}")
    try:
        number = float(value)
    except (TypeError, ValueError) as exc:
        raise MetricsUnavailable(f"not a number: {value!r}") from exc
    return None if math.isnan(number) or math.isinf(number) else number


class PrometheusSource:
    """A :class:`MetricsSource` over Prometheus's HTTP API."""

    def __init__(
        self,
        url: str,
        *,
        selector_template: str = DEFAULT_SELECTOR,
        timeout_s: float = QUERY_TIMEOUT_S,
        client: httpx.Client | None = None,
        auth: PrometheusAuth | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.selector_template = selector_template
        self._auth = auth if auth is not None and auth.covers(url) else None
        verify = self._auth.verify() if self._auth is not None else True
        self._client = client or httpx.Client(timeout=timeout_s, verify=verify)

    def _headers(self) -> dict[str, str]:
        if self._auth is None or self._auth.bearer_token_file is None:
            return {}
        return {"Authorization": f"Bearer {self._auth.token()}"}

    def close(self) -> None:
        self._client.close()

    def query(self, promql: str) -> float | None:
        """One instant query; its single value, or None when there is no data."""
        try:
            response = self._client.get(
                f"{self.url}/api/v1/query", params={"query": promql}, headers=self._headers()
            )
        except httpx.HTTPError as exc:
            raise MetricsUnavailable(f"Prometheus at {self.url} unreachable: {exc}") from exc
        if response.status_code in (401, 403):
            raise MetricsUnavailable(
                f"Prometheus at {self.url} refused the query (HTTP {response.status_code}): "
                "give the operator its credentials (--prometheus-bearer-token-file, for "
                "this URL with --prometheus-auth-url)"
            )
        try:
            payload = response.json()
        except ValueError as exc:
            raise MetricsUnavailable(
                f"Prometheus at {self.url} answered HTTP {response.status_code}, not JSON"
            ) from exc
        if response.status_code != 200 and payload.get("status") != "error":
            raise MetricsUnavailable(f"Prometheus at {self.url}: HTTP {response.status_code}")
        return parse_scalar(payload)

    def kv_mismatches(self, target: Target, window_s: float) -> float | None:
        promql = queries_for(target, self.selector_template).kv_mismatches(window_s)
        return self.query(promql)

    def observe(self, target: Target) -> Observation:
        values = {
            field: self.query(promql)
            for field, promql in queries_for(target, self.selector_template).all().items()
        }
        return Observation(**values)

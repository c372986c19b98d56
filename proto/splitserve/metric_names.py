"""Every metric name splitserve exports, defined once.

Dashboards, alerts and the planner's PromQL refer to these constants; a test
checks that every metric named in a dashboard or query is one of them. This
module is pure (no prometheus_client import) so the operator can use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Kind(StrEnum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


PREFIX = "splitserve_"

# Latency buckets (seconds) for SLOs from 10 ms to 60 s.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0,
)  # fmt: skip

# Time-per-output-token buckets: a few ms apart where decode SLOs sit (a TPOT p90 read
# between 10 and 20 ms bounds could be anywhere between them), out to 5 s.
TOKEN_LATENCY_BUCKETS: tuple[float, ...] = (
    0.001, 0.002, 0.003, 0.004, 0.005, 0.006, 0.008, 0.01, 0.0125, 0.015, 0.0175, 0.02,
    0.025, 0.03, 0.04, 0.05, 0.06, 0.075, 0.1, 0.125, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0,
)  # fmt: skip


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    """Bucket bounds, for a histogram."""


# ---- router (the user-facing view) ----
TTFT = MetricSpec(
    PREFIX + "time_to_first_token_seconds",
    Kind.HISTOGRAM,
    "Time from request arrival to the first generated token.",
)
TPOT = MetricSpec(
    PREFIX + "time_per_output_token_seconds",
    Kind.HISTOGRAM,
    "Mean time between output tokens of a request, after the first.",
    buckets=TOKEN_LATENCY_BUCKETS,
)
E2E = MetricSpec(
    PREFIX + "e2e_request_latency_seconds",
    Kind.HISTOGRAM,
    "Time from request arrival to its last token.",
)
REQUESTS = MetricSpec(
    PREFIX + "requests_total", Kind.COUNTER, "Finished requests by outcome.", ("outcome",)
)
PROMPT_TOKENS = MetricSpec(PREFIX + "prompt_tokens_total", Kind.COUNTER, "Prompt tokens received.")
GENERATION_TOKENS = MetricSpec(
    PREFIX + "generation_tokens_total", Kind.COUNTER, "Tokens generated."
)
PREFILL_QUEUE = MetricSpec(
    PREFIX + "prefill_queue_depth", Kind.GAUGE, "Requests waiting for a prefill worker."
)
DECODE_QUEUE = MetricSpec(
    PREFIX + "decode_queue_depth", Kind.GAUGE, "Requests waiting for a decode worker."
)
DISAGG_DECISIONS = MetricSpec(
    PREFIX + "disaggregation_decisions_total",
    Kind.COUNTER,
    "Per-request choice: remote prefill or local prefill.",
    ("decision",),
)
ROUTER_RETRIES = MetricSpec(
    PREFIX + "router_retries_total",
    Kind.COUNTER,
    "Retries and migrations after a worker failure.",
    ("reason",),
)
GUARD_CHECKS = MetricSpec(
    PREFIX + "guard_checks_total",
    Kind.COUNTER,
    "Disaggregated greedy requests the correctness guard re-ran with local prefill, by "
    "outcome: match, mismatch (the KV that moved decoded other tokens), failed (no "
    "verdict), skipped (every re-run slot was busy).",
    ("outcome",),
)
PLANNED_REMOTE_RAN_LOCAL = MetricSpec(
    PREFIX + "planned_remote_ran_local_total",
    Kind.COUNTER,
    "Requests first planned for remote prefill that finished prefilled on their decode "
    "worker (planned again once a prefill slot came, or retried after a failed handoff).",
)

# ---- workers ----
RUNNING = MetricSpec(
    PREFIX + "running_sequences",
    Kind.GAUGE,
    "Sequences in the running batch of a worker.",
    ("role",),
)
WAITING = MetricSpec(
    PREFIX + "waiting_sequences", Kind.GAUGE, "Sequences waiting inside a worker.", ("role",)
)
KV_BLOCKS_USED = MetricSpec(
    PREFIX + "kv_blocks_used", Kind.GAUGE, "KV cache blocks in use.", ("role",)
)
KV_BLOCKS_FREE = MetricSpec(
    PREFIX + "kv_blocks_free",
    Kind.GAUGE,
    "KV cache blocks free (including evictable cached blocks).",
    ("role",),
)
PREFIX_QUERIES = MetricSpec(
    PREFIX + "prefix_cache_queries_total",
    Kind.COUNTER,
    "Prompt tokens looked up in the prefix cache.",
    ("role",),
)
PREFIX_HITS = MetricSpec(
    PREFIX + "prefix_cache_hits_total",
    Kind.COUNTER,
    "Prompt tokens found in the prefix cache.",
    ("role",),
)
WORKER_PREFILL_TOKENS = MetricSpec(
    PREFIX + "worker_prefill_tokens_total",
    Kind.COUNTER,
    "Prompt tokens computed by a worker.",
    ("role",),
)
WORKER_DECODE_TOKENS = MetricSpec(
    PREFIX + "worker_decode_tokens_total", Kind.COUNTER, "Tokens decoded by a worker.", ("role",)
)
KV_TRANSFER_BYTES = MetricSpec(
    PREFIX + "kv_transfer_bytes_total",
    Kind.COUNTER,
    "KV cache bytes moved between workers.",
    ("backend", "direction"),
)
KV_TRANSFER_DURATION = MetricSpec(
    PREFIX + "kv_transfer_duration_seconds",
    Kind.HISTOGRAM,
    "Duration of one request's KV transfer.",
    ("backend",),
)
KV_TRANSFER_FAILURES = MetricSpec(
    PREFIX + "kv_transfer_failures_total",
    Kind.COUNTER,
    "KV transfers that failed.",
    ("backend", "reason"),
)
WORKER_ROLE = MetricSpec(
    PREFIX + "worker_role_active",
    Kind.GAUGE,
    "1 for the role a worker serves now, 0 for the others (a switchable worker changes it).",
    ("role",),
)
ROLE_SWITCH_IN_PROGRESS = MetricSpec(
    PREFIX + "role_switch_in_progress",
    Kind.GAUGE,
    "1 while a worker drains and changes its role (it takes no new work meanwhile).",
)
ROLE_SWITCHES = MetricSpec(
    PREFIX + "role_switches_total",
    Kind.COUNTER,
    "Role switches a worker completed, by the role it left and the one it took.",
    ("from_role", "to_role"),
)
ROLE_SWITCH_DURATION = MetricSpec(
    PREFIX + "role_switch_duration_seconds",
    Kind.HISTOGRAM,
    "Duration of one role switch, its drain included.",
)
ROLE_SWITCH_MIGRATED = MetricSpec(
    PREFIX + "role_switch_migrated_total",
    Kind.COUNTER,
    "Streams a switching worker ended after its drain time, for the router to migrate.",
)
GPU_UTILIZATION = MetricSpec(
    PREFIX + "gpu_utilization_ratio",
    Kind.GAUGE,
    "GPU utilisation, 0 to 1 (only where a GPU exists).",
    ("gpu",),
)
GPU_MEMORY_USED = MetricSpec(
    PREFIX + "gpu_memory_used_bytes",
    Kind.GAUGE,
    "GPU memory in use (only where a GPU exists).",
    ("gpu",),
)
GPU_MEMORY_TOTAL = MetricSpec(
    PREFIX + "gpu_memory_total_bytes",
    Kind.GAUGE,
    "GPU memory installed (only where a GPU exists).",
    ("gpu",),
)

# ---- operator ----
PLANNER_DECISIONS = MetricSpec(
    PREFIX + "planner_decisions_total",
    Kind.COUNTER,
    "Planner decisions by pool and direction.",
    ("namespace", "service", "pool", "direction"),
)
REPLICAS_DESIRED = MetricSpec(
    PREFIX + "pool_replicas_desired",
    Kind.GAUGE,
    "Replicas the operator wants for a pool.",
    ("namespace", "service", "pool"),
)
REPLICAS_READY = MetricSpec(
    PREFIX + "pool_replicas_ready",
    Kind.GAUGE,
    "Replicas ready in a pool.",
    ("namespace", "service", "pool"),
)
SLO_TARGET = MetricSpec(
    PREFIX + "slo_target_seconds",
    Kind.GAUGE,
    "An InferenceService's latency objective (objective: ttft or tpot) at its percentile, "
    "for dashboards to draw against the observed percentiles.",
    ("namespace", "service", "objective"),
)
PLANNER_METRICS_AVAILABLE = MetricSpec(
    PREFIX + "planner_metrics_available",
    Kind.GAUGE,
    "1 when the last planner tick had the metrics it needs, 0 when it held for missing data.",
    ("namespace", "service"),
)
PLANNER_CAPACITY = MetricSpec(
    PREFIX + "planner_capacity_per_replica",
    Kind.GAUGE,
    "Per-replica capacity the planner has learned "
    "(prefill: prompt tokens/s, decode: generated tokens/s).",
    ("namespace", "service", "pool"),
)
PLANNER_SLO_RATIO = MetricSpec(
    PREFIX + "planner_slo_ratio",
    Kind.GAUGE,
    "Observed latency percentile over its SLO as the planner saw it "
    "(prefill: TTFT, decode: TPOT); above 1 breaks the SLO.",
    ("namespace", "service", "pool"),
)

ALL: tuple[MetricSpec, ...] = tuple(
    v for v in list(globals().values()) if isinstance(v, MetricSpec)
)


def exported_series_names() -> set[str]:
    """Names as they appear in Prometheus (histograms and counters expand)."""
    out: set[str] = set()
    for m in ALL:
        out.add(m.name)
        if m.kind is Kind.HISTOGRAM:
            out |= {m.name + "_bucket", m.name + "_sum", m.name + "_count", m.name + "_created"}
        if m.kind is Kind.COUNTER and m.name.endswith("_total"):
            out.add(m.name[: -len("_total")] + "_created")
    return out

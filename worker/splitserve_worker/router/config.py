"""Typed router configuration, checked when it is built.

Every number has a unit in its name or docstring and a default that works for a
local stack on a laptop; cluster deployments override them from the command
line or from a YAML/JSON mapping (``RouterConfig.from_mapping``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from splitserve.tls import TlsConfig, TlsError


class ConfigError(ValueError):
    """A router setting is out of range; the message names the field and the fix."""


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{name} must be > 0, got {value!r}")


def _non_negative(name: str, value: float) -> None:
    if not value >= 0:
        raise ConfigError(f"{name} must be >= 0, got {value!r}")


@dataclass(frozen=True)
class PrefillWeights:
    """Weights of the prefill-worker scorers; each scorer returns a score in [0, 1]."""

    prefix: float = 2.0
    """KV-prefix overlap: the fraction of the prompt's blocks cached on the worker."""
    load: float = 1.0
    """Load: queued requests and tokens in flight, lower is better."""

    def __post_init__(self) -> None:
        _non_negative("prefill_weights.prefix", self.prefix)
        _non_negative("prefill_weights.load", self.load)
        if self.prefix + self.load <= 0:
            raise ConfigError("prefill_weights: at least one weight must be > 0")


@dataclass(frozen=True)
class DecodeWeights:
    """Weights of the decode-worker scorers."""

    kv_free: float = 1.0
    """Free KV blocks as a fraction of the worker's pool."""
    running: float = 1.0
    """Running sequences, fewer is better."""
    prefix: float = 0.5
    """Prefix overlap on the decode worker (matters when it prefills locally)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            _non_negative(f"decode_weights.{f.name}", getattr(self, f.name))
        if self.kv_free + self.running + self.prefix <= 0:
            raise ConfigError("decode_weights: at least one weight must be > 0")


@dataclass(frozen=True)
class QueueConfig:
    """The two bounded queues in front of the workers."""

    prefill_max_waiting: int = 256
    """Requests allowed to wait for a prefill slot; more are refused with 429."""
    decode_max_waiting: int = 256
    """Requests allowed to wait for a decode slot; more are refused with 429."""
    prefill_slots_per_worker: int = 2
    """Prefills the router keeps in flight per prefill-capable worker. Small on purpose:
    a prompt waits in the router's queue, where it holds no reserved blocks, rather than
    inside a busy worker while its decode-side lease runs down."""
    decode_slots_per_worker: int = 64
    """Sequences the router keeps in flight per decode-capable worker."""
    max_wait_s: float = 30.0
    """Longest a request waits in one queue before it is refused with 503."""
    retry_after_s: int = 1
    """Value of the Retry-After header on 429/503 answers, in seconds."""
    max_stream_backlog: int = 1024
    """Token events a streamed request may have waiting for its client (all its choices
    together), beyond what the connection itself buffers: a client further behind has
    stopped reading, and its request is ended on the workers (KV and decode slot freed)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            _positive(f"queues.{f.name}", getattr(self, f.name))


@dataclass(frozen=True)
class CostModelConfig:
    """Numbers of the disaggregation cost model (see :mod:`.decision`)."""

    prefill_tokens_per_s: float = 2000.0
    """Prompt tokens per second a prefill worker computes (refined from measurements)."""
    decode_prefill_tokens_per_s: float = 2000.0
    """Prompt tokens per second a decode worker computes when it prefills locally."""
    link_bytes_per_s: float = 1.0e9
    """KV transfer bandwidth between prefill and decode workers (refined from measurements)."""
    kv_bytes_per_token: float = 0.0
    """KV bytes per prompt token (2 * layers * kv_heads * head_dim * dtype size); 0 = unknown."""
    num_layers: int = 1
    """Model layers; KV is pushed layer by layer, so only the last layer's share is exposed."""
    handoff_overhead_s: float = 0.005
    """Fixed cost of a handoff: Reserve, Commit and the extra hops."""
    short_prompt_tokens: int = 64
    """Prompts with at most this many uncached tokens are always prefilled locally."""
    decode_stall_weight: float = 0.5
    """Cost of stalling one running decode sequence for one second, relative to TTFT."""
    max_decode_stall_s: float = 0.1
    """Longest local prefill (estimated compute) put on a decode worker: every stream
    decoding there, now or arriving meanwhile, waits that long for its next token, so
    beyond this the prompt goes to a prefill worker whatever the costs say
    (``inf``: no limit)."""

    def __post_init__(self) -> None:
        _positive("cost.prefill_tokens_per_s", self.prefill_tokens_per_s)
        _positive("cost.decode_prefill_tokens_per_s", self.decode_prefill_tokens_per_s)
        _positive("cost.link_bytes_per_s", self.link_bytes_per_s)
        _non_negative("cost.kv_bytes_per_token", self.kv_bytes_per_token)
        _positive("cost.num_layers", self.num_layers)
        _non_negative("cost.handoff_overhead_s", self.handoff_overhead_s)
        _non_negative("cost.short_prompt_tokens", self.short_prompt_tokens)
        _non_negative("cost.decode_stall_weight", self.decode_stall_weight)
        _non_negative("cost.max_decode_stall_s", self.max_decode_stall_s)


@dataclass(frozen=True)
class TimeoutConfig:
    """Every wait the router does is bounded by one of these (seconds)."""

    connect_s: float = 5.0
    """Unary control calls: Health, Reserve, Release, Cancel."""
    prefill_s: float = 120.0
    """One Prefill call, including the KV push."""
    first_token_s: float = 120.0
    """From dispatch to the first token of a locally prefilled request."""
    inter_token_s: float = 60.0
    """Longest gap between two tokens of a stream before the worker is considered lost."""
    request_s: float = 600.0
    """Whole request, end to end."""
    lease_s: float = 30.0
    """Lease on a decode worker's reserved blocks while the KV is pushed."""
    health_interval_s: float = 1.0
    """How often the router polls each worker's Health."""
    drain_s: float = 60.0
    """Streams already running on a worker that leaves discovery (its pod is being
    deleted: it drains for 50 s in a cluster) keep its connection this long."""

    def __post_init__(self) -> None:
        for f in fields(self):
            _positive(f"timeouts.{f.name}", getattr(self, f.name))


@dataclass(frozen=True)
class HttpConfig:
    """Bounds on the router's HTTP connections, so slow or greedy clients cannot hold
    the server (seconds, connections)."""

    header_timeout_s: float = 10.0
    """A request's head (request line and headers) must arrive whole within this, from
    the connection's start or the request's first byte: a client sending its headers a
    byte at a time is let go."""
    body_timeout_s: float = 60.0
    """A request's body must arrive whole within this once its head has (64 MiB at
    about 1 MB/s)."""
    keep_alive_s: float = 5.0
    """How long an idle connection is kept between requests."""
    max_connections_per_peer: int = 1024
    """Connections served at once from one client address; more are refused with 503.
    Behind a proxy every client has the proxy's address: raise it there."""
    max_connections: int = 4096
    """Connections (and requests in flight) served at once in all; more get 503."""

    def __post_init__(self) -> None:
        for f in fields(self):
            _positive(f"http.{f.name}", getattr(self, f.name))


@dataclass(frozen=True)
class GuardConfig:
    """The correctness guard (:mod:`.guard`): sampled disaggregated greedy requests are
    run again on their decode worker with local prefill and compared token by token."""

    enabled: bool = True
    """False: no request is re-run."""
    sample_share: float = 0.01
    """Share of disaggregated greedy requests re-run, in [0, 1]: each costs its decode
    worker one more local request (its prefill and decode), so 1 % adds about 1 % to the
    decode pool's work."""
    min_interval_s: float = 300.0
    """While such requests arrive, at least one is checked this often (seconds), however
    small the share; the first one after the router starts is always checked."""
    max_concurrent: int = 1
    """Re-runs in flight at once, on all workers together; a request sampled while they
    are all busy is not checked, and the next one is taken instead."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.sample_share <= 1.0:
            raise ConfigError(
                f"guard.sample_share must be within [0, 1], got {self.sample_share!r}"
            )
        _positive("guard.min_interval_s", self.min_interval_s)
        _positive("guard.max_concurrent", self.max_concurrent)


@dataclass(frozen=True)
class RouterConfig:
    """Everything the router needs besides its workers."""

    model_name: str = "splitserve"
    """Model id answered in /v1/models and checked on requests (any name is accepted if empty)."""
    block_size: int = 16
    """Tokens per KV block; must equal the workers' block size for prefix routing."""
    max_model_len: int = 4096
    """Longest prompt plus completion accepted, in tokens."""
    default_max_tokens: int = 256
    """max_tokens used when a request does not say."""
    max_request_bytes: int = 64 << 20
    """Largest request body accepted (413 beyond): 64 prompts of 100,000 token ids fit."""
    api_key: str | None = field(default=None, repr=False)
    """If set, requests need 'Authorization: Bearer <api_key>'; never printed."""
    worker_token: str | None = field(default=None, repr=False)
    """Shared secret sent to workers on every gRPC call."""
    disaggregation: str = "auto"
    """'auto': the cost model decides per request; 'always': remote prefill whenever a
    prefill worker is available; 'never': prefill on the decode worker."""
    kv_backend: str = "tcp"
    """KV transport asked of decode workers on Reserve: 'tcp', 'grpc' or 'nixl'."""
    max_retries: int = 2
    """Retries on another worker after a worker failure (each failure counts once)."""
    tokenizer_threads: int = 2
    """Threads that tokenize, template and decode off the event loop (the tokenizer
    releases the interpreter while it works, so they run beside the loop)."""
    prefill_weights: PrefillWeights = field(default_factory=PrefillWeights)
    decode_weights: DecodeWeights = field(default_factory=DecodeWeights)
    queues: QueueConfig = field(default_factory=QueueConfig)
    cost: CostModelConfig = field(default_factory=CostModelConfig)
    timeouts: TimeoutConfig = field(default_factory=TimeoutConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    tls: TlsConfig = field(default_factory=TlsConfig)
    """TLS on the calls to workers (see :mod:`splitserve.tls`): ``ca_file`` turns it on
    (workers' certificates checked against it), ``cert_file`` and ``key_file`` are the
    router's client certificate for workers that take only mutual TLS."""

    def __post_init__(self) -> None:
        _positive("block_size", self.block_size)
        _positive("max_model_len", self.max_model_len)
        _positive("default_max_tokens", self.default_max_tokens)
        _positive("max_request_bytes", self.max_request_bytes)
        _non_negative("max_retries", self.max_retries)
        _positive("tokenizer_threads", self.tokenizer_threads)
        if self.disaggregation not in ("auto", "always", "never"):
            raise ConfigError(
                f"disaggregation must be 'auto', 'always' or 'never', got {self.disaggregation!r}"
            )
        if self.kv_backend not in ("tcp", "grpc", "nixl"):
            raise ConfigError(
                f"kv_backend must be 'tcp', 'grpc' or 'nixl', got {self.kv_backend!r}"
            )
        if self.tls.serves and not self.tls.verifies:
            raise ConfigError(
                "--tls-cert on the router is its client certificate for workers over TLS: "
                "give --tls-ca too (the CA that signed the workers' certificates)"
            )
        try:  # the files are read now: a wrong one stops the router before it serves
            self.tls.check()
        except TlsError as e:
            raise ConfigError(str(e)) from None

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> RouterConfig:
        """Build from a nested mapping (parsed YAML/JSON); unknown keys are an error."""
        return _build(cls, data, "")


def _named(where: str) -> str:
    """``queues.`` -> ``queues``; the top level is ``config``."""
    return where.rstrip(".") or "config"


def _build(cls: Any, data: Mapping[str, Any], where: str) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{_named(where)} must be a mapping, got {type(data).__name__}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(
            f"unknown setting(s) {unknown} in {_named(where)}; known: {sorted(known)}"
        )
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        default = cls.__dataclass_fields__[name].default_factory  # type: ignore[misc]
        target = default if callable(default) else None
        section = target is not None and is_dataclass(target)
        if section != isinstance(value, Mapping):
            what = "a section: give its fields" if section else "a value, not a section"
            raise ConfigError(f"{where}{name} is {what}")
        kwargs[name] = _build(target, value, f"{where}{name}.") if section else value
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"bad value in {_named(where)}: {e}") from e

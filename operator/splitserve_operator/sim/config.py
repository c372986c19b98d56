"""What is simulated: the pools, their cost models, the link, the scheduling knobs.

:func:`roofline_config` builds a :class:`SimConfig` from names (model, GPU
kind, link) with roofline costs; build one by hand to use measured costs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum

from splitserve_operator.sim.cost import CostModel, RooflineCost, handoff_bytes_s, kv_fanout
from splitserve_operator.sim.hardware import GpuSpec, LinkSpec
from splitserve_operator.sim.model_spec import ModelSpec


class ConfigError(ValueError):
    """An inconsistent simulator configuration; the message says what to change."""


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"
    """Colocated: one engine doing chunked prefill and decode."""


class Mode(StrEnum):
    COLOCATED = "colocated"
    DISAGGREGATED = "disaggregated"


@dataclass(frozen=True)
class Slo:
    """Latency targets; a request attains the SLO when it meets both."""

    ttft_s: float
    tpot_s: float


@dataclass(frozen=True)
class PoolConfig:
    """One kind of engine instance (all instances of a pool are alike)."""

    cost: CostModel
    kv_capacity_tokens: int
    """Tokens of KV one instance holds (HBM left after weights, or the engine's blocks)."""
    tp: int = 1
    """GPUs per instance (tensor parallel); an instance counts this many GPU-seconds per second."""
    max_seqs: int = 256
    """Most sequences decoding at once on one instance."""
    gpu: str = "gpu"
    """For display only."""


@dataclass(frozen=True)
class SimConfig:
    """Colocated when ``pools`` is ``{BOTH}``, disaggregated when ``{PREFILL, DECODE}``."""

    model: ModelSpec
    pools: Mapping[Role, PoolConfig]
    replicas: Mapping[Role, int]
    """Instances of each pool at time zero."""
    link: LinkSpec | None = None
    """Prefill-to-decode KV path (disaggregated only)."""
    link_per_rank: bool = True
    """Each tensor-parallel rank has its own path (per-GPU NICs, NVLink): a handoff takes
    as long as its busiest rank's share on one ``link``. False: one link per worker."""
    layerwise: bool = True
    """Stream KV layer by layer while prefill runs (else send it all after prefill)."""
    chunk_size: int = 512
    """Colocated: token budget of one step (decode tokens plus prefill chunk)."""
    max_prefill_tokens: int = 16384
    """Disaggregated: most prompt tokens batched into one prefill step."""
    prefix_caching: bool = True
    """Reuse cached prefix blocks (traces with ``hash_ids``)."""
    startup_s: float = 0.0
    """Seconds from adding an instance to its taking work (model load)."""
    first_token_after_transfer: bool = True
    """Disaggregated: the first token reaches the client once the KV has landed
    on the decode worker (our router's Prefill() returns then); else at prefill end."""
    router_overhead_s: float = 0.0
    """Fixed latency the router and HTTP add to every first token."""
    local_prefill: LocalPrefill | None = None
    """Disaggregated: let the router prefill some prompts on the decode worker
    (None: every prompt goes to a prefill worker)."""
    name: str = ""
    extra: Mapping[str, str] = field(default_factory=dict)
    """Free-form labels for reports."""

    def __post_init__(self) -> None:
        roles = set(self.pools)
        if roles not in ({Role.BOTH}, {Role.PREFILL, Role.DECODE}):
            raise ConfigError(
                "pools must be {both} (colocated) or {prefill, decode} (disaggregated)"
            )
        if self.mode is Mode.DISAGGREGATED and self.link is None:
            raise ConfigError("a disaggregated configuration needs a link")
        for r in roles:
            if self.replicas.get(r, 0) < 0:
                raise ConfigError(f"replicas of {r} must be >= 0")
        if self.chunk_size < 1 or self.max_prefill_tokens < 1:
            raise ConfigError("chunk_size and max_prefill_tokens must be >= 1")

    @property
    def mode(self) -> Mode:
        return Mode.COLOCATED if Role.BOTH in self.pools else Mode.DISAGGREGATED

    @property
    def gpus(self) -> int:
        """GPUs of the initial replicas."""
        return sum(self.replicas.get(r, 0) * p.tp for r, p in self.pools.items())

    def handoff_s(self, prompt_tokens: int) -> float:
        """Seconds the KV of ``prompt_tokens`` occupies the link from a prefill worker to
        a decode worker (the fixed latency aside): each prefill rank sends each decode
        rank the heads it owns (:func:`~splitserve_operator.sim.cost.kv_fanout`)."""
        if self.link is None:
            raise ConfigError("a colocated configuration hands no KV off")
        fanout = kv_fanout(
            self.model.kv_heads, self.pools[Role.PREFILL].tp, self.pools[Role.DECODE].tp
        )
        head_bytes = prompt_tokens * self.model.kv_bytes_per_token_per_head
        return handoff_bytes_s(
            fanout, head_bytes, self.link.bandwidth, link_per_rank=self.link_per_rank
        )

    def with_replicas(self, **replicas: int) -> SimConfig:
        return replace(
            self, replicas={**self.replicas, **{Role(k): v for k, v in replicas.items()}}
        )

    def label(self) -> str:
        if self.mode is Mode.COLOCATED:
            p = self.pools[Role.BOTH]
            return f"colocated {self.replicas[Role.BOTH]}x tp{p.tp} chunk {self.chunk_size}"
        p, d = self.pools[Role.PREFILL], self.pools[Role.DECODE]
        return (
            f"disaggregated {self.replicas[Role.PREFILL]}P(tp{p.tp}):"
            f"{self.replicas[Role.DECODE]}D(tp{d.tp})"
        )


@dataclass(frozen=True)
class LocalPrefill:
    """The router's per-request choice to prefill on the decode worker itself
    (mirrors ``splitserve_worker.router.decision``): always for short prompts,
    otherwise when its estimate of local time (queue, compute, and the stall it
    inflicts on running sequences) is below remote time (queue, compute, exposed
    transfer, handoff). Decode instances then run chunked prefill too."""

    short_prompt_tokens: int = 64
    prefill_tokens_per_s: float = 2000.0
    """The router's estimate of a prefill worker's speed (not the simulated one)."""
    decode_prefill_tokens_per_s: float = 2000.0
    handoff_overhead_s: float = 0.005
    decode_stall_weight: float = 0.5
    max_decode_stall_s: float = 0.1
    """Never prefill locally when it would hold the decode worker longer than this."""
    exposed_s_per_token: float = 0.0
    """The router's estimate of exposed transfer per prompt token (0: KV size unknown)."""

    def is_local(
        self, prompt: int, prefill_tokens_ahead: int, decode_waiting: int, decode_running: int
    ) -> bool:
        if prompt <= self.short_prompt_tokens:
            return True
        remote = (
            prefill_tokens_ahead / self.prefill_tokens_per_s
            + prompt / self.prefill_tokens_per_s
            + prompt * self.exposed_s_per_token
            + self.handoff_overhead_s
        )
        compute = prompt / self.decode_prefill_tokens_per_s
        if compute > self.max_decode_stall_s:
            return False
        local = (
            decode_waiting * compute + compute + self.decode_stall_weight * decode_running * compute
        )
        return local < remote


MEMORY_UTILIZATION = 0.9
"""Fraction of GPU memory an engine may use (vLLM's default ``gpu_memory_utilization``)."""

MAX_WEIGHT_SHARE = 0.6
"""Pick the smallest tensor-parallel degree whose weight share leaves at least 40 %
of each GPU's memory for KV cache and activations."""


def pick_tp(model: ModelSpec, gpu: GpuSpec, max_tp: int = 8) -> int:
    tp = 1
    while tp < max_tp and model.weight_bytes / tp > MAX_WEIGHT_SHARE * gpu.memory_bytes:
        tp *= 2
    if model.weight_bytes / tp > MEMORY_UTILIZATION * gpu.memory_bytes:
        raise ConfigError(f"{model.name} does not fit on {max_tp} x {gpu.name}")
    return tp


def kv_capacity_tokens(model: ModelSpec, gpu: GpuSpec, tp: int) -> int:
    free = MEMORY_UTILIZATION * gpu.memory_bytes - model.weight_bytes / tp
    if free <= 0:
        raise ConfigError(f"{model.name} weights do not fit on {gpu.name} at tp={tp}")
    return int(free // model.kv_bytes_per_token_per_gpu(tp))


def roofline_pool(
    model: ModelSpec, gpu: GpuSpec, tp: int | None = None, **cost_knobs: float
) -> PoolConfig:
    tp = tp or pick_tp(model, gpu)
    return PoolConfig(
        cost=RooflineCost(model, gpu, tp, **cost_knobs),
        kv_capacity_tokens=kv_capacity_tokens(model, gpu, tp),
        tp=tp,
        gpu=gpu.name,
    )


def roofline_config(
    model: ModelSpec,
    mode: Mode,
    gpu: GpuSpec,
    *,
    link: LinkSpec | None = None,
    decode_gpu: GpuSpec | None = None,
    tp: int | None = None,
    prefill_tp: int | None = None,
    decode_tp: int | None = None,
    prefill: int = 1,
    decode: int = 1,
    both: int = 1,
    **knobs: object,
) -> SimConfig:
    """Roofline pools for ``mode``: ``gpu`` runs prefill (or both), ``decode_gpu``
    (default ``gpu``) runs decode; ``tp`` is every pool's tensor parallelism unless
    ``prefill_tp`` or ``decode_tp`` says otherwise (``None``: the smallest that fits,
    :func:`pick_tp`). ``knobs`` are further :class:`SimConfig` fields."""
    pools: dict[Role, PoolConfig]
    if mode is Mode.COLOCATED:
        pools = {Role.BOTH: roofline_pool(model, gpu, tp)}
        replicas = {Role.BOTH: both}
    else:
        dg = decode_gpu or gpu
        pools = {
            Role.PREFILL: roofline_pool(model, gpu, prefill_tp or tp),
            Role.DECODE: roofline_pool(model, dg, decode_tp or tp),
        }
        replicas = {Role.PREFILL: prefill, Role.DECODE: decode}
    return SimConfig(
        model=model,
        pools=pools,
        replicas=replicas,
        link=link,
        **knobs,  # type: ignore[arg-type]
    )

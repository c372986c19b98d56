"""Disaggregate or not: a pure cost model, decided per request.

Remote (disaggregated) prefill costs the wait for a prefill worker, the
uncached prompt tokens at the prefill worker's speed, the share of the KV
transfer still exposed after the last layer (the push overlaps the compute,
layer by layer) and a fixed handoff overhead. Local prefill on the chosen
decode worker costs its uncached tokens at the decode worker's speed, the
wait behind its own queue, plus the stall it inflicts on the sequences it is
decoding (each running sequence waits for the whole local prefill), weighted
by ``decode_stall_weight``. A local prefill longer than ``max_decode_stall_s`` is
never chosen while a prefill worker can take it: it holds back the next token of
every stream decoding there, now or arriving during it, which is the
interference disaggregation exists to remove. A 'both' (colocated) decode worker is
the exception: it serves prompts by design, and only the costs say whether a prefill
worker beside it should take one (it does when it is less busy).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum

from splitserve_worker.router.config import CostModelConfig


class Policy(StrEnum):
    """How the decision is taken: by the cost model, or fixed."""

    AUTO = "auto"
    """The cost model decides per request."""
    ALWAYS = "always"
    """Prefill on a prefill worker whenever one is available (benchmarks, tests)."""
    NEVER = "never"
    """Always prefill on the decode worker."""


class Where(StrEnum):
    REMOTE = "remote"
    """Prefill on a prefill worker, push the KV to the decode worker."""
    LOCAL = "local"
    """Prefill on the decode worker itself."""


@dataclass(frozen=True)
class DecisionInput:
    num_prompt_tokens: int
    cached_on_prefill_tokens: int = 0
    """Prompt tokens already cached on the chosen prefill worker."""
    cached_on_decode_tokens: int = 0
    """Prompt tokens already cached on the chosen decode worker."""
    prefill_wait_s: float = 0.0
    """Estimated queueing before the prefill worker starts this prompt."""
    decode_wait_s: float = 0.0
    """Estimated queueing before the decode worker could prefill this prompt."""
    decode_running: int = 0
    """Sequences the decode worker is decoding now (they stall during a local prefill)."""
    prefill_available: bool = True
    """False when no prefill worker can take the request."""
    decode_is_colocated: bool = False
    """The decode worker is a 'both' worker: prefilling is its job as much as a prefill
    worker's, so ``max_decode_stall_s`` does not bar it; the costs decide (a free prefill
    worker spares its streams the stall, a queued one loses to it)."""


@dataclass(frozen=True)
class Decision:
    where: Where
    reason: str
    remote_s: float
    local_s: float


def transfer_exposed_s(tokens: int, cost: CostModelConfig) -> float:
    """Transfer time left after prefill ends: one layer's share when pushed layer by layer."""
    total = tokens * cost.kv_bytes_per_token / cost.link_bytes_per_s
    return total / cost.num_layers


def decide(inp: DecisionInput, cost: CostModelConfig, policy: Policy = Policy.AUTO) -> Decision:
    """Where this request's prompt should be prefilled."""
    prompt = max(0, inp.num_prompt_tokens)
    uncached_remote = max(0, prompt - inp.cached_on_prefill_tokens)
    uncached_local = max(0, prompt - inp.cached_on_decode_tokens)
    # A prefill worker recomputes at least the last token; so does the decode worker.
    remote_s = (
        inp.prefill_wait_s
        + max(1, uncached_remote) / cost.prefill_tokens_per_s
        + transfer_exposed_s(prompt, cost)
        + cost.handoff_overhead_s
    )
    local_compute = max(1, uncached_local) / cost.decode_prefill_tokens_per_s
    local_s = (
        inp.decode_wait_s
        + local_compute
        + cost.decode_stall_weight * inp.decode_running * local_compute
    )
    if not inp.prefill_available:
        return Decision(Where.LOCAL, "no prefill worker available", remote_s, local_s)
    if policy is Policy.ALWAYS:
        return Decision(Where.REMOTE, "policy: always disaggregate", remote_s, local_s)
    if policy is Policy.NEVER:
        return Decision(Where.LOCAL, "policy: never disaggregate", remote_s, local_s)
    if uncached_local <= cost.short_prompt_tokens:
        return Decision(
            Where.LOCAL, "short or mostly cached on the decode worker", remote_s, local_s
        )
    if local_compute > cost.max_decode_stall_s and not inp.decode_is_colocated:
        return Decision(
            Where.REMOTE,
            f"local prefill would hold the decode worker for {local_compute:.3f} s "
            f"(limit {cost.max_decode_stall_s:g} s)",
            remote_s,
            local_s,
        )
    if local_s < remote_s:
        return Decision(Where.LOCAL, "local prefill is cheaper", remote_s, local_s)
    return Decision(Where.REMOTE, "remote prefill is cheaper", remote_s, local_s)


DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


class CostEstimator:
    """The cost model's numbers, refined from what the workers report.

    Starts from the configured numbers; the KV size per token comes from a
    worker's compat info (layers, KV heads, head dim, dtype), the prefill speed
    and link bandwidth from each Prefill answer (exponentially weighted, so a
    few slow calls do not swing it).
    """

    def __init__(self, base: CostModelConfig, alpha: float = 0.2) -> None:
        self.cost = base
        self.alpha = alpha
        self._kv_known = base.kv_bytes_per_token > 0

    def observe_compat(self, num_layers: int, kv_heads: int, head_dim: int, dtype: str) -> None:
        if self._kv_known or num_layers <= 0:
            return
        size = DTYPE_BYTES.get(dtype.removeprefix("torch."), 2)
        self.cost = replace(
            self.cost,
            kv_bytes_per_token=float(2 * num_layers * kv_heads * head_dim * size),
            num_layers=num_layers,
        )
        self._kv_known = True

    def _blend(self, old: float, new: float) -> float:
        return (1 - self.alpha) * old + self.alpha * new

    def observe_prefill(
        self, tokens: int, prefill_s: float, bytes_sent: int, transfer_s: float
    ) -> None:
        """One remote prefill: ``tokens`` computed in ``prefill_s``, ``bytes_sent`` in
        ``transfer_s``. Prefill and decode workers are taken to run on the same kind of
        hardware, so the measured speed updates both prefill speeds."""
        c = self.cost
        if tokens > 0 and prefill_s > 0:
            speed = tokens / prefill_s
            c = replace(
                c,
                prefill_tokens_per_s=self._blend(c.prefill_tokens_per_s, speed),
                decode_prefill_tokens_per_s=self._blend(c.decode_prefill_tokens_per_s, speed),
            )
        if bytes_sent > 0 and transfer_s > 0:
            c = replace(
                c, link_bytes_per_s=self._blend(c.link_bytes_per_s, bytes_sent / transfer_s)
            )
        self.cost = c

"""One routing decision: prefill worker, decode worker, local or remote prefill.

Pure and synchronous: it reads the prefix index and a snapshot of worker
views, and returns a :class:`Plan`. The dispatcher turns plans into calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from splitserve.roles import DECODE_ROLES, PREFILL_ROLES, Role

from splitserve_worker.router.config import RouterConfig
from splitserve_worker.router.decision import (
    CostEstimator,
    Decision,
    DecisionInput,
    Policy,
    Where,
    decide,
)
from splitserve_worker.router.prefix_index import PrefixIndex
from splitserve_worker.router.scoring import (
    Choice,
    Profile,
    RouteRequest,
    WorkerView,
    decode_profile,
    prefill_profile,
)


@dataclass(frozen=True)
class Plan:
    decode: Choice
    prefill: Choice | None
    """None when the prompt is prefilled on the decode worker."""
    decision: Decision

    @property
    def remote(self) -> bool:
        return self.prefill is not None


@dataclass(frozen=True)
class _Sides:
    """A snapshot's workers by what they can take."""

    prefill: Sequence[WorkerView]
    """Prefill and 'both' workers."""
    prefill_only: Sequence[WorkerView]
    """Prefill workers proper: the ones a 'both' decode worker hands prompts to."""
    decode: Sequence[WorkerView]
    """Decode and 'both' workers."""


class NoWorker(Exception):
    """No worker can take the request now (all busy, full, failed or absent)."""


class RoutePlanner:
    def __init__(self, config: RouterConfig, index: PrefixIndex | None = None) -> None:
        self.config = config
        self.index = index if index is not None else PrefixIndex()
        self.estimator = CostEstimator(config.cost)
        self.policy = Policy(config.disaggregation)
        pw, dw = config.prefill_weights, config.decode_weights
        self.prefill_profile: Profile = prefill_profile(pw.prefix, pw.load)
        self.decode_profile: Profile = decode_profile(dw.kv_free, dw.running, dw.prefix)
        self._split_of: Sequence[WorkerView] | None = None
        self._sides: _Sides = _Sides((), (), ())

    def _split(self, workers: Sequence[WorkerView]) -> _Sides:
        """Workers by side, computed once per snapshot (snapshots are immutable tuples)."""
        if self._split_of is not workers:
            self._split_of = workers
            self._sides = _Sides(
                prefill=tuple(w for w in workers if w.role in PREFILL_ROLES),
                prefill_only=tuple(w for w in workers if w.role is Role.PREFILL),
                decode=tuple(w for w in workers if w.role in DECODE_ROLES),
            )
        return self._sides

    def plan(
        self,
        num_prompt_tokens: int,
        block_hashes: Sequence[int],
        workers: Sequence[WorkerView],
        exclude: frozenset[str] = frozenset(),
        force_local: bool = False,
    ) -> Plan:
        cfg = self.config
        cached = self.index.match(block_hashes)
        req = RouteRequest(
            num_prompt_tokens, block_hashes, cfg.block_size, exclude=exclude, cached_blocks=cached
        )
        sides = self._split(workers)
        decode = self.decode_profile.choose(req, sides.decode)
        if decode is None:
            raise NoWorker("no healthy decode worker has room for this prompt")
        # a prefill worker distinct from the decode worker ('both' workers can be either);
        # a 'both' decode worker hands prompts only to a prefill worker proper: another
        # 'both' worker would just take the stall on its own streams instead
        prefill = None
        if not force_local:
            others = RouteRequest(
                num_prompt_tokens,
                block_hashes,
                cfg.block_size,
                exclude=exclude | {decode.worker.identity},
                cached_blocks=cached,
            )
            colocated = decode.worker.role is Role.BOTH
            candidates = sides.prefill_only if colocated else sides.prefill
            prefill = self.prefill_profile.choose(others, candidates)
        bs = cfg.block_size
        cost = self.estimator.cost
        d = decode.worker
        inp = DecisionInput(
            num_prompt_tokens=num_prompt_tokens,
            cached_on_decode_tokens=cached.get(d.name, 0) * bs,
            cached_on_prefill_tokens=cached.get(prefill.worker.name, 0) * bs if prefill else 0,
            prefill_wait_s=(
                _tokens_ahead(prefill.worker, num_prompt_tokens) / cost.prefill_tokens_per_s
                if prefill
                else 0.0
            ),
            decode_wait_s=d.waiting * num_prompt_tokens / cost.decode_prefill_tokens_per_s,
            decode_running=max(d.running, d.assigned),
            prefill_available=prefill is not None,
            decode_is_colocated=d.role is Role.BOTH,
        )
        decision = decide(inp, cost, self.policy)
        return Plan(
            decode=decode,
            prefill=prefill if decision.where is Where.REMOTE else None,
            decision=decision,
        )

    def nowhere(
        self, num_prompt_tokens: int, workers: Sequence[WorkerView], exclude: frozenset[str]
    ) -> str | None:
        """Why no decode worker known can ever take this request as the pool stands, or
        None while one may (a busy one may free up, one that is down may come back, as
        itself or restarted): every decode worker already failed it and is still that
        same worker, or holds fewer blocks in all than the prompt needs."""
        decode_side = self._split(workers).decode
        if not decode_side:
            return None  # none known yet: discovery may bring one
        need = RouteRequest(num_prompt_tokens, block_size=self.config.block_size).blocks_needed
        reasons = []
        for w in decode_side:
            if w.healthy and w.identity in exclude:
                reasons.append(f"{w.name} already failed it")
            elif 0 < w.total_blocks < need:
                reasons.append(f"{w.name} holds {w.total_blocks} KV blocks, it needs {need}")
            else:
                return None
        return "no decode worker can take this request: " + "; ".join(reasons)


def _tokens_ahead(w: WorkerView, prompt_tokens: int) -> int:
    return w.tokens_in_flight + (w.waiting + w.assigned) * prompt_tokens

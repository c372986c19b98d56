"""When a switchable worker should change role: the rebalancing policy, pure.

One tick in (each side's load, the switchable pool's split, what a switch and a new pod
cost, what the last ticks remembered, the time), one :class:`BalanceDecision` out. The
operator's planner feeds it what Prometheus shows, ``splitserve up --flex`` what the
router measures; the unit tests feed it numbers worked out by hand.

The rule, in order (the first that applies decides):

1. a switch under way: hold (one at a time);
2. neither side under pressure: no switch; both: no switch when a pod can be added
   (scaling is the planner's), but on a fixed budget (no pod can be added) the side at
   least ``dominance`` times further over its SLO than the other is the needy one, and
   the other, pressed less, gives a worker without having to be comfortable (rule 4):
   on a fixed budget capacity goes where it is short the most;
3. the side under pressure must have been so for ``sustain_s`` (hysteresis in time);
4. the other side, the donor, must be comfortable: no pressure and its latency under
   ``comfort_band`` of its SLO (hysteresis in level: a donor near its SLO would be the
   needy side after the switch, and the next tick would switch back);
5. the donor must have a switchable worker to give and keep ``min_per_role`` workers
   (``both`` workers count for each role); when its last one would go and
   ``colocate_last`` allows, that worker switches to ``both`` instead (it keeps its
   role and takes the needy one too: two workers can still rebalance);
6. at most one switch per ``min_dwell_s``; a switch forced by rule 2 that takes a
   worker back from the side the last switch gave one to waits ``reversal_dwells``
   dwells (each such switch makes the other side the worse one, and a pair of workers
   would trade one role back and forth, a dwell apart, for as long as both are pressed);
7. cost: a switch costs the donor's drain plus the prefix cache it loses (its hit
   ratio times ``cache_rewarm_s``); a new pod costs its cold start. Switch when that is
   cheaper, or when no pod can be added and the switch costs under
   ``max_switch_cost_s``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum

from splitserve.roles import Role


class Reason(StrEnum):
    SWITCH = "switch"
    SWITCHING = "switch_under_way"
    BALANCED = "balanced"
    BOTH_PRESSED = "both_under_pressure"
    SUSTAIN = "not_sustained"
    DONOR_BUSY = "donor_not_comfortable"
    NO_DONOR = "no_worker_to_give"
    DWELL = "dwell"
    SCALING_CHEAPER = "new_pod_cheaper"
    TOO_COSTLY = "switch_too_costly"
    MISSING = "missing_data"


@dataclass(frozen=True)
class SideLoad:
    """How one side (prefill or decode) fares this tick."""

    slo_ratio: float | None
    """Prefill: TTFT percentile over its SLO; decode: TPOT's. None: no reading."""
    queue_pressure: bool = False
    """Its router queue takes more than its share of the TTFT budget."""
    kv_pressure: bool = False
    """Decode only: KV cache nearly full."""

    @property
    def pressed(self) -> bool:
        return (
            self.queue_pressure
            or self.kv_pressure
            or (self.slo_ratio is not None and self.slo_ratio >= 1.0)
        )

    def comfortable(self, band: float) -> bool:
        return not self.pressed and (self.slo_ratio is None or self.slo_ratio <= band)


@dataclass(frozen=True)
class Split:
    """Workers serving each role now: the switchable pool's, and the fixed pools'."""

    prefill: int
    decode: int
    switching: int = 0
    fixed_prefill: int = 0
    fixed_decode: int = 0
    both: int = 0
    """Switchable workers serving both roles (colocated) now."""

    def flex(self, role: Role) -> int:
        return {Role.PREFILL: self.prefill, Role.DECODE: self.decode, Role.BOTH: self.both}[role]

    def serving(self, role: Role) -> int:
        fixed = self.fixed_prefill if role is Role.PREFILL else self.fixed_decode
        return fixed + self.flex(role) + self.both

    def after(self, frm: Role, to: Role) -> Split:
        """The split once one worker switched from ``frm`` to ``to``."""
        counts = {Role.PREFILL: self.prefill, Role.DECODE: self.decode, Role.BOTH: self.both}
        counts[frm] -= 1
        counts[to] += 1
        return replace(self, prefill=counts[Role.PREFILL], decode=counts[Role.DECODE],
                       both=counts[Role.BOTH])  # fmt: skip


@dataclass(frozen=True)
class Costs:
    """What a switch and a new pod cost, in seconds of a worker not serving."""

    drain_s: float
    """Expected drain of a donor worker (its streams' remaining time, bounded by the
    worker's drain time; a prefill donor's pushes)."""
    prefix_hit_ratio: float
    """Share of prompt tokens the donor's prefix cache serves (lost by the switch)."""
    cold_start_s: float
    """A new pod to serving: scheduling, image pull, weights."""
    can_scale: bool
    """A new pod may be added (below the pool's maximum, budget left)."""


@dataclass(frozen=True)
class BalanceConfig:
    min_dwell_s: float = 60.0
    """Shortest time between two switches: long enough for the latency percentiles to
    show the last switch's effect before the next is decided."""
    sustain_s: float = 10.0
    """How long one side must be under pressure, the other not, before a switch: a
    burst shorter than a drain is not worth one."""
    comfort_band: float = 0.8
    """The donor's latency must be under this share of its SLO (it must stay inside its
    SLO with one worker fewer)."""
    cache_rewarm_s: float = 30.0
    """What losing a prefix cache that served every prompt token costs (s): prompts
    recomputed until the cache fills again. Scaled by the donor's hit ratio."""
    max_switch_cost_s: float = 120.0
    """A switch that costs more is not made, even with no pod to add."""
    min_per_role: int = 1
    """Workers each role keeps, fixed and switchable together."""
    colocate_last: bool = True
    """When the donor's last worker would go, switch it to ``both`` instead."""
    reversal_dwells: float = 3.0
    """How many dwells a switch forced by uneven pressure on both sides waits when it
    takes a worker back from the side the last switch gave one to (``1``: no longer than
    any switch). A side that is comfortable again gives its worker back after one dwell,
    as ever."""
    dominance: float = 3.0
    """With both sides over their SLOs and no pod to add: how many times further over
    its SLO (latency over objective) one side must be than the other to take a worker
    from it. High enough that a side merely slowed by its neighbour's load (on shared
    hosts both latencies rise together) is not mistaken for the short one; ``inf``
    never switches under pressure on both sides."""

    def __post_init__(self) -> None:
        for name in ("min_dwell_s", "sustain_s", "cache_rewarm_s", "max_switch_cost_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 < self.comfort_band < 1:
            raise ValueError(f"comfort_band must be in (0, 1), got {self.comfort_band}")
        if self.min_per_role < 1:
            raise ValueError(f"min_per_role must be >= 1, got {self.min_per_role}")
        if not self.dominance > 1:
            raise ValueError(f"dominance must be > 1, got {self.dominance}")
        if not self.reversal_dwells >= 1:
            raise ValueError(f"reversal_dwells must be >= 1, got {self.reversal_dwells}")


@dataclass(frozen=True)
class BalanceMemory:
    """What the policy remembers between ticks."""

    last_switch_at: float | None = None
    last_gave: Role | None = None
    """The side (prefill or decode) the last switch gave a worker to."""
    needy: Role | None = None
    needy_since: float | None = None


@dataclass(frozen=True)
class BalanceDecision:
    switch_to: Role | None
    """Switch one worker to this role now (None: no switch)."""
    reason: Reason
    detail: str
    memory: BalanceMemory
    switch_cost_s: float | None = None
    switch_from: Role | None = None
    """The role of the worker that switches."""


def gave_to(frm: Role, to: Role) -> Role:
    """The side a switch from ``frm`` to ``to`` gave a worker to: ``to``, or for a worker
    that took on both roles, the one it did not serve before."""
    if to is not Role.BOTH:
        return to
    return Role.DECODE if frm is Role.PREFILL else Role.PREFILL


def _move(
    split: Split, donor: Role, needy: Role, config: BalanceConfig
) -> tuple[Role, Role] | None:
    """Which worker switches, from and to what role: a donor-only worker to the needy
    role while the donor's role keeps ``min_per_role``, else (``colocate_last``) to
    ``both``; or a colocated worker drops the donor's role. None: no worker may go."""
    keeps = split.serving(donor) - 1 >= config.min_per_role
    if split.flex(donor) >= 1:
        if keeps:
            return donor, needy
        if config.colocate_last:
            return donor, Role.BOTH
    if split.both >= 1 and keeps:
        return Role.BOTH, needy
    return None


def _dominant(prefill: SideLoad, decode: SideLoad, dominance: float) -> Role | None:
    """The side at least ``dominance`` times further over its SLO than the other (both
    pressed), or None: each needs a reading."""
    if prefill.slo_ratio is None or decode.slo_ratio is None:
        return None
    if prefill.slo_ratio >= dominance * decode.slo_ratio:
        return Role.PREFILL
    if decode.slo_ratio >= dominance * prefill.slo_ratio:
        return Role.DECODE
    return None


def _both_pressed(prefill: SideLoad, decode: SideLoad, costs: Costs, config: BalanceConfig) -> str:
    if costs.can_scale:
        return "both sides under pressure: add pods, not switch"

    def said(side: SideLoad) -> str:
        return "no reading" if side.slo_ratio is None else f"{side.slo_ratio:.3g}x"

    return (f"both sides under pressure (prefill {said(prefill)}, decode {said(decode)} "
            f"their SLOs), neither {config.dominance:g}x the other's; no pod to add")  # fmt: skip


def decide(
    prefill: SideLoad,
    decode: SideLoad,
    split: Split,
    costs: Costs,
    memory: BalanceMemory,
    now: float,
    config: BalanceConfig,
) -> BalanceDecision:
    """One tick of the policy (see the module's docstring). Pure."""

    def hold(reason: Reason, detail: str, mem: BalanceMemory = memory) -> BalanceDecision:
        return BalanceDecision(None, reason, detail, mem)

    if split.switching:
        return hold(Reason.SWITCHING, f"{split.switching} worker(s) switching")
    forced: Role | None = None
    if prefill.pressed and decode.pressed:
        forced = None if costs.can_scale else _dominant(prefill, decode, config.dominance)
        if forced is None:
            return hold(Reason.BOTH_PRESSED, _both_pressed(prefill, decode, costs, config),
                        replace(memory, needy=None, needy_since=None))  # fmt: skip
    elif not (prefill.pressed or decode.pressed):
        return hold(Reason.BALANCED, "neither side under pressure",
                    replace(memory, needy=None, needy_since=None))  # fmt: skip
    needy = forced or (Role.PREFILL if prefill.pressed else Role.DECODE)
    donor_role = Role.DECODE if needy is Role.PREFILL else Role.PREFILL
    donor = decode if needy is Role.PREFILL else prefill
    since = memory.needy_since
    if memory.needy is not needy or since is None:
        since = now
        memory = replace(memory, needy=needy, needy_since=now)
    pressed_for = now - since
    if pressed_for < config.sustain_s:
        return hold(Reason.SUSTAIN, f"{needy} under pressure for {pressed_for:g} s of "
                    f"{config.sustain_s:g}", memory)  # fmt: skip
    if forced is None and not donor.comfortable(config.comfort_band):
        ratio = "no reading" if donor.slo_ratio is None else f"{donor.slo_ratio:.3g}x SLO"
        return hold(Reason.DONOR_BUSY, f"{donor_role} is not comfortable ({ratio})", memory)
    move = _move(split, donor_role, needy, config)
    if move is None:
        return hold(Reason.NO_DONOR, f"no switchable {donor_role} worker to give "
                    f"({split.flex(donor_role)} switchable, {split.both} colocated, "
                    f"{split.serving(donor_role)} serving, {config.min_per_role} kept)",
                    memory)  # fmt: skip
    frm, to = move
    takes_back = forced is not None and memory.last_gave is donor_role
    dwell = config.min_dwell_s * (config.reversal_dwells if takes_back else 1.0)
    if memory.last_switch_at is not None and now - memory.last_switch_at < dwell:
        back = (f" (it would take back the worker the last switch gave {donor_role}, "
                f"both sides pressed)" if takes_back else "")  # fmt: skip
        return hold(Reason.DWELL, f"last switch {now - memory.last_switch_at:g} s ago, "
                    f"dwell {dwell:g} s{back}", memory)  # fmt: skip
    cost = costs.drain_s + costs.prefix_hit_ratio * config.cache_rewarm_s
    if costs.can_scale and cost >= costs.cold_start_s:
        return BalanceDecision(None, Reason.SCALING_CHEAPER, f"a switch costs {cost:.3g} s, "
                               f"a new pod {costs.cold_start_s:.3g} s", memory, cost)  # fmt: skip
    if cost > config.max_switch_cost_s:
        return BalanceDecision(None, Reason.TOO_COSTLY, f"a switch costs {cost:.3g} s, over "
                               f"{config.max_switch_cost_s:g} s", memory, cost)  # fmt: skip
    done = BalanceMemory(last_switch_at=now, last_gave=gave_to(frm, to))
    worse = (f" ({needy} {config.dominance:g}x further over its SLO than {donor_role}, "
             f"no pod to add)" if forced else "")  # fmt: skip
    detail = (f"{frm} -> {to}: {needy} under pressure for {pressed_for:g} s{worse}, a "
              f"switch costs {cost:.3g} s vs {costs.cold_start_s:.3g} s for a new pod")  # fmt: skip
    return BalanceDecision(to, Reason.SWITCH, detail, done, cost, frm)

"""The simulator's pools: adding, readying, resizing, draining and retiring instances."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from splitserve_operator.sim.config import ConfigError, Role
from splitserve_operator.sim.events import EventLoop
from splitserve_operator.sim.instances import (
    ColocatedInstance,
    DecodeInstance,
    Instance,
    PrefillInstance,
    State,
)
from splitserve_operator.sim.prefix import PrefixCache

if TYPE_CHECKING:
    from splitserve_operator.sim.simulator import Simulator


class PoolsMixin(EventLoop):
    """Pool sizes over time; the simulator's instances come and go here."""

    if TYPE_CHECKING:

        def _dispatch_pending(self, role: Role) -> None:
            """Route what waited for an active instance of ``role`` (the router's part)."""

    def set_replicas(
        self, *, prefill: int | None = None, decode: int | None = None, both: int | None = None
    ) -> None:
        """Resize pools from now on. Added instances take work after
        ``config.startup_s``; removed ones are the starting ones first, then the
        least loaded, which drain (finish what they hold) before their GPUs go."""
        for role, n in ((Role.PREFILL, prefill), (Role.DECODE, decode), (Role.BOTH, both)):
            if n is None:
                continue
            if role not in self.pools:
                raise ConfigError(f"this simulation ({self.config.mode}) has no {role} pool")
            if n < 0:
                raise ConfigError(f"replicas of {role} must be >= 0")
            self._resize(role, n)

    def replicas(self, role: Role) -> int:
        """Instances of ``role`` that are active or starting (what was last asked for)."""
        return sum(1 for i in self.pools[role] if i.state in (State.ACTIVE, State.STARTING))

    def _add_instance(self, role: Role, state: State) -> Instance:
        cfg = self.config
        pool = cfg.pools[role]
        iid = next(self._ids)
        inst: Instance
        sim = cast("Simulator", self)
        blocks = pool.kv_capacity_tokens // self._block_tokens if cfg.prefix_caching else 0
        if role is Role.DECODE and cfg.local_prefill is None:
            inst = DecodeInstance(sim, iid, pool, self.now, state)
        elif role is Role.PREFILL:
            inst = PrefillInstance(
                sim, iid, pool, self.now, state, PrefixCache(blocks, self._block_tokens)
            )
        else:
            cache = PrefixCache(blocks, self._block_tokens)
            inst = ColocatedInstance(sim, iid, pool, self.now, state, cache, role)
        self.pools[role].append(inst)
        if state is State.STARTING:
            self.schedule(self.now + cfg.startup_s, self._ready, inst)
        return inst

    def _ready(self, inst: Instance) -> None:
        if inst.state is State.STARTING:
            inst.state = State.ACTIVE
            self._dispatch_pending(inst.role)

    def _resize(self, role: Role, n: int) -> None:
        pool = self.pools[role]
        live = [i for i in pool if i.state in (State.ACTIVE, State.STARTING)]
        if n > len(live):
            need = n - len(live)
            for inst in [i for i in pool if i.state is State.DRAINING][:need]:
                inst.state = State.ACTIVE
                need -= 1
            for _ in range(need):
                self._add_instance(
                    role, State.STARTING if self.config.startup_s > 0 else State.ACTIVE
                )
            self._dispatch_pending(role)
        elif n < len(live):
            excess = len(live) - n
            starting = [i for i in reversed(live) if i.state is State.STARTING]
            for inst in starting[:excess]:
                self._retire(inst)
                excess -= 1
            active = sorted((i for i in live if i.state is State.ACTIVE), key=self._idle_score)
            for inst in active[:excess]:
                inst.state = State.DRAINING
                if not inst.has_work():
                    self._retire(inst)

    @staticmethod
    def _idle_score(inst: Instance) -> float:
        if isinstance(inst, DecodeInstance):
            return inst.batch.reserved + inst.waiting_tokens
        if isinstance(inst, ColocatedInstance):
            return inst.batch.reserved + inst.queued_tokens
        assert isinstance(inst, PrefillInstance)
        return inst.queued_tokens + inst.running_tokens

    def _retire(self, inst: Instance) -> None:
        inst.state = State.GONE
        inst.removed_at = self.now
        self._gone_gpu_seconds += inst.pool.tp * (self.now - inst.created_at)
        b = getattr(inst, "batch", None)
        if b is not None:
            self._gone_tokens += b.tokens_out
        self.pools[inst.role].remove(inst)

    def idle(self, inst: Instance) -> None:
        """An instance ran out of work."""
        if inst.state is State.DRAINING:
            self._retire(inst)

"""The simulator's pools: adding, readying, resizing, draining and retiring instances,
and the GPU time and decode tokens of every instance, gone ones included."""

from __future__ import annotations

from collections.abc import Callable

from splitserve_operator.sim.colocated import ColocatedInstance
from splitserve_operator.sim.config import ConfigError, Role, SimConfig
from splitserve_operator.sim.instance_base import Host, Instance, SpanInstance, State
from splitserve_operator.sim.instances import DecodeInstance, PrefillInstance
from splitserve_operator.sim.prefix import PrefixCache


class Pools:
    """Pool sizes over time; the simulation's instances come and go here.

    ``host`` is the simulation the instances run in; ``dispatch(role)`` is called when
    an instance of ``role`` may take work that waited for one (it became active)."""

    def __init__(
        self,
        config: SimConfig,
        host: Host,
        block_tokens: int,
        dispatch: Callable[[Role], None],
    ) -> None:
        self.config = config
        self.host = host
        self.block_tokens = block_tokens
        self.dispatch = dispatch
        self.instances: dict[Role, list[Instance]] = {r: [] for r in config.pools}
        """The instances of each pool that are not gone, in the order they were added."""
        self._ids = 0
        self._gone_gpu_seconds = 0.0
        self._gone_tokens = 0

    def set_replicas(
        self, *, prefill: int | None = None, decode: int | None = None, both: int | None = None
    ) -> None:
        """Resize pools from now on. Added instances take work after
        ``config.startup_s``; removed ones are the starting ones first, then the
        least loaded, which drain (finish what they hold) before their GPUs go."""
        for role, n in ((Role.PREFILL, prefill), (Role.DECODE, decode), (Role.BOTH, both)):
            if n is None:
                continue
            if role not in self.instances:
                raise ConfigError(f"this simulation ({self.config.mode}) has no {role} pool")
            if n < 0:
                raise ConfigError(f"replicas of {role} must be >= 0")
            self._resize(role, n)

    def switch(self, from_role: Role, to_role: Role, switch_s: float) -> bool:
        """A switchable worker changes role: the least loaded active instance of
        ``from_role`` stops taking work and finishes what it holds, and its GPU serves
        ``to_role`` after ``switch_s`` (the drain bound; the weights stay loaded, so no
        cold start). False when ``from_role`` has no active instance to give.

        The old instance's GPU is held until its work is done and the new one's from the
        switch on: a drain that outlasts ``switch_s`` counts that GPU twice, as the worker
        serves both for that while (its last streams and its new role)."""
        if from_role not in self.instances or to_role not in self.instances:
            raise ConfigError(f"this simulation ({self.config.mode}) cannot switch "
                              f"{from_role} to {to_role}")  # fmt: skip
        active = sorted(
            (i for i in self.instances[from_role] if i.state is State.ACTIVE), key=_idle_score
        )
        if not active:
            return False
        donor = active[0]
        donor.state = State.DRAINING
        if not donor.has_work():
            self._retire(donor)
        inst = self.add(to_role, State.STARTING if switch_s > 0 else State.ACTIVE, switch_s)
        if inst.state is State.ACTIVE:
            self.dispatch(to_role)
        return True

    def replicas(self, role: Role) -> int:
        """Instances of ``role`` that are active or starting (what was last asked for)."""
        return sum(1 for i in self.instances[role] if i.state in (State.ACTIVE, State.STARTING))

    def add(self, role: Role, state: State, startup_s: float | None = None) -> Instance:
        """A new instance of ``role``; a starting one takes work after ``startup_s``
        (the config's cold start unless given)."""
        cfg = self.config
        pool = cfg.pools[role]
        iid = self._ids
        self._ids += 1
        inst: Instance
        host, now, block = self.host, self.host.now, self.block_tokens
        blocks = pool.kv_capacity_tokens // block if cfg.prefix_caching else 0
        if role is Role.DECODE and cfg.local_prefill is None:
            inst = DecodeInstance(host, cfg, iid, pool, now, state)
        elif role is Role.PREFILL:
            inst = PrefillInstance(host, cfg, iid, pool, now, state, PrefixCache(blocks, block))
        else:
            cache = PrefixCache(blocks, block)
            inst = ColocatedInstance(host, cfg, iid, pool, now, state, cache, role)
        self.instances[role].append(inst)
        if state is State.STARTING:
            delay = cfg.startup_s if startup_s is None else startup_s
            host.schedule(now + delay, self._ready, inst)
        return inst

    def _ready(self, inst: Instance) -> None:
        if inst.state is State.STARTING:
            inst.state = State.ACTIVE
            self.dispatch(inst.role)

    def _resize(self, role: Role, n: int) -> None:
        pool = self.instances[role]
        live = [i for i in pool if i.state in (State.ACTIVE, State.STARTING)]
        if n > len(live):
            need = n - len(live)
            for inst in [i for i in pool if i.state is State.DRAINING][:need]:
                inst.state = State.ACTIVE
                need -= 1
            for _ in range(need):
                self.add(role, State.STARTING if self.config.startup_s > 0 else State.ACTIVE)
            self.dispatch(role)
        elif n < len(live):
            excess = len(live) - n
            starting = [i for i in reversed(live) if i.state is State.STARTING]
            for inst in starting[:excess]:
                self._retire(inst)
                excess -= 1
            active = sorted((i for i in live if i.state is State.ACTIVE), key=_idle_score)
            for inst in active[:excess]:
                inst.state = State.DRAINING
                if not inst.has_work():
                    self._retire(inst)

    def _retire(self, inst: Instance) -> None:
        now = self.host.now
        inst.state = State.GONE
        inst.removed_at = now
        self._gone_gpu_seconds += inst.pool.tp * (now - inst.created_at)
        if isinstance(inst, SpanInstance):
            self._gone_tokens += inst.batch.tokens_out
        self.instances[inst.role].remove(inst)

    def idle(self, inst: Instance) -> None:
        """An instance ran out of work."""
        if inst.state is State.DRAINING:
            self._retire(inst)

    def gpus(self) -> int:
        return sum(
            i.pool.tp for p in self.instances.values() for i in p if i.state is not State.GONE
        )

    def gpu_seconds(self) -> float:
        """GPU-seconds held so far (every instance from its adding to its going)."""
        now = self.host.now
        live = sum(
            i.pool.tp * (now - i.created_at)
            for p in self.instances.values()
            for i in p
            if i.state is not State.GONE
        )
        return self._gone_gpu_seconds + live

    def decode_tokens(self) -> int:
        """Tokens decoded so far (after the first of each request), gone instances too."""
        n = 0
        for p in self.instances.values():
            for i in p:
                if isinstance(i, SpanInstance):
                    n += i.batch.tokens_out
        return n + self._gone_tokens

    def busy_seconds(self) -> dict[int, float]:
        """Seconds each instance (by id) has computed so far."""
        return {i.iid: i.busy_s for p in self.instances.values() for i in p}


def _idle_score(inst: Instance) -> float:
    if isinstance(inst, DecodeInstance):
        return inst.batch.reserved + inst.waiting_tokens
    if isinstance(inst, ColocatedInstance):
        return inst.batch.reserved + inst.queued_tokens
    assert isinstance(inst, PrefillInstance)
    return inst.queued_tokens + inst.running_tokens

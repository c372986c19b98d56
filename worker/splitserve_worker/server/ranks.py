"""A tensor-parallel engine: rank 0's :class:`~splitserve_worker.engine.engine.Engine` over
its shard, with ranks ``1..N-1`` started as processes of this one
(:mod:`splitserve_worker.parallel.launch`) and joined into one group."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from splitserve.metric_registry import Metrics

from splitserve_worker.engine.config import EngineConfig
from splitserve_worker.engine.engine import Engine
from splitserve_worker.models import pick_device, resolve_model
from splitserve_worker.parallel.launch import RankProcesses, RankSpec, rank_device
from splitserve_worker.parallel.sharded_load import layout_of, load_sharded


@dataclass
class RankedEngine:
    engine: Engine
    ranks: RankProcesses

    def close(self) -> None:
        """Stop the other ranks (the engine thread must be done: no step runs now)."""
        self.engine.close()
        self.ranks.stop()


def start_ranked_engine(
    model: str,
    world: int,
    config: EngineConfig,
    metrics: Metrics | None = None,
    *,
    allreduce: str = "auto",
    env: dict[str, str] | None = None,
    serve: Any = None,
) -> RankedEngine:
    """Start ranks ``1..world-1``, load rank 0's shard, join them and build the engine.
    Whatever fails on the way stops the ranks already started. ``serve``: what the other
    ranks serve besides forwards (:class:`~.rank_kv.RankKVSpec`: their KV ports)."""
    from transformers import AutoConfig

    # a model that cannot be split so is refused before any rank starts
    layout_of(AutoConfig.from_pretrained(str(resolve_model(model))), world, 0)
    device = pick_device(config.device)
    spec = RankSpec(model=model, dtype=config.dtype, device=device, allreduce=allreduce,
                    engine=dataclasses.asdict(config), serve=serve)  # fmt: skip
    ranks = RankProcesses(world, spec, env=env)
    try:
        dev = str(rank_device(device, 0))
        loaded = load_sharded(model, world, 0, config.dtype, dev)
        layout = layout_of(loaded.config, world, 0)
        group = ranks.group()
        ranks.on_lost(group.abort)
        cfg: Any = dataclasses.replace(config, device=dev)
        engine = Engine(loaded, cfg, metrics, group=group, layout=layout)
    except BaseException:
        ranks.stop(0.0)
        raise
    return RankedEngine(engine, ranks)

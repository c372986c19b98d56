"""One rank's forward machinery: the KV pool sized for its heads, the attention backend
over it and the model runner, built the same way for the engine (rank 0) and for the
other tensor-parallel ranks (:mod:`.follower`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from splitserve_worker.engine import identity
from splitserve_worker.engine.attention.registry import select
from splitserve_worker.engine.config import EngineConfig
from splitserve_worker.engine.kv_cache import KVCache, bytes_per_block
from splitserve_worker.engine.model_runner import (
    ModelRunner,
    attention_scale,
    attention_shape,
    model_shape,
    rank_shape,
)
from splitserve_worker.parallel.collectives import RankGroup
from splitserve_worker.parallel.layout import TPLayout


@dataclass
class ForwardStack:
    kv: KVCache
    runner: ModelRunner
    attention_why: str
    static: bool
    """Whether decode steps run from static buffers (CUDA graphs on CUDA)."""


def build_forward(
    model: Any,
    config: EngineConfig,
    dtype: torch.dtype,
    device: torch.device,
    group: RankGroup | None = None,
    layout: TPLayout | None = None,
) -> ForwardStack:
    """The pool, attention and runner of ``model`` (one rank's shard with ``group``: every
    rank of the group calls this at the same point, as the pool size is agreed on: the
    fewest blocks any rank can hold)."""
    shape = rank_shape(model_shape(model.config), layout)
    per_block = bytes_per_block(
        shape.num_layers, config.block_size, shape.num_kv_heads, shape.head_dim, dtype
    )
    num_blocks = config.num_blocks or max(1, identity.kv_budget_bytes(config, device) // per_block)
    if group is not None:
        num_blocks = group.min_int(num_blocks)
    # decode graphs would need the all-reduces inside them: tensor-parallel steps run eagerly
    graphs = device.type == "cuda" and config.cuda_graphs
    static = group is None and (config.static_decode or graphs)
    kv = KVCache(
        num_layers=shape.num_layers,
        num_blocks=num_blocks,
        block_size=config.block_size,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        dtype=dtype,
        device=device,
        max_events=config.max_events,
        scratch_blocks=1 if static else 0,
    )
    ashape = attention_shape(shape, kv, attention_scale(model))
    selected = select(config.attention_backend, ashape, config.max_num_seqs, kv.layer_blocks(0))
    runner = ModelRunner(model, kv, selected.backend, prepack=config.cpu_prepack, group=group,
                         layout=layout)  # fmt: skip
    return ForwardStack(kv, runner, selected.why, static)

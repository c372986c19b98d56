"""What an engine is (its compatibility identity) and how big it may get (pool, lengths)."""

from __future__ import annotations

from typing import Any

import torch

from splitserve_worker.engine.config import DEFAULT_CPU_KV_BYTES, EngineConfig
from splitserve_worker.engine.kv_cache import KV_LAYOUT
from splitserve_worker.engine.model_runner import ModelShape
from splitserve_worker.models import context_limit


def kv_budget_bytes(config: EngineConfig, device: torch.device) -> int:
    """Bytes for the KV pool: the configured budget, a fraction of free GPU memory, or the
    CPU default."""
    if config.kv_cache_memory is not None:
        return config.kv_cache_memory
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * config.gpu_memory_fraction)
    return DEFAULT_CPU_KV_BYTES


def max_model_len(model_config: Any, configured: int | None) -> int:
    """Longest sequence served: the model's (:func:`~splitserve_worker.models.context_limit`)
    and the configured cap."""
    limit = context_limit(model_config)
    return limit if configured is None else min(limit, configured)


def eos_ids(model: Any) -> set[int]:
    """EOS ids from the generation config and the model config."""
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config):
        e = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(e, int):
            ids.add(e)
        elif isinstance(e, (list, tuple)):
            ids.update(int(x) for x in e)
    return ids


def compat_info(
    name: str, model: Any, shape: ModelShape, dtype: torch.dtype, block_size: int
) -> dict[str, Any]:
    """Everything two engines must share for K/V to move between them: the contract's
    :data:`~splitserve.kv_compat.FIELDS` and :data:`~splitserve.kv_compat.IDENTITY_FIELDS`."""
    cfg = model.config
    return {
        "model": name,
        "architecture": (getattr(cfg, "architectures", None) or [type(model).__name__])[0],
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "dtype": str(dtype).removeprefix("torch."),
        "block_size": block_size,
        "num_layers": shape.num_layers,
        "kv_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "kv_layout": KV_LAYOUT,
    }

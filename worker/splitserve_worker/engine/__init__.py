"""The worker engine: paged KV cache, continuous batching, chunked and layer-wise prefill.

Public surface: :class:`Engine` (synchronous core), :class:`AsyncEngine` (asyncio
wrapper on one engine thread), :class:`EngineConfig`,
:class:`RequestOutput`, :class:`PrefillResult` and the errors. A request's sampling
parameters are the contract's :class:`splitserve.sampling.SamplingParams`, and cached
blocks are named by the contract's :mod:`splitserve.prefix_hash`.

Names are imported on first use, so ``splitserve_worker.engine.prefix_cache`` (pure
Python) can be imported without loading torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "AsyncEngine": "async_engine",
    "Engine": "engine",
    "EngineConfig": "config",
    "EventKind": "prefix_cache",
    "FinishReason": "sequence",
    "KVCache": "kv_cache",
    "KVCacheEvent": "prefix_cache",
    "KV_LAYOUT": "kv_cache",
    "NoCapacity": "errors",
    "PrefillResult": "sequence",
    "RequestError": "errors",
    "RequestOutput": "sequence",
    "UnknownRequest": "errors",
}

__all__ = [
    "KV_LAYOUT",
    "AsyncEngine",
    "Engine",
    "EngineConfig",
    "EventKind",
    "FinishReason",
    "KVCache",
    "KVCacheEvent",
    "NoCapacity",
    "PrefillResult",
    "RequestError",
    "RequestOutput",
    "UnknownRequest",
]

if TYPE_CHECKING:
    from splitserve_worker.engine.async_engine import AsyncEngine
    from splitserve_worker.engine.config import EngineConfig
    from splitserve_worker.engine.engine import Engine
    from splitserve_worker.engine.errors import NoCapacity, RequestError, UnknownRequest
    from splitserve_worker.engine.kv_cache import KV_LAYOUT, KVCache
    from splitserve_worker.engine.prefix_cache import EventKind, KVCacheEvent
    from splitserve_worker.engine.sequence import FinishReason, PrefillResult, RequestOutput


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value

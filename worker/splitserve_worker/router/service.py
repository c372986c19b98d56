"""The router's parts wired together: discovery, pool, planner, dispatcher, tokenizer."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry
from splitserve.metric_registry import Metrics
from splitserve.prefix_hash import block_hashes

from splitserve_worker.client import WorkerClient
from splitserve_worker.router.config import RouterConfig
from splitserve_worker.router.discovery import Discovery, WorkerEndpoint
from splitserve_worker.router.dispatch import Dispatcher, Hasher
from splitserve_worker.router.planner import RoutePlanner
from splitserve_worker.router.pool import ConnFactory, WorkerPool
from splitserve_worker.router.tokenizer_pool import TokenizerPool


def prefix_hasher(block_size: int) -> Hasher:
    """The contract's chained block hash, so the router's hashes match the workers'."""

    def hasher(tokens: Sequence[int]) -> list[int]:
        return block_hashes(tokens, block_size)

    return hasher


@dataclass
class RouterService:
    config: RouterConfig
    tokenizer: Any
    discovery: Discovery
    connect: ConnFactory | None = None
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        self.metrics = Metrics(self.registry)
        cfg = self.config
        self.tokenizing = TokenizerPool(
            self.tokenizer, cfg.max_model_len, threads=cfg.tokenizer_threads
        )
        self.planner = RoutePlanner(cfg)
        token, tls = cfg.worker_token, cfg.tls

        def default_connect(ep: WorkerEndpoint) -> WorkerClient:
            return WorkerClient(ep.address, token, tls=tls)

        self.pool = WorkerPool(
            self.connect or default_connect,
            self.planner.index,
            health_interval_s=cfg.timeouts.health_interval_s,
            health_timeout_s=cfg.timeouts.connect_s,
            on_change=self._on_change,
            drain_s=cfg.timeouts.drain_s,
        )
        self.dispatcher = Dispatcher(
            cfg, self.pool, self.planner, prefix_hasher(cfg.block_size), self.metrics
        )
        self._follow: asyncio.Task[None] | None = None
        est = self.planner.estimator
        self.pool.on_compat = lambda c: est.observe_compat(
            c.num_layers, c.kv_heads, c.head_dim, c.dtype
        )

    def _on_change(self) -> None:
        self.dispatcher.update_capacity()

    async def start(self) -> None:
        self._follow = asyncio.create_task(self.pool.follow(self.discovery), name="discovery")

    async def stop(self) -> None:
        if self._follow is not None:
            self._follow.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._follow
        await self.dispatcher.drain()
        await self.pool.close()
        self.tokenizing.close()

    async def wait_ready(self, timeout: float) -> bool:
        """True once a decode-capable worker answers Health (bounded by ``timeout``)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            if self.dispatcher.decode_stage.capacity > 0:
                return True
            await asyncio.sleep(0.05)
        return False

"""In-memory workers for the router's tests: they follow the ``WorkerConn`` protocol, their
"model" is a pure function of the sequence so far (so a migrated request must continue
exactly), they build each call's messages as the real client does (a value the wire cannot
carry fails as it would), and they fail, stall or restart on request. ``make`` puts a
dispatcher over a pool of them.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
from splitserve.metric_registry import Metrics
from splitserve.roles import Role
from splitserve.sampling import SamplingParams
from splitserve.v1 import worker_pb2 as pb
from splitserve_worker.client import sampling_to_proto
from splitserve_worker.router.config import RouterConfig, TimeoutConfig
from splitserve_worker.router.discovery import StaticDiscovery, WorkerEndpoint
from splitserve_worker.router.dispatch import Dispatcher, GenRequest
from splitserve_worker.router.planner import RoutePlanner
from splitserve_worker.router.pool import WorkerPool
from splitserve_worker.router.service import RouterService

ROLES = {"prefill": pb.ROLE_PREFILL, "decode": pb.ROLE_DECODE, "both": pb.ROLE_BOTH}


def next_token(seq: Sequence[int]) -> int:
    return (sum(seq) * 31 + len(seq)) % 97


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details, None)


class MemWorker:
    """A worker in memory: fails on request, records what it was asked."""

    def __init__(self, name: str, role: str) -> None:
        self.address = name
        self.role = role
        self.fail_prefill: grpc.StatusCode | None = None
        self.fail_generate_after: int | None = None  # tokens before the stream breaks
        self.fail_code = grpc.StatusCode.UNAVAILABLE
        self.fail_health = False
        self.prefill_gate: asyncio.Event | None = None  # prefill waits for it when set
        self.cancelled: list[str] = []
        self.reserved: list[str] = []
        self.leases: list[float] = []  # each Reserve's lease_seconds, in order
        self.generated: list[tuple[str, tuple[int, ...], int]] = []
        self.generate_sampling: list[SamplingParams] = []  # each generate call's, in order
        self.expect_remote: list[bool] = []  # each generate call's expect_remote_kv
        self.prefilled: list[str] = []
        self.instance = uuid.uuid4().hex
        self.stall: asyncio.Event | None = None  # generate waits for it before each token
        self.streams_open = 0
        self.streams_closed: list[str] = []
        self.restart_after_failing = False
        self.tokens_out = 0  # tokens its streams have yielded, all together
        self.fail_prefill_with: BaseException | None = None  # raised as it is, by prefill
        self.total_blocks = 100
        self.recomputed: list[bool] = []  # per generate call: asked to recompute its prompt
        self.diverge_remote = False  # a stream on pushed KV yields other tokens (corrupt KV)

    def restart(self) -> None:
        """A new process at the same address: another instance, failing nothing."""
        self.instance = uuid.uuid4().hex
        self.fail_prefill = None
        self.fail_generate_after = None
        self.fail_health = False

    async def health(self, timeout: float) -> pb.HealthResponse:
        if self.fail_health:
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "no answer")
        return pb.HealthResponse(
            role=ROLES[self.role],
            free_blocks=self.total_blocks,
            total_blocks=self.total_blocks,
            compat=pb.CompatInfo(hash="h", num_layers=2, kv_heads=1, head_dim=4, dtype="float32"),
            instance_id=self.instance,
        )

    async def events(self) -> AsyncIterator[pb.KVEvent]:
        await asyncio.Event().wait()
        yield pb.KVEvent()

    async def reserve(
        self,
        request_id: str,
        n: int,
        compat: Any = None,
        lease_seconds: float = 0.0,
        kv_backend: str = "",
        timeout: float | None = None,
    ) -> pb.TransferHandle:
        self.reserved.append(request_id)
        self.leases.append(lease_seconds)
        return pb.TransferHandle(request_id=request_id, decode_address=self.address)

    async def prefill(
        self,
        request_id: str,
        prompt: Sequence[int],
        sampling: SamplingParams,
        handle: Any,
        timeout: float,
    ) -> pb.PrefillResponse:
        sampling_to_proto(sampling)  # as the client builds the call
        self.prefilled.append(request_id)
        if self.prefill_gate is not None:
            await self.prefill_gate.wait()
        if self.fail_prefill_with is not None:
            raise self.fail_prefill_with
        if self.fail_prefill is not None:
            raise rpc_error(self.fail_prefill, "prefill broke")
        return pb.PrefillResponse(request_id=request_id, first_token=next_token(prompt))

    async def generate(
        self,
        request_id: str,
        prompt: Sequence[int],
        sampling: SamplingParams,
        expect_remote_kv: bool,
        timeout: float,
        recompute_prompt: bool = False,
    ) -> AsyncIterator[pb.TokenChunk]:
        sampling_to_proto(sampling)  # as the client builds the call
        self.generated.append((request_id, tuple(prompt), sampling.max_tokens))
        self.generate_sampling.append(sampling)
        self.expect_remote.append(expect_remote_kv)
        self.recomputed.append(recompute_prompt)
        seq = list(prompt)
        self.streams_open += 1
        try:
            for i in range(sampling.max_tokens):
                if self.fail_generate_after is not None and i >= self.fail_generate_after:
                    if self.restart_after_failing:
                        self.restart()
                    raise rpc_error(self.fail_code, "stream broke")
                if self.stall is not None:
                    await self.stall.wait()
                wrong = expect_remote_kv and self.diverge_remote and i == 0
                seq.append(next_token(seq) + (1 if wrong else 0))
                self.tokens_out += 1
                last = i == sampling.max_tokens - 1
                yield pb.TokenChunk(
                    request_id=request_id,
                    token_ids=[seq[-1]],
                    finish_reason="length" if last else "",
                )
                await asyncio.sleep(0)
        finally:
            self.streams_open -= 1
            self.streams_closed.append(request_id)

    async def cancel(self, request_id: str, timeout: float) -> bool:
        self.cancelled.append(request_id)
        return True

    async def close(self, grace: float | None = None) -> None:
        return None


async def make(workers: list[MemWorker], health_interval_s: float = 60.0, **cfg: Any) -> Dispatcher:
    """A dispatcher over ``workers``, once each has answered Health (polled every
    ``health_interval_s``)."""
    config = RouterConfig(timeouts=TimeoutConfig(health_interval_s=health_interval_s), **cfg)
    planner = RoutePlanner(config)
    by_name = {w.address: w for w in workers}
    pool = WorkerPool(
        lambda ep: by_name[ep.name], planner.index, health_interval_s=health_interval_s
    )
    d = Dispatcher(config, pool, planner, lambda toks: [], Metrics())
    pool._on_change = d.update_capacity
    pool.set_endpoints([WorkerEndpoint(w.address, Role(w.role), w.address) for w in workers])
    for _ in range(100):
        if all(v.healthy for v in pool.snapshot()):
            break
        await asyncio.sleep(0.01)
    return d


async def run(
    d: Dispatcher, prompt: list[int], n: int, sampling: SamplingParams | None = None
) -> list[int]:
    sp = SamplingParams(max_tokens=n) if sampling is None else sampling
    out: list[int] = []
    async for ev in d.generate(GenRequest("r", tuple(prompt), sp)):
        out += ev.token_ids
    await d.drain()
    return out


def expected(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt) :]


async def collect(gen: AsyncIterator[Any]) -> list[int]:
    out: list[int] = []
    async for ev in gen:
        out += ev.token_ids
    return out


def mem_router(workers: list[MemWorker], tokenizer: Any, **cfg: Any) -> RouterService:
    """A whole router (its app: ``create_app(service)``) over ``workers``, which it polls
    every 50 ms, serving the model ``tiny``."""
    config = RouterConfig(model_name="tiny", timeouts=TimeoutConfig(health_interval_s=0.05), **cfg)
    by_name = {w.address: w for w in workers}
    eps = [WorkerEndpoint(w.address, Role(w.role), w.address) for w in workers]
    return RouterService(
        config, tokenizer, StaticDiscovery(eps), connect=lambda ep: by_name[ep.name]
    )

"""The prefill side of the KV handoff: run the prompt, push each layer, Commit.

The engine calls the sender's ``send_layer`` on its own thread as each layer finishes;
the push runs on the transport's thread meanwhile. Whatever happens, the prefill
engine's blocks are freed by ``prefill_export`` itself (kept only as prefix cache), so
a failed push leaves nothing held here; the decode worker is told to Release.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from typing import Any

import grpc
from splitserve import kv_compat as compat_mod
from splitserve import metric_names as names
from splitserve.kv_compat import CompatError
from splitserve.metric_registry import Metrics
from splitserve.sampling import SamplingParams
from splitserve.v1 import worker_pb2 as pb

from splitserve_worker.client import WorkerClients
from splitserve_worker.kv.head_split import open_split
from splitserve_worker.kv.transport import (
    BackendContext,
    KVSender,
    SenderBackend,
    TransferError,
    create_sender_backend,
)
from splitserve_worker.server.convert import (
    compat_from_proto,
    prompt_logprobs_to_proto,
    target_from_handle,
    top_to_proto,
)
from splitserve_worker.server.errors import RpcFailure
from splitserve_worker.server.rank_push import PushOrder, RankPushes

log = logging.getLogger(__name__)

COMMIT_TIMEOUT_S = 60.0
"""How long the decode worker may take to check the pushed layers and admit the request."""
RELEASE_TIMEOUT_S = 5.0
"""Release after a failed prefill is best effort: the decode worker's lease frees the
blocks anyway."""


class PrefillRunner:
    def __init__(
        self,
        engine: Any,
        ctx: BackendContext,
        *,
        transfer_timeout_s: float,
        metrics: Metrics,
        ranks: RankPushes | None = None,
    ) -> None:
        """``ranks``: this worker's other tensor-parallel ranks, which push their own KV
        heads when the decode worker's ranks can take them so (:mod:`.rank_push`)."""
        self.engine = engine
        self.ranks = ranks
        self.ctx = ctx
        self.transfer_timeout_s = transfer_timeout_s
        self._senders: dict[str, SenderBackend] = {}
        self._senders_lock = threading.Lock()
        self._decode_workers = WorkerClients(ctx.token, tls=ctx.tls)
        """Clients of the decode workers this one pushes to (Commit, Release), by address."""
        self._bytes = metrics.counter(names.KV_TRANSFER_BYTES)
        self._duration = metrics.histogram(names.KV_TRANSFER_DURATION)
        self._failures = metrics.counter(names.KV_TRANSFER_FAILURES)
        self.in_progress = 0
        """Prefill calls between their checks and their end (compute, push and Commit)."""
        self._releasing: set[asyncio.Task[None]] = set()

    def sender_backend(self, name: str) -> SenderBackend:
        with self._senders_lock:
            backend = self._senders.get(name)
            if backend is None:
                backend = create_sender_backend(name, self.ctx)
                self._senders[name] = backend
            return backend

    async def close(self) -> None:
        for task in list(self._releasing):  # best effort only: leases expire anyway
            task.cancel()
        await asyncio.gather(*self._releasing, return_exceptions=True)
        await self._decode_workers.close()
        for backend in self._senders.values():
            backend.close()

    async def run(self, req: pb.PrefillRequest, sampling: SamplingParams) -> pb.PrefillResponse:
        handle = req.handle
        if handle.request_id and handle.request_id != req.request_id:
            raise RpcFailure(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the handle is for request {handle.request_id!r}, not {req.request_id!r}",
            )
        try:
            compat_mod.check(
                self.ctx.compat, compat_from_proto(handle.compat), peer=handle.decode_address
            )
        except CompatError as e:
            self._release_soon(handle, "incompatible KV caches")
            raise RpcFailure(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from None
        if handle.num_prompt_tokens != len(req.prompt_token_ids):
            raise RpcFailure(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the handle reserves {handle.num_prompt_tokens} tokens, the prompt has "
                f"{len(req.prompt_token_ids)}",
            )
        self.in_progress += 1
        try:
            return await self._run(req, sampling, handle)
        finally:
            self.in_progress -= 1

    async def _run(
        self, req: pb.PrefillRequest, sampling: SamplingParams, handle: pb.TransferHandle
    ) -> pb.PrefillResponse:
        from splitserve_worker.engine.errors import NoCapacity, RequestError

        backend_name = handle.kv_backend or "grpc"
        try:
            backend = await asyncio.to_thread(self.sender_backend, backend_name)
            target = target_from_handle(handle)
            heads = self.ctx.compat.kv_heads
            own, push = range(heads), None  # every head: rank 0 gathers whole layers
            if self.ranks is not None and self.ranks.direct(target, backend_name):
                own, push = self.ranks.own, PushOrder(target, backend_name)
            sender: KVSender = await asyncio.to_thread(open_split, backend, target, own, heads)
        except (TransferError, ValueError, ImportError) as e:
            self._release_soon(handle, "prefill failed to open the push")
            raise RpcFailure(grpc.StatusCode.UNAVAILABLE, f"cannot push KV: {e}") from None

        holds = self.ctx.faults.holds

        def send_layer(layer: int, k: Any, v: Any, start_token: int) -> None:
            sender.send_layer(layer, k, v, start_token)
            if layer == 0:
                holds.wait("push")

        t0 = time.monotonic()
        try:
            result = await self.engine.prefill_export(
                req.request_id,
                list(req.prompt_token_ids),
                sampling,
                send_layer if holds.directory else sender.send_layer,
                push,
            )
        except BaseException as e:
            sender.abort(f"prefill failed: {e!r}")
            self._release_soon(handle, "prefill failed")
            if push is not None:
                self._forget_rank_answers(handle.lease_id)
            if isinstance(e, NoCapacity):
                raise RpcFailure(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
            if isinstance(e, RequestError):
                raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
            raise
        t_compute = time.monotonic()
        ranks_heard = push is None
        try:
            stats = await asyncio.to_thread(sender.finish, self.transfer_timeout_s)
            if push is not None and self.ranks is not None:  # and every other rank's push
                why = await asyncio.to_thread(
                    self.ranks.wait_sent, handle.lease_id, self.transfer_timeout_s
                )
                ranks_heard = True
                if why is not None:
                    raise TransferError(why, "rank")
        except TransferError as e:
            self._failures.labels(backend_name, e.reason).inc()
            self._release_soon(handle, f"push failed: {e.reason}")
            if not ranks_heard:
                self._forget_rank_answers(handle.lease_id)
            raise RpcFailure(grpc.StatusCode.UNAVAILABLE, f"KV push failed: {e}") from None
        self._bytes.labels(backend_name, "sent").inc(stats.bytes_sent)
        transfer_s = max(0.0, stats.done - (stats.first_send or t0))
        self._duration.labels(backend_name).observe(transfer_s)

        scores = result.prompt_logprobs
        try:
            await self._decode_workers.get(handle.decode_address).commit(
                req.request_id,
                handle.lease_id,
                result.first_token,
                first_token_logprob=result.first_logprob or 0.0,
                layers_sent=stats.layers_sent,
                layer_crc32=stats.layer_crc32,
                first_top_logprobs=top_to_proto(result.first_top_logprobs),
                prompt_logprobs=None if scores is None else prompt_logprobs_to_proto(scores),
                timeout=COMMIT_TIMEOUT_S,
            )
        except grpc.aio.AioRpcError as e:
            self._failures.labels(backend_name, "commit").inc()
            code = e.code()
            if code not in (grpc.StatusCode.DATA_LOSS, grpc.StatusCode.NOT_FOUND):
                code = grpc.StatusCode.UNAVAILABLE
            raise RpcFailure(code, f"the decode worker refused Commit: {e.details()}") from None
        return pb.PrefillResponse(
            request_id=req.request_id,
            first_token=result.first_token,
            first_token_logprob=result.first_logprob or 0.0,
            prefill_seconds=t_compute - t0,
            transfer_seconds=transfer_s,
            exposed_transfer_seconds=max(0.0, stats.done - t_compute),
            bytes_sent=stats.bytes_sent,
            num_cached_tokens=result.num_cached_tokens,
        )

    def _forget_rank_answers(self, lease_id: str) -> None:
        """A failed prefill whose ranks each pushed: their answers are still taken (off
        the loop, once they come or the push's time is up), so none stays in the store."""
        ranks = self.ranks
        if ranks is None:
            return
        args = (lease_id, self.transfer_timeout_s)
        name = f"splitserve-rank-answers-{lease_id}"
        threading.Thread(target=ranks.wait_sent, args=args, daemon=True, name=name).start()

    def _release_soon(self, handle: pb.TransferHandle, reason: str) -> None:
        """Release on the decode worker in the background: the failed Prefill answers at
        once, not after a hung decode worker's Release times out (its lease and the
        router's cleanup free the blocks anyway)."""
        task = asyncio.ensure_future(self._release_remote(handle, reason))
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def _release_remote(self, handle: pb.TransferHandle, reason: str) -> None:
        """Best effort: the decode worker's lease frees the blocks anyway."""
        if not handle.decode_address:
            return
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.TimeoutError):
            await self._decode_workers.get(handle.decode_address).release(
                handle.request_id, reason, timeout=RELEASE_TIMEOUT_S
            )

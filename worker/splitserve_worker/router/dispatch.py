"""Running one request on the workers: the KV handoff, retries and migration.

For each attempt the planner picks a decode worker and, when disaggregating, a
prefill worker. Remote: Reserve on the decode worker, open its Generate stream
(it starts once the KV is committed), Prefill on the prefill worker (which
pushes the KV and commits). Local: Generate on the decode worker alone.

Failures: a failed prefill retries on another prefill worker; a decode worker
lost before the first token retries on another; one lost mid-stream migrates
(prompt plus the tokens so far, prefilled elsewhere). A worker that refuses or ends
an attempt because it is switching its role is marked as such at once, and the
request goes on elsewhere the same way, not counted as a failure. After ``max_retries``
the request ends with :class:`RequestFailed`. However an attempt ends, a
cleanup task cancels it on every worker it touched, so no KV stays held.

A remote attempt waits for a prefill slot before it touches any worker. When it
had to wait, it is planned again once the slot is its own, from the load and health
of the workers then: a burst queued for prefill spreads over the prefill workers as
they free up instead of staying on the ones picked when it arrived, and no request
is sent to a worker that went down meanwhile (a re-plan that finds no worker plans
again from the top, without counting as a failure).
A prefill that fails is blamed on the worker that does not answer Health; when
both answer, neither is marked unhealthy (a lease that ran out under load).

A request first planned remote that finishes prefilled locally (planned again when its
slot came, or retried) is counted (``splitserve_planned_remote_ran_local_total``): with
the KV bytes the workers move, it shows disaggregation silently turned off. A greedy
request that ran disaggregated in one attempt is offered to the correctness guard
(:mod:`.guard`), which may re-run it in a task of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import grpc
from splitserve.metric_names import (
    DECODE_QUEUE,
    DISAGG_DECISIONS,
    PLANNED_REMOTE_RAN_LOCAL,
    PREFILL_QUEUE,
    ROUTER_RETRIES,
)
from splitserve.metric_registry import Metrics
from splitserve.roles import DECODE_ROLES, PREFILL_ROLES
from splitserve.sampling import SamplingParams

from splitserve_worker.client import top_from_proto
from splitserve_worker.router.config import RouterConfig
from splitserve_worker.router.failures import (
    LOST_CODES,
    UNSENDABLE,
    AttemptFailed,
    RequestFailed,
    Stale,
    WorkerSwitching,
    rpc_code,
    rpc_details,
    switching,
    unsendable,
)
from splitserve_worker.router.guard import Check, CorrectnessGuard
from splitserve_worker.router.planner import NoWorker, Plan, RoutePlanner
from splitserve_worker.router.pool import WorkerPool
from splitserve_worker.router.queues import Admission, Stage
from splitserve_worker.router.scoring import WorkerView
from splitserve_worker.router.worker_conn import PromptScores, WorkerConn

log = logging.getLogger(__name__)

Hasher = Callable[[Sequence[int]], list[int]]


@dataclass(frozen=True)
class GenRequest:
    request_id: str
    prompt: tuple[int, ...]
    sampling: SamplingParams


@dataclass
class Ran:
    """Where an attempt ran, as it finally did (a waited-for prefill slot may re-plan it)."""

    plan: Plan


@dataclass(frozen=True)
class TokenEvent:
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str | None
    num_cached_tokens: int = 0
    top_logprobs: tuple[list[tuple[int, float]], ...] = ()
    """Per token, when asked for: the most likely tokens there, with their logprobs."""
    prompt_logprobs: PromptScores | None = None
    """With the first token, when asked for."""


ATTEMPT_BUFFER = 64
"""Token chunks read ahead from a worker's stream for one attempt; past that the stream
waits (gRPC's flow control holds the worker's sends) until the request takes them."""

MAX_REPLANS = 8
"""Most times one request is planned again from the top because no worker fitted it
when its prefill slot came (see :class:`~splitserve_worker.router.failures.Stale`)."""

MAX_SWITCH_MOVES = 32
"""Most times one request is planned elsewhere because a worker it was on switched its
role (see :class:`~splitserve_worker.router.failures.WorkerSwitching`)."""


class Dispatcher:
    def __init__(
        self,
        config: RouterConfig,
        pool: WorkerPool,
        planner: RoutePlanner,
        hasher: Hasher,
        metrics: Metrics,
    ) -> None:
        self.config = config
        self.pool = pool
        self.planner = planner
        self.hasher = hasher
        self.metrics = metrics
        q = config.queues
        pq = metrics.gauge(PREFILL_QUEUE)
        dq = metrics.gauge(DECODE_QUEUE)
        self.prefill_stage = Stage("prefill", 0, q.prefill_max_waiting, q.max_wait_s,
                                   q.retry_after_s, pq.set)  # fmt: skip
        self.decode_stage = Stage("decode", 0, q.decode_max_waiting, q.max_wait_s,
                                  q.retry_after_s, dq.set)  # fmt: skip
        self._decisions = metrics.counter(DISAGG_DECISIONS)
        self._retries = metrics.counter(ROUTER_RETRIES)
        self._remote_ran_local = metrics.counter(PLANNED_REMOTE_RAN_LOCAL)
        self._cleanup: set[asyncio.Task[None]] = set()
        self.guard = CorrectnessGuard(config.guard, pool.conn, metrics, config.timeouts.request_s)

    def update_capacity(self) -> None:
        q = self.config.queues
        self.prefill_stage.set_capacity(
            self.pool.count(lambda r: r in PREFILL_ROLES) * q.prefill_slots_per_worker
        )
        self.decode_stage.set_capacity(
            self.pool.count(lambda r: r in DECODE_ROLES) * q.decode_slots_per_worker
        )

    async def drain(self, timeout: float = 5.0) -> None:
        """Waits for pending cleanup calls and guard re-runs (used on shutdown and by
        tests)."""
        if self._cleanup:
            await asyncio.wait(set(self._cleanup), timeout=timeout)
        await self.guard.drain(timeout)

    # ---- one request ----

    async def generate(
        self, req: GenRequest, admission: Admission | None = None
    ) -> AsyncGenerator[TokenEvent, None]:
        """Tokens of ``req`` as they come; raises :class:`RequestFailed` when it cannot finish.
        ``admission``: a decode slot already taken for it (else it waits for one here)."""
        cfg = self.config
        if admission is None:
            admission = await self.decode_stage.admit()
        try:
            produced: list[int] = []
            failed: set[str] = set()
            """Identities of the workers this request failed on (restarted, one is new)."""
            last: AttemptFailed | None = None
            failures = 0
            attempt = 0
            replans = moves = 0
            planned_remote: bool | None = None
            while True:
                prompt = req.prompt + tuple(produced)
                sampling = replace(
                    req.sampling,
                    max_tokens=req.sampling.max_tokens - len(produced),
                    min_tokens=max(0, req.sampling.min_tokens - len(produced)),
                    resumed_tokens=len(produced),
                    # scored once, with the first token: a resumed attempt does not again
                    prompt_logprobs=None if produced else req.sampling.prompt_logprobs,
                )
                hashes, excluded = self.hasher(prompt), frozenset(failed)
                plan = await self._plan(prompt, hashes, excluded, last)
                if planned_remote is None:
                    planned_remote = plan.remote
                rid = f"{req.request_id}.{attempt}"
                attempt += 1
                ran = Ran(plan)
                resumed = len(produced)
                try:
                    # aclosing: a consumer that leaves ends the attempt (and its cleanup) now
                    async with contextlib.aclosing(
                        self._attempt(rid, plan, prompt, hashes, sampling, excluded, ran)
                    ) as events:
                        async for ev in events:
                            produced.extend(ev.token_ids)
                            if ev.finish_reason is not None:
                                self._finished(req, ran.plan, planned_remote, resumed, produced)
                            yield ev
                            if ev.finish_reason is not None:
                                return
                    raise AssertionError(f"attempt {rid} ended without a finish reason")
                except WorkerSwitching as e:
                    self.pool.mark_switching(e.worker, e.instance)
                    moves += 1
                    if moves > MAX_SWITCH_MOVES:
                        raise RequestFailed(
                            503, "the workers of this request kept switching roles; retry later"
                        ) from None
                    log.info("request %s moves off %s: %s", rid, e.worker, e.detail)
                    self._retries.labels(reason="role_switch").inc()
                except Stale:
                    replans += 1
                    if replans <= MAX_REPLANS:
                        continue
                    raise RequestFailed(
                        503, "the workers planned for this request kept going down; retry later"
                    ) from None
                except AttemptFailed as e:
                    failures += 1
                    failed.add(e.identity)
                    last = e
                    if e.lost:
                        self.pool.mark_failed(e.worker, e.detail, e.instance)
                    reason = "migrate" if produced and e.reason == "decode_lost" else e.reason
                    log.warning("request %s attempt %s failed (%s): %s", rid, attempt, reason, e)
                    if failures > cfg.max_retries:
                        raise RequestFailed(
                            502,
                            f"the request failed on {failures} workers; last error: {e}"
                            + (f" (after {len(produced)} tokens)" if produced else ""),
                        ) from None
                    self._retries.labels(reason=reason).inc()
        finally:
            admission.release()

    def _finished(
        self,
        req: GenRequest,
        plan: Plan,
        planned_remote: bool,
        resumed: int,
        produced: list[int],
    ) -> None:
        """What a request that just finished on ``plan`` counts for: disaggregation planned
        but not run, and the guard's sample (a request whose one attempt ran remote)."""
        if planned_remote and not plan.remote:
            self._remote_ran_local.inc()
        if plan.remote and resumed == 0:
            self.guard.offer(
                Check(
                    req.request_id,
                    req.prompt,
                    req.sampling,
                    tuple(produced),
                    plan.decode.worker.name,
                )
            )

    async def _plan(
        self,
        prompt: tuple[int, ...],
        hashes: Sequence[int],
        failed: frozenset[str],
        last: AttemptFailed | None = None,
    ) -> Plan:
        """A plan for the request, waiting up to ``max_wait_s`` for a worker to fit it;
        a request no worker can ever take as the pool stands fails at once, saying why
        (``last``: its latest failure)."""
        deadline = time.monotonic() + self.config.queues.max_wait_s
        while True:
            snap = self.pool.snapshot()
            try:
                return self.planner.plan(len(prompt), hashes, snap, exclude=failed)
            except NoWorker as e:
                hopeless = self.planner.nowhere(len(prompt), snap, failed)
                if hopeless is not None:
                    if last is None:
                        raise RequestFailed(503, hopeless) from None
                    raise RequestFailed(502, f"{hopeless} (last error: {last})") from None
                if time.monotonic() >= deadline:
                    raise RequestFailed(
                        503, f"{e} ({len(snap)} workers known, {len(failed)} failed this request)"
                    ) from None
            await self.pool.wait_change(0.1)

    def _replan(
        self, prompt: tuple[int, ...], hashes: Sequence[int], failed: frozenset[str]
    ) -> Plan:
        """The plan made again from the pool as it is now: while a request waited for its
        prefill slot, the workers it picked may have become busier than others, or gone
        down. Raises :class:`Stale` when no worker fits now."""
        try:
            return self.planner.plan(len(prompt), hashes, self.pool.snapshot(), exclude=failed)
        except NoWorker:
            raise Stale() from None

    async def _attempt(
        self,
        rid: str,
        plan: Plan,
        prompt: tuple[int, ...],
        hashes: Sequence[int],
        sampling: SamplingParams,
        failed: frozenset[str],
        ran: Ran,
    ) -> AsyncGenerator[TokenEvent, None]:
        t = self.config.timeouts
        touched: list[WorkerConn] = []
        finished = assigned = False
        pump: asyncio.Task[None] | None = None
        queue: asyncio.Queue[Any] = asyncio.Queue(ATTEMPT_BUFFER)
        slot: Admission | None = None
        waited = False
        if plan.prefill is not None:
            waited = not self.prefill_stage.has_room
            slot = await self.prefill_stage.admit()  # before any worker is touched
        try:
            if slot is not None and waited:
                plan = ran.plan = self._replan(prompt, hashes, failed)
                if plan.prefill is None:  # local now after all: the slot is not needed
                    slot.release()
            self._decisions.labels(decision=plan.decision.where.value).inc()
            d_view = plan.decode.worker
            d_name = d_view.name
            dconn = self.pool.conn(d_name)
            touched.append(dconn)
            self.pool.assign(d_name, +1)
            assigned = True
            if plan.prefill is not None:
                p_view = plan.prefill.worker
                p_name = p_view.name
                pconn = self.pool.conn(p_name)
                touched.append(pconn)
                self.pool.assign(p_name, +1)
                try:
                    # the lease covers the expected prefill with room to spare
                    lease = max(self.config.timeouts.lease_s, 3 * plan.decision.remote_s)
                    handle = await self._reserve(dconn, d_view, p_view, rid, len(prompt), lease)
                    pump = self._start(dconn, rid, prompt, sampling, True, queue)
                    await self._prefill(pconn, p_view, dconn, d_view, rid, prompt, sampling, handle)
                finally:
                    if slot is not None:
                        slot.release()  # the prefill is over: free the slot before decoding
                    self.pool.assign(p_name, -1)
            else:
                pump = self._start(dconn, rid, prompt, sampling, False, queue)
            first = True
            while True:
                wait = t.first_token_s if first else t.inter_token_s
                try:
                    item = await asyncio.wait_for(queue.get(), wait)
                except TimeoutError:
                    raise AttemptFailed(
                        d_view, "decode_lost", f"no token within {wait:g} s", lost=True
                    ) from None
                if item is None:
                    raise AttemptFailed(d_view, "decode_lost", "stream ended early", lost=True)
                if isinstance(item, BaseException):
                    self._raise_stream_error(d_view, item)
                first = False
                fr = item.finish_reason or None
                if fr == "error":
                    raise RequestFailed(400, f"the worker refused the request: {item.error}")
                if fr == "abort":
                    raise AttemptFailed(d_view, "decode_lost", "aborted by the worker", lost=False)
                if fr is not None:
                    finished = True
                tops = tuple(top_from_proto(t) for t in item.top_logprobs)
                scores = PromptScores.from_chunk(item)
                yield TokenEvent(tuple(item.token_ids), tuple(item.logprobs), fr,
                                 item.num_cached_tokens, tops, scores)  # fmt: skip
                if finished:
                    return
        finally:
            if slot is not None:
                slot.release()  # however the attempt ended before its prefill did
            if assigned:
                self.pool.assign(plan.decode.worker.name, -1)
            if pump is not None:
                pump.cancel()
            if not finished and touched:
                self._spawn_cleanup(rid, touched)

    def _raise_stream_error(self, d_view: WorkerView, e: BaseException) -> None:
        """What a Generate stream's failure means: the request's own fault (a message that
        could not be built, a request the worker refused), a lost worker (the codes of
        :data:`LOST_CODES`), a call cut on this side (the worker left the pool: retry
        elsewhere, blaming no one), or a fault of the router's own, raised as it is."""
        if isinstance(e, UNSENDABLE):
            raise unsendable(e) from e
        if isinstance(e, grpc.RpcError):
            code = rpc_code(e)
            if switching(e):
                raise WorkerSwitching(d_view, rpc_details(e))
            if code is grpc.StatusCode.INVALID_ARGUMENT:
                raise RequestFailed(400, f"the worker refused the request: {e.details()}")
            raise AttemptFailed(d_view, "decode_lost", rpc_details(e), lost=code in LOST_CODES)
        if isinstance(e, grpc.aio.UsageError):
            raise AttemptFailed(d_view, "decode_lost", f"the call was closed: {e}", lost=False)
        raise e

    def _start(
        self,
        conn: WorkerConn,
        rid: str,
        prompt: tuple[int, ...],
        sampling: SamplingParams,
        remote: bool,
        queue: asyncio.Queue[Any],
    ) -> asyncio.Task[None]:
        async def pump() -> None:
            try:
                async for chunk in conn.generate(
                    rid, prompt, sampling, remote, timeout=self.config.timeouts.request_s
                ):
                    await queue.put(chunk)
                await queue.put(None)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # handed to the consumer, which decides
                await queue.put(e)

        return asyncio.create_task(pump(), name=f"generate-{rid}")

    async def _reserve(
        self,
        dconn: WorkerConn,
        d_view: WorkerView,
        p_view: WorkerView,
        rid: str,
        n: int,
        lease_s: float,
    ) -> Any:
        t = self.config.timeouts
        compat = self.pool.compat(p_view.name)
        if compat is None:
            raise AttemptFailed(p_view, "prefill_failed", "no health answer yet", lost=False)
        try:
            return await dconn.reserve(
                rid, n, compat, lease_s, self.config.kv_backend, timeout=t.connect_s
            )
        except UNSENDABLE as e:
            raise unsendable(e) from e
        except grpc.RpcError as e:
            if switching(e):
                raise WorkerSwitching(d_view, f"Reserve: {rpc_details(e)}") from None
            code = rpc_code(e)
            raise AttemptFailed(
                d_view, "reserve_failed", f"Reserve: {rpc_details(e)}", lost=code in LOST_CODES
            ) from None

    async def _prefill(
        self,
        pconn: WorkerConn,
        p_view: WorkerView,
        dconn: WorkerConn,
        d_view: WorkerView,
        rid: str,
        prompt: tuple[int, ...],
        sampling: SamplingParams,
        handle: Any,
    ) -> None:
        t = self.config.timeouts
        try:
            resp = await pconn.prefill(rid, prompt, sampling, handle, timeout=t.prefill_s)
        except UNSENDABLE as e:
            raise unsendable(e) from e
        except grpc.RpcError as e:
            if switching(e):
                raise WorkerSwitching(p_view, f"Prefill: {rpc_details(e)}") from None
            code = rpc_code(e)
            if code is grpc.StatusCode.INVALID_ARGUMENT:
                msg = f"the prefill worker refused the request: {e.details()}"
                raise RequestFailed(400, msg) from None
            # the push reaches the decode worker: when it is down, it is the one to blame
            dh = await self._health(dconn)
            if dh is None:
                raise AttemptFailed(
                    d_view, "decode_lost", "decode worker unreachable during the push", lost=True
                ) from None
            if dh.switching or dh.switches != d_view.switches:
                # its reservation went with a role switch: plan again, blaming no one
                detail = f"switched during the push: {rpc_details(e)}"
                raise WorkerSwitching(d_view, detail) from None
            # both answer: the request failed (say its lease ran out under load), not a worker
            lost = code in LOST_CODES and not await self._answers(pconn)
            raise AttemptFailed(
                p_view, "prefill_failed", f"Prefill: {rpc_details(e)}", lost=lost
            ) from None
        self.planner.estimator.observe_prefill(
            len(prompt) - resp.num_cached_tokens,
            resp.prefill_seconds,
            resp.bytes_sent,
            resp.transfer_seconds,
        )

    async def _health(self, conn: WorkerConn) -> Any:
        """The worker's Health answer, or None when it does not answer."""
        try:
            return await conn.health(self.config.timeouts.connect_s)
        except (grpc.RpcError, TimeoutError, OSError):
            return None

    async def _answers(self, conn: WorkerConn) -> bool:
        return await self._health(conn) is not None

    def _spawn_cleanup(self, rid: str, conns: list[WorkerConn]) -> None:
        async def cleanup() -> None:
            timeout = self.config.timeouts.connect_s
            for conn in conns:
                with contextlib.suppress(grpc.RpcError, TimeoutError, OSError):
                    await conn.cancel(rid, timeout=timeout)

        task = asyncio.create_task(cleanup(), name=f"cleanup-{rid}")
        self._cleanup.add(task)
        task.add_done_callback(self._cleanup.discard)

"""asyncio front of the engine: one background thread owns the :class:`Engine`.

Every engine call (add, abort, the remote-KV calls, layer-wise prefill) is queued to
that thread and awaited, so the engine itself needs no locks; between calls the thread
runs ``step()`` while there is work and hands each request's outputs to its stream.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from splitserve.sampling import SamplingParams

from splitserve_worker.engine.engine import Engine
from splitserve_worker.engine.errors import RequestError
from splitserve_worker.engine.layerwise import LayerCallback
from splitserve_worker.engine.sequence import FinishReason, PrefillResult, RequestOutput

log = logging.getLogger(__name__)
T = TypeVar("T")

IDLE_WAIT_S = 0.05
"""How long the idle engine thread sleeps before looking for work again (it is also
woken at once by every call)."""
RETRY_AFTER_FAILED_DRAIN_S = 0.5
"""How long the engine thread waits before stepping again when even the drain after a
failed step failed: what fails so fails again at once (a lost rank, a dead device), and
the thread must not spin on it while the worker goes down."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput]


class EngineStopped(RuntimeError):
    """The engine thread is not running (never started, or closed)."""


class AsyncEngine:
    def __init__(
        self, engine: Engine, on_error: Callable[[BaseException], None] | None = None
    ) -> None:
        """``on_error`` sees every error an engine step or call raised, on the engine
        thread (the worker looks there for a failed device)."""
        self.engine = engine
        self._on_error = on_error
        self._calls: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._streams_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stats: dict[str, int] = engine.stats()

    # ---- lifecycle ----
    def start(self) -> AsyncEngine:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="splitserve-engine", daemon=True)
            self._thread.start()
        return self

    async def close(self) -> None:
        """Stop the engine thread; open streams end with an ``abort`` output."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30.0)
            self._thread = None
            self.engine.close()
        with self._streams_lock:
            streams = list(self._streams.items())
            self._streams.clear()
        for rid, s in streams:
            out = RequestOutput(rid, [], [], True, FinishReason.ABORT.value, "engine stopped")
            s.loop.call_soon_threadsafe(s.queue.put_nowait, out)

    async def __aenter__(self) -> AsyncEngine:
        return self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- the engine thread ----
    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain_calls()
            if self.engine.has_work():
                try:
                    outputs = self.engine.step()
                except Exception as e:  # the thread boundary: fail the requests, keep serving
                    log.exception("engine step failed")
                    self._report(e)
                    outputs = self._fail_all(f"engine step failed: {e!r}")
                self._stats = self.engine.stats()
                self._dispatch(outputs)
            else:
                self._stats = self.engine.stats()
                self._wake.wait(IDLE_WAIT_S)
                self._wake.clear()
        self._drain_calls()

    def _report(self, e: BaseException) -> None:
        if self._on_error is not None:
            try:
                self._on_error(e)
            except Exception:  # the thread boundary: a listener's bug must not stop it
                log.exception("the engine's error listener failed")

    def _drain_calls(self) -> None:
        while True:
            try:
                fn = self._calls.get_nowait()
            except queue.Empty:
                return
            fn()

    def _fail_all(self, message: str) -> list[RequestOutput]:
        out = []
        with self._streams_lock:
            rids = list(self._streams)
        for rid in rids:
            self.engine.release(rid)
            out.append(RequestOutput(rid, [], [], True, FinishReason.ERROR.value, message))
        try:
            self.engine.step()  # drains the abort outputs the releases queued
        except Exception:  # the step that failed fails again (a lost rank, a dead device)
            log.exception("draining the engine after a failed step failed too")
            self._stop.wait(RETRY_AFTER_FAILED_DRAIN_S)
        return out

    def _dispatch(self, outputs: Iterable[RequestOutput]) -> None:
        for out in outputs:
            with self._streams_lock:
                s = self._streams.get(out.request_id)
                if s is not None and out.finished:
                    del self._streams[out.request_id]
            if s is not None:
                s.loop.call_soon_threadsafe(s.queue.put_nowait, out)

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the engine thread and return its result (or raise its error)."""
        if not self.running or self._stop.is_set():
            raise EngineStopped("the engine is not running: call start() first")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()

        def run() -> None:
            try:
                result = fn(*args)
            except BaseException as e:  # handed to the awaiting caller, not swallowed
                self._stats = self.engine.stats()
                self._report(e)
                loop.call_soon_threadsafe(_set_exception, fut, e)
            else:
                self._stats = self.engine.stats()
                loop.call_soon_threadsafe(_set_result, fut, result)

        self._submit(run)
        return await fut

    def _submit(self, run: Callable[[], None]) -> None:
        """Queue ``run`` for the engine thread and wake it."""
        self._calls.put(run)
        self._wake.set()

    async def _call_for(self, request_id: str, fn: Callable[..., T], *args: Any) -> T:
        """:meth:`call` for a step that gives ``request_id`` blocks (a reservation, a new
        sequence). The step runs on the engine thread even when its caller is cancelled
        meanwhile (a gRPC call whose deadline passed, a client that left); the request is
        then aborted there once the step is done, so nobody is left holding its blocks."""
        pending = asyncio.ensure_future(self.call(fn, *args))
        try:
            return await asyncio.shield(pending)
        except asyncio.CancelledError:
            pending.add_done_callback(lambda _: self._abort_soon(request_id))
            raise

    def _abort_soon(self, request_id: str) -> None:
        def run() -> None:
            try:
                self.engine.abort(request_id)
            except Exception:  # the thread boundary: log, keep serving
                log.exception("aborting %s after its caller left failed", request_id)
            self._stats = self.engine.stats()

        self._submit(run)

    # ---- streams ----
    def _open(self, request_id: str) -> _Stream:
        s = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._streams_lock:
            if request_id in self._streams:
                raise RequestError(f"request id {request_id!r} is already streaming")
            self._streams[request_id] = s
        return s

    def _close_stream(self, request_id: str, s: _Stream) -> None:
        with self._streams_lock:
            if self._streams.get(request_id) is s:
                del self._streams[request_id]

    async def _follow(self, request_id: str, s: _Stream) -> AsyncGenerator[RequestOutput, None]:
        finished = False
        try:
            while not finished:
                out = await s.queue.get()
                finished = out.finished
                yield out
        finally:
            self._close_stream(request_id, s)
            if not finished and self.running:
                await asyncio.shield(self.call(self.engine.abort, request_id))

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: Iterable[int],
        sampling: SamplingParams | None,
        *,
        reuse_prefix: bool = True,
    ) -> AsyncIterator[RequestOutput]:
        """Prefill and decode here; yields outputs until one is ``finished``
        (``reuse_prefix`` False: no cached prefix block is read, the prompt is computed whole).

        A bad request raises :class:`RequestError` before anything is yielded. Leaving
        the iteration early (or cancelling it) aborts the request and frees its blocks.
        """
        s = self._open(request_id)
        try:
            await self._call_for(
                request_id,
                self.engine.add_request,
                request_id,
                list(prompt_token_ids),
                sampling,
                reuse_prefix,
            )
        except BaseException:
            self._close_stream(request_id, s)
            raise
        inner = self._follow(request_id, s)
        try:
            async for out in inner:
                yield out
        finally:
            await inner.aclose()

    async def abort(self, request_id: str) -> bool:
        return await self.call(self.engine.abort, request_id)

    # ---- layer-wise prefill and remote KV ----
    async def prefill_export(
        self,
        request_id: str,
        prompt_token_ids: Iterable[int],
        sampling: SamplingParams | None,
        on_layer: LayerCallback,
        push: object = None,
    ) -> PrefillResult:
        """``Engine.prefill_export`` on the engine thread (``on_layer`` runs there too)."""
        return await self.call(
            self.engine.prefill_export, request_id, list(prompt_token_ids), sampling, on_layer,
            push,
        )  # fmt: skip

    async def reserve(self, request_id: str, num_prompt_tokens: int) -> list[int]:
        return await self._call_for(request_id, self.engine.reserve, request_id, num_prompt_tokens)

    async def write_layer(
        self, request_id: str, layer: int, start_token: int, k: Any, v: Any
    ) -> None:
        await self.call(self.engine.write_layer, request_id, layer, start_token, k, v)

    async def release(self, request_id: str) -> int:
        return await self.call(self.engine.release, request_id)

    async def admit_prefilled(
        self,
        request_id: str,
        prompt_token_ids: Iterable[int],
        first_token: int,
        first_logprob: float | None,
        sampling: SamplingParams | None,
    ) -> AsyncIterator[RequestOutput]:
        """Join the decode batch with the K/V already in the reservation; returns the
        stream of the tokens after ``first_token`` (iterate it to the end, or leave it to
        abort the request)."""
        s = self._open(request_id)
        try:
            await self._call_for(
                request_id,
                self.engine.admit_prefilled,
                request_id,
                list(prompt_token_ids),
                first_token,
                first_logprob,
                sampling,
            )
        except BaseException:
            self._close_stream(request_id, s)
            raise
        return self._follow(request_id, s)

    def stats(self) -> dict[str, int]:
        """Free/total blocks, running, waiting, reserved, tokens in flight (as of the last step)."""
        return dict(self._stats)


def _set_result(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)

"""The ``nixl`` KV backend: NVIDIA NIXL writes each layer straight into the reserved blocks.

Decode side (:class:`~.nixl_receiver.NixlReceiver`): one NIXL agent registers the whole KV pool once
(``DRAM`` on the CPU, ``VRAM`` on CUDA, so GPU-to-GPU moves never stage through the host).
Its metadata and the pool's address and shape travel in the Reserve handle's
``backend_metadata``. The progress thread is off (it busy-waits and would steal a core),
so a poller thread keeps reading notifications: each written layer notifies
``request_id/lease_id/layer/end_token``, and that is what marks the layer as arrived.

Prefill side (:class:`NixlSenderBackend`): ``LANES`` posting lanes, each one NIXL agent
and one thread, load each decode worker's metadata once. Layers go to the lanes in turn.
In host memory the engine's fresh K/V tensors of each layer are registered with the
lane's agent and written from directly (no copy); GPU tensors are staged into a small
registered ring (registering GPU memory per layer is slow) on the engine's stream, and
an event recorded after that copy is what the lane waits for before it posts: UCX reads
the ring outside CUDA's stream order, and the GPU may still be layers behind the engine
thread (:mod:`.staging`). A lane posts one WRITE per layer (a descriptor per (K|V,
block) span) and drives it to completion; at most ``RING_SLOTS`` layers are in flight
per request, which bounds memory and holds the engine back if the wire is slower. The
rings are reused across requests and bounded (:class:`StagingRing`). Several lanes
matter where UCX copies in the posting thread (CMA between processes on one host copies
synchronously inside ``transfer()``): each lane's copy then runs on its own core. Lane
threads, and the thread that loads a decode worker's metadata, work in the device's CUDA
context.

NIXL is optional: :func:`unavailable_reason` says why it cannot be used here.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import secrets
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from splitserve_worker.kv.faults import FaultInjector, InjectedFault
from splitserve_worker.kv.layout import as_bytes, block_spans, owned
from splitserve_worker.kv.nixl_common import (
    POLL_BUSY_S,
    coalesce,
    device_id,
    make_agent,
    mem_type,
)
from splitserve_worker.kv.nixl_common import notif as make_notif
from splitserve_worker.kv.nixl_common import unavailable_reason as unavailable_reason
from splitserve_worker.kv.nixl_receiver import NixlReceiver
from splitserve_worker.kv.staging import DONE, Ready, bind_device, record_current
from splitserve_worker.kv.transport import (
    BackendContext,
    SendStats,
    TransferError,
    TransferTarget,
)

RING_SLOTS = 4
"""Layers in flight at once per request: enough to keep the wire busy while the engine
computes."""

LANES = 2
"""Posting lanes (NIXL agent + thread). On one host, where CMA copies inside the posting
call, two lanes moved 256 MiB at about 10 GB/s against 7 for one (bare probe); beyond two
the copies contend for memory bandwidth."""

SLOT_WAIT_S = 10.0
"""Longest the engine thread waits for an in-flight layer to finish before declaring the
push dead (a layer takes milliseconds; only a stuck peer takes this long)."""

MIN_STAGING_BYTES = 1 << 20
"""Smallest staging buffer; sizes are rounded up to a power of two so that a buffer
serves the next requests of about the same length."""

MAX_IDLE_STAGING_BYTES = 256 << 20
"""Staging memory (GPU memory, registered with every lane) kept for reuse between
requests: two rings of 8,192-token prompts of a Llama-3-8B-shaped model. Beyond it the
buffers returned longest ago are deregistered and freed."""


@dataclass
class _Remote:
    agent: str
    base: int
    dev: int
    mem: str
    num_blocks: int
    block_size: int
    token_bytes: int

    def address(self, layer: int, kv: int, block: int, offset: int) -> int:
        slot = ((layer * 2 + kv) * self.num_blocks + block) * self.block_size + offset
        return self.base + slot * self.token_bytes


@dataclass
class _Job:
    sender: NixlSender
    layer: int
    slot: int
    local_mem: str
    local: list[tuple[int, int, int]]
    remote: list[tuple[int, int, int]]
    notif: bytes
    keep: tuple[Any, ...] = ()
    """Tensors the write reads from, and their registration (released when done)."""
    ready: Ready = DONE
    """When the bytes the write reads hold the layer (a staging copy on the device)."""
    handle: Any = None
    posted: float = field(default=0.0)


@dataclass(eq=False)
class StagingBuffer:
    """One registered staging buffer: its tensor and its registration with each agent."""

    tensor: torch.Tensor
    regs: list[tuple[Any, Any]]
    """``(agent, registration)`` pairs, deregistered when the buffer is freed."""

    @property
    def nbytes(self) -> int:
        return int(self.tensor.numel())


def staging_size(nbytes: int) -> int:
    """The size a staging buffer of at least ``nbytes`` is allocated with."""
    return max(MIN_STAGING_BYTES, 1 << max(0, nbytes - 1).bit_length())


class StagingRing:
    """Registered staging buffers, reused across requests (registering per request is
    slow), bounded: at most ``max_idle_bytes`` wait idle for reuse, and those returned
    longest ago go first."""

    def __init__(self, agents: list[Any], max_idle_bytes: int = MAX_IDLE_STAGING_BYTES) -> None:
        self._agents = agents
        self._max_idle = max_idle_bytes
        self._free: list[StagingBuffer] = []
        """Idle buffers, returned longest ago first."""
        self._lock = threading.Lock()

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(b.nbytes for b in self._free)

    def take(self, nbytes: int, device: torch.device) -> StagingBuffer:
        """An idle buffer of at least ``nbytes`` on ``device`` (the smallest that fits),
        else a new one."""
        with self._lock:
            fits = [b for b in self._free if b.nbytes >= nbytes and b.tensor.device == device]
            if fits:
                buf = min(fits, key=lambda b: b.nbytes)
                self._free.remove(buf)
                return buf
        t = torch.empty(staging_size(nbytes), dtype=torch.uint8, device=device)
        return StagingBuffer(t, [(agent, agent.register_memory(t)) for agent in self._agents])

    def give(self, buf: StagingBuffer) -> None:
        """Keep ``buf`` for reuse; free the oldest idle buffers beyond the bound."""
        with self._lock:
            self._free.append(buf)
            gone = []
            while self._free and sum(b.nbytes for b in self._free) > self._max_idle:
                gone.append(self._free.pop(0))
        for old in gone:
            self._drop(old)

    def close(self) -> None:
        with self._lock:
            gone, self._free = self._free, []
        for old in gone:
            self._drop(old)

    @staticmethod
    def _drop(buf: StagingBuffer) -> None:
        for agent, reg in buf.regs:
            agent.deregister_memory(reg)
        buf.regs = []


class Lane:
    """One NIXL agent and the thread that posts its writes, each once its bytes are ready,
    and drives them to completion."""

    def __init__(self, agent: Any, name: str, device: torch.device | None = None) -> None:
        self.agent = agent
        self.jobs: queue.Queue[_Job] = queue.Queue()
        self._device = device
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"nixl-push-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        bind_device(self._device)  # UCX's CUDA transports post in this thread's context
        waiting: deque[_Job] = deque()
        """Taken, not posted yet: their staging copy may still be running on the GPU."""
        inflight: list[_Job] = []
        while not self._stop.is_set():
            self._take(waiting, block=not waiting and not inflight)
            # in order: a write is posted only once the device has written what it reads
            while waiting and (waiting[0].sender.failed or waiting[0].ready.done()):
                inflight.append(self._post(waiting.popleft()))
            inflight = self._progress(inflight)
            if waiting or inflight:
                time.sleep(POLL_BUSY_S)

    def _take(self, waiting: deque[_Job], block: bool) -> None:
        with contextlib.suppress(queue.Empty):
            if block:
                waiting.append(self.jobs.get(timeout=0.05))
            while True:
                waiting.append(self.jobs.get_nowait())

    def _progress(self, inflight: list[_Job]) -> list[_Job]:
        """Finish the writes that completed or failed; the others are still in flight."""
        still = []
        for job in inflight:
            try:
                state = "ERR" if job.handle is None else self.agent.check_xfer_state(job.handle)
            except Exception:  # NIXL reports a dead peer by raising; the layer failed
                state = "ERR"
            if state == "PROC":
                still.append(job)
                continue
            if job.handle is not None:
                self.agent.release_xfer_handle(job.handle)
            if job.keep:
                self.agent.deregister_memory(job.keep[-1])
                job.keep = ()
            job.sender.layer_done(job, ok=state == "DONE")
        return still

    def _post(self, job: _Job) -> _Job:
        if job.sender.failed:
            job.handle = None
            return job
        try:
            ls = self.agent.get_xfer_descs(job.local, job.local_mem)
            rs = self.agent.get_xfer_descs(job.remote, job.sender.remote.mem)
            job.handle = self.agent.initialize_xfer(
                "WRITE", ls, rs, job.sender.remote.agent, job.notif
            )
            if self.agent.transfer(job.handle) == "ERR":
                self.agent.release_xfer_handle(job.handle)
                job.handle = None
        except Exception as e:  # NIXL raises its own error types for a dead peer
            job.sender.fail(f"NIXL write of layer {job.layer} failed: {e}", "nixl")
            job.handle = None
        return job

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


def on_device(t: torch.Tensor) -> bool:
    """Whether a layer is staged into the ring (device memory) or written in place."""
    return t.device.type != "cpu"


class NixlSenderBackend:
    """The prefill side: lanes, the staging ring, and the decode workers it has loaded.

    The keyword arguments are the parts tests swap: ``make_agent`` (a NIXL agent by name),
    ``staged`` (whether a layer's tensor is staged into the ring), ``record`` (the event
    after a staging copy on a device) and ``device`` (whose CUDA context the lanes work
    in; by default the pool's)."""

    name = "nixl"

    def __init__(
        self,
        ctx: BackendContext,
        lanes: int = LANES,
        *,
        make_agent: Callable[[str], Any] = make_agent,
        staged: Callable[[torch.Tensor], bool] = on_device,
        record: Callable[[torch.device], Ready] = record_current,
        device: torch.device | None = None,
        max_idle_staging_bytes: int = MAX_IDLE_STAGING_BYTES,
    ) -> None:
        self._ctx = ctx
        self.device = device if device is not None else (ctx.pool.pool.device if ctx.pool else None)
        self.staged = staged
        self.record = record
        base = f"{ctx.name_hint}-p{os.getpid()}-{secrets.token_hex(4)}"
        self.lanes = [Lane(make_agent(f"{base}-{i}"), f"{base}-{i}", self.device)
                      for i in range(max(1, lanes))]  # fmt: skip
        self.ring = StagingRing([lane.agent for lane in self.lanes], max_idle_staging_bytes)
        self._remotes: dict[str, _Remote] = {}
        self._lock = threading.Lock()

    def remote(self, metadata: bytes) -> _Remote:
        header_raw, _, md = metadata.partition(b"\n")
        try:
            h = json.loads(header_raw)
        except ValueError:
            raise TransferError("the handle's NIXL metadata is malformed", "handle") from None
        with self._lock:
            r = self._remotes.get(h["agent"])
            if r is None:
                bind_device(self.device)  # UCX loads the peer's GPU memory in this context
                names = {lane.agent.add_remote_agent(md) for lane in self.lanes}
                name = names.pop()
                name = name.decode() if isinstance(name, bytes) else name
                _, _, nb, bs, heads, dim = h["shape"]
                r = _Remote(name, h["base"], h["dev"], h["mem"], nb, bs, heads * dim * h["elem"])
                self._remotes[h["agent"]] = r
        return r

    def open(self, target: TransferTarget) -> NixlSender:
        if not target.backend_metadata:
            raise TransferError("the handle carries no NIXL metadata: Reserve with kv_backend=nixl")
        if target.pool_heads is not None:
            raise TransferError(
                f"NIXL writes whole blocks of a pool, not KV heads {target.pool_heads.start}.."
                f"{target.pool_heads.stop} of one: gather the heads first, or push over tcp "
                "or grpc",
                "handle",
            )
        return NixlSender(self, target, self.remote(target.backend_metadata))

    def lane(self, layer: int) -> Lane:
        return self.lanes[layer % len(self.lanes)]

    def close(self) -> None:
        for lane in self.lanes:
            lane.close()
        self.ring.close()


class NixlSender:
    def __init__(self, backend: NixlSenderBackend, target: TransferTarget, remote: _Remote):
        self._b = backend
        self._t = target
        self.remote = remote
        self._ctx = backend._ctx
        self._faults = FaultInjector(self._ctx.faults)
        self._slot_bytes = 2 * target.num_tokens * remote.token_bytes
        self._buf: StagingBuffer | None = None
        self._free: queue.Queue[int] = queue.Queue()
        for i in range(RING_SLOTS):
            self._free.put(i)
        self._lock = threading.Lock()
        self._pending = 0
        self._idle = threading.Condition(self._lock)
        self._error: str | None = None
        self._reason = "error"
        self._closed = False
        n = self._ctx.compat.num_layers
        self._crc = [0] * (2 * n) if self._ctx.checksums else []
        self._layers_done: set[int] = set()
        self.stats = SendStats()
        self._clock = self._ctx.clock
        # the lease's length as far as this side can tell (a little less than the TTL)
        self._ttl = target.deadline_unix - time.time() if target.deadline_unix else None
        self._deadline = self._clock() + self._ttl if self._ttl is not None else None

    @property
    def failed(self) -> bool:
        return self._error is not None

    @property
    def in_flight(self) -> int:
        """Layers posted whose writes have not completed yet."""
        with self._lock:
            return self._pending

    def fail(self, message: str, reason: str) -> None:
        with self._lock:
            if self._error is None:
                self._error, self._reason = message, reason
            self._idle.notify_all()

    def send_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor, start_token: int) -> None:
        if self._error is not None or self._closed:
            return
        try:
            self._faults.maybe_fail(f"layer {layer}")
        except InjectedFault as e:
            self.fail(str(e), "injected")
            return
        if self._deadline is not None and self._clock() >= self._deadline:
            # the decode side may already reuse these blocks: never write after the lease
            self.fail(f"the lease of request {self._t.request_id!r} expired mid-push",
                      "lease_expired")  # fmt: skip
            return
        if not self.stats.first_send:
            self.stats.first_send = time.monotonic()
        try:
            slot = self._free.get(timeout=SLOT_WAIT_S)
        except queue.Empty:
            self.fail(f"no in-flight layer finished for {SLOT_WAIT_S:.0f} s", "timeout")
            return
        n, tb = int(k.shape[0]), self.remote.token_bytes
        if n and k[0].numel() * k.element_size() != tb:
            self._free.put(slot)
            self.fail(f"layer {layer}: {k[0].numel() * k.element_size()} bytes of K per token, "
                      f"the decode pool holds {tb}: the workers' KV layouts differ",
                      "shape")  # fmt: skip
            return
        if self._crc:
            self._crc[2 * layer] = zlib.crc32(as_bytes(k), self._crc[2 * layer])
            self._crc[2 * layer + 1] = zlib.crc32(as_bytes(v), self._crc[2 * layer + 1])
        corrupt = self._faults.should_corrupt()
        lane = self._b.lane(layer)
        keep: tuple[Any, ...] = ()
        ready = DONE
        if self._b.staged(k):
            # GPU: stage into the registered ring (registering GPU memory per layer is slow)
            if self._buf is None:
                self._buf = self._b.ring.take(RING_SLOTS * self._slot_bytes, k.device)
            base = slot * self._slot_bytes
            stage = self._buf.tensor[base : base + 2 * n * tb]
            stage[: n * tb].view(k.dtype).copy_(k.reshape(-1))
            stage[n * tb :].view(v.dtype).copy_(v.reshape(-1))
            if corrupt:
                stage[0] ^= 0xFF
            # after every copy into the slot, on the same stream: the lane posts once done
            ready = self._b.record(k.device)
            addrs = (int(stage.data_ptr()), int(stage.data_ptr()) + n * tb)
            mem, dev = mem_type(self._buf.tensor), device_id(self._buf.tensor)
        else:
            # host memory: register the engine's fresh K/V tensors and write from them
            kt, vt = owned(k), owned(v)
            if corrupt:
                kt = kt.clone()
                kt.view(torch.uint8).view(-1)[0] ^= 0xFF
            keep = (kt, vt, lane.agent.register_memory([kt, vt]))
            addrs, mem, dev = (int(kt.data_ptr()), int(vt.data_ptr())), "DRAM", 0
        local, remote = [], []
        for kv in (0, 1):
            for s in block_spans(list(self._t.block_ids), start_token, n, self.remote.block_size):
                nbytes = s.count * tb
                local.append((addrs[kv] + (s.token - start_token) * tb, nbytes, dev))
                dst = self.remote.address(layer, kv, s.block, s.offset)
                remote.append((dst, nbytes, self.remote.dev))
        local, remote = coalesce(local, remote)
        with self._lock:
            self._pending += 1
        notif = make_notif(self._t.request_id, self._t.lease_id, layer, start_token + n)
        lane.jobs.put(_Job(self, layer, slot, mem, local, remote, notif, keep=keep, ready=ready))
        self.stats.bytes_sent += 2 * n * tb
        self.stats.layers_sent = max(self.stats.layers_sent, layer + 1)

    def layer_done(self, job: _Job, ok: bool) -> None:
        if not ok and self._error is None:
            self.fail(f"NIXL write of layer {job.layer} did not complete", "nixl")
        if ok and self._ttl is not None:
            # the decode side renews the lease as the layer's notification lands, about
            # now (its grace after expiry covers the difference): one more lease from here
            with self._lock:
                assert self._deadline is not None
                self._deadline = max(self._deadline, self._clock() + self._ttl)
        self._free.put(job.slot)
        with self._lock:
            self._pending -= 1
            self._idle.notify_all()
            last = self._closed and self._pending == 0
        if last:
            self._give_back()

    def finish(self, timeout: float) -> SendStats:
        with self._lock:
            done = self._idle.wait_for(
                lambda: self._pending == 0 or self._error is not None, timeout=timeout
            )
            if not done and self._error is None:
                self._error, self._reason = f"NIXL writes not done after {timeout} s", "timeout"
        self.stats.done = time.monotonic()
        self._release()
        if self._error is not None:
            raise TransferError(self._error, self._reason)
        self.stats.layer_crc32 = list(self._crc)
        return self.stats

    def _release(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = self._pending
        if pending == 0:
            self._give_back()
        # else: a write still reads this buffer; the last one to finish gives it back

    def _give_back(self) -> None:
        with self._lock:
            buf, self._buf = self._buf, None
        if buf is not None:
            self._b.ring.give(buf)

    def abort(self, reason: str) -> None:
        self.fail(f"aborted: {reason}", "aborted")
        self._release()


def make_sender_backend(ctx: BackendContext) -> NixlSenderBackend:
    return NixlSenderBackend(ctx)


def make_receiver_backend(ctx: BackendContext) -> NixlReceiver:
    return NixlReceiver(ctx)

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
registered ring (registering GPU memory per layer is slow). A lane posts one WRITE per
layer (a descriptor per (K|V, block) span) and drives it to completion; at most
``RING_SLOTS`` layers are in flight per request, which bounds memory and holds the engine
back if the wire is slower. Several lanes matter where UCX copies in the posting thread
(CMA between processes on one host copies synchronously inside ``transfer()``): each
lane's copy then runs on its own core.

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
    handle: Any = None
    posted: float = field(default=0.0)


class _Ring:
    """Registered staging buffers (with every lane's agent), reused across requests."""

    def __init__(self, agents: list[Any]) -> None:
        self._agents = agents
        self._free: list[torch.Tensor] = []
        self._regs: list[Any] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int, device: torch.device) -> torch.Tensor:
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.numel() >= nbytes and buf.device == device:
                    return self._free.pop(i)
        buf = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8, device=device)
        self._regs.extend(agent.register_memory(buf) for agent in self._agents)
        return buf

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)


class _Lane:
    """One NIXL agent and the thread that posts its writes and drives them to completion."""

    def __init__(self, name: str) -> None:
        self.agent = make_agent(name)
        self.jobs: queue.Queue[_Job] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"nixl-push-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        inflight: list[_Job] = []
        while not self._stop.is_set():
            try:
                while True:
                    inflight.append(self._post(self.jobs.get_nowait()))
            except queue.Empty:
                pass
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
            inflight = still
            if inflight:
                time.sleep(POLL_BUSY_S)
            else:
                with contextlib.suppress(queue.Empty):
                    inflight.append(self._post(self.jobs.get(timeout=0.05)))

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


class NixlSenderBackend:
    name = "nixl"

    def __init__(self, ctx: BackendContext, lanes: int = LANES) -> None:
        self._ctx = ctx
        base = f"{ctx.name_hint}-p{os.getpid()}-{secrets.token_hex(4)}"
        self.lanes = [_Lane(f"{base}-{i}") for i in range(max(1, lanes))]
        self._ring = _Ring([lane.agent for lane in self.lanes])
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
        return NixlSender(self, target, self.remote(target.backend_metadata))

    def lane(self, layer: int) -> _Lane:
        return self.lanes[layer % len(self.lanes)]

    def close(self) -> None:
        for lane in self.lanes:
            lane.close()


class NixlSender:
    def __init__(self, backend: NixlSenderBackend, target: TransferTarget, remote: _Remote):
        self._b = backend
        self._t = target
        self.remote = remote
        self._ctx = backend._ctx
        self._faults = FaultInjector(self._ctx.faults)
        self._slot_bytes = 2 * target.num_tokens * remote.token_bytes
        self._buf: torch.Tensor | None = None
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
        if self._crc:
            self._crc[2 * layer] = zlib.crc32(as_bytes(k), self._crc[2 * layer])
            self._crc[2 * layer + 1] = zlib.crc32(as_bytes(v), self._crc[2 * layer + 1])
        corrupt = self._faults.should_corrupt()
        lane = self._b.lane(layer)
        keep: tuple[Any, ...] = ()
        if k.is_cuda:
            # GPU: stage into the registered ring (registering GPU memory per layer is slow)
            if self._buf is None:
                self._buf = self._b._ring.take(RING_SLOTS * self._slot_bytes, k.device)
            base = slot * self._slot_bytes
            stage = self._buf[base : base + 2 * n * tb]
            stage[: n * tb].view(k.dtype).copy_(k.reshape(-1))
            stage[n * tb :].view(v.dtype).copy_(v.reshape(-1))
            if corrupt:
                stage[0] ^= 0xFF
            addrs = (int(stage.data_ptr()), int(stage.data_ptr()) + n * tb)
            mem, dev = mem_type(self._buf), device_id(self._buf)
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
        lane.jobs.put(_Job(self, layer, slot, mem, local, remote, notif, keep=keep))
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
        if pending == 0 and self._buf is not None:
            self._b._ring.give(self._buf)
        # else: a write is still in flight into this buffer; it is not reused.

    def abort(self, reason: str) -> None:
        self.fail(f"aborted: {reason}", "aborted")
        self._release()


def make_sender_backend(ctx: BackendContext) -> NixlSenderBackend:
    return NixlSenderBackend(ctx)


def make_receiver_backend(ctx: BackendContext) -> NixlReceiver:
    return NixlReceiver(ctx)

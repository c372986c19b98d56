"""The decode side of the ``nixl`` backend: the pool registered once, notifications polled."""

from __future__ import annotations

import json
import os
import secrets
import threading
import time
from collections.abc import Callable

from splitserve_worker.kv.layout import PoolView
from splitserve_worker.kv.lease import Lease, LeaseError, LeaseTable
from splitserve_worker.kv.nixl_common import (
    POLL_BUSY_S,
    POLL_IDLE_S,
    device_id,
    make_agent,
    mem_type,
    parse_notif,
)
from splitserve_worker.kv.staging import bind_device
from splitserve_worker.kv.transport import BackendContext


class NixlReceiver:
    name = "nixl"

    def __init__(self, ctx: BackendContext,
                 on_complete: Callable[[Lease], None] | None = None) -> None:  # fmt: skip
        """``on_complete``: called (on the poller's thread) once a lease's last layer has
        landed (a decode worker's rank ``r > 0`` tells rank 0 so)."""
        assert ctx.pool is not None and ctx.leases is not None
        self._pool: PoolView = ctx.pool
        self._leases: LeaseTable = ctx.leases
        self._on_complete = on_complete
        self._name = f"{ctx.name_hint}-d{os.getpid()}-{secrets.token_hex(4)}"
        pool = self._pool.pool
        bind_device(pool.device)  # UCX registers GPU memory in the caller's CUDA context
        self._agent = make_agent(self._name)
        self._reg = self._agent.register_memory(pool)
        header = {
            "agent": self._name,
            "base": int(pool.data_ptr()),
            "dev": device_id(pool),
            "mem": mem_type(pool),
            "shape": list(pool.shape),
            "elem": pool.element_size(),
        }
        self._metadata = json.dumps(header).encode() + b"\n" + self._agent.get_agent_metadata()
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="nixl-notifs", daemon=True)
        self._thread.start()

    def backend_metadata(self) -> bytes:
        return self._metadata

    def _poll(self) -> None:
        bind_device(self._pool.pool.device)
        while not self._stop.is_set():
            got = self._agent.get_new_notifs()
            for msgs in got.values():
                for m in msgs:
                    self._arrived(m)
            if got:
                with self._cond:
                    self._cond.notify_all()
            time.sleep(POLL_BUSY_S if len(self._leases) else POLL_IDLE_S)

    def _arrived(self, msg: bytes) -> None:
        try:
            rid, lid, layer, n = parse_notif(msg)
            lease = self._leases.get(rid, lid)
            was = lease.complete
            # a layer landing renews the lease, as a span does on the other backends
            self._leases.record(lease, layer, 0, n, 2 * n * self._pool.token_bytes, renew=True)
        except (ValueError, LeaseError):
            return  # a stale or foreign notification: its lease is already gone
        if self._on_complete is not None and lease.complete and not was:
            self._on_complete(lease)

    def wait_layers(self, lease: Lease, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: lease.complete, timeout=timeout)

    def forget(self, lease: Lease) -> None:
        return None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        try:
            self._agent.deregister_memory(self._reg)
        except Exception:  # the process is going away; NIXL frees it on exit anyway
            return

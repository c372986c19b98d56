"""Stand-ins for what only a GPU and NIXL give, shaped like the real APIs, so that the
ordering and bookkeeping of the device paths run on the CPU: a copy's event the test
completes (:class:`Gate`), and the slice of ``nixl_agent`` the prefill side calls
(:class:`FakeAgent`), whose WRITE copies the host bytes as UCX would when posted."""

from __future__ import annotations

import ctypes
import json
import threading
from collections.abc import Callable
from typing import Any

import torch


class Gate:
    """A ``Ready`` (``done``/``wait``) that holds until the test opens it, and notes that
    somebody asked."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self.asked = threading.Event()
        """Set once a reader has looked (``done``) or started waiting (``wait``)."""

    def done(self) -> bool:
        self.asked.set()
        return self._open.is_set()

    def wait(self) -> None:
        self.asked.set()
        if not self._open.wait(10):
            raise AssertionError("a Gate was waited on for 10 s and never opened")

    def open(self) -> None:
        self._open.set()


class FakeAgent:
    """The part of ``nixl_agent`` the ``nixl`` sender uses, over host memory.

    ``transfer`` copies each local descriptor's bytes to its remote address at once (what
    the bytes were when the write was posted is what lands) and reports ``PROC``;
    ``check_xfer_state`` reports ``DONE`` once ``complete`` is set (set by default).
    ``bound`` (thread id -> device), when given, is read at each call to note which CUDA
    device the calling thread had set."""

    def __init__(self, name: str, bound: dict[int, torch.device] | None = None) -> None:
        self.name = name
        self.bound = bound
        self.registered: dict[int, Any] = {}
        self.posted: list[tuple[list[tuple[int, int, int]], bytes]] = []
        """Each WRITE's local descriptors and the bytes they held when it was posted."""
        self.any_posted = threading.Event()
        self.complete = threading.Event()
        self.complete.set()
        self.calls: list[tuple[str, torch.device | None]] = []
        """``(method, the calling thread's device)`` for the calls that need a context."""
        self._lock = threading.Lock()

    def _note(self, what: str) -> None:
        device = None if self.bound is None else self.bound.get(threading.get_ident())
        with self._lock:
            self.calls.append((what, device))

    def register_memory(self, what: Any) -> object:
        reg = object()
        with self._lock:
            self.registered[id(reg)] = what
        return reg

    def deregister_memory(self, reg: object) -> None:
        with self._lock:
            del self.registered[id(reg)]

    def add_remote_agent(self, metadata: bytes) -> bytes:
        self._note("add_remote_agent")
        return b"decode-agent"

    def get_xfer_descs(self, descs: list[tuple[int, int, int]], mem: str) -> Any:
        self._note("get_xfer_descs")
        return list(descs), mem

    def initialize_xfer(self, op: str, local: Any, remote: Any, agent: str, notif: bytes) -> Any:
        assert op == "WRITE" and agent == "decode-agent"
        return local[0], remote[0]

    def transfer(self, handle: Any) -> str:
        local, remote = handle
        data = b"".join(ctypes.string_at(addr, n) for addr, n, _ in local)
        for (la, n, _), (ra, m, _) in zip(local, remote, strict=True):
            assert n == m
            ctypes.memmove(ra, la, n)
        with self._lock:
            self.posted.append((local, data))
        self.any_posted.set()
        return "PROC"

    def check_xfer_state(self, handle: Any) -> str:
        return "DONE" if self.complete.is_set() else "PROC"

    def release_xfer_handle(self, handle: Any) -> None:
        return None


def agent_factory(
    agents: list[FakeAgent], bound: dict[int, torch.device] | None = None
) -> Callable[[str], FakeAgent]:
    """``make_agent`` for the sender backend: each agent made is appended to ``agents``."""

    def make(name: str) -> FakeAgent:
        agent = FakeAgent(name, bound)
        agents.append(agent)
        return agent

    return make


def remote_metadata(pool: torch.Tensor) -> bytes:
    """What a decode worker's NIXL receiver puts in its Reserve handle, for ``pool`` (a
    host tensor ``[layers, 2, blocks, block_size, kv_heads, head_dim]``)."""
    header = {"agent": "decode", "base": int(pool.data_ptr()), "dev": 0, "mem": "DRAM",
              "shape": list(pool.shape), "elem": pool.element_size()}  # fmt: skip
    return json.dumps(header).encode() + b"\n" + b"agent-metadata"

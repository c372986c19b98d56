"""The ``nixl`` prefill side without NIXL or a GPU: a staged layer is posted only once the
event recorded after its copy into the ring is done (UCX reads the ring outside CUDA's
stream order); the staging ring is reused and bounded, and a push aborted while a write
reads its buffer gives the buffer back when the write ends; the lane threads and the
thread that loads a decode worker work in the device's CUDA context.

:class:`~device_fakes.FakeAgent` stands for ``nixl_agent`` (its WRITE copies the bytes
when posted, so what lands is what the ring held then); ``staged`` sends host tensors
through the ring as device tensors go, and each copy's event is a
:class:`~device_fakes.Gate` the test opens."""

from __future__ import annotations

import threading

import pytest
import torch
from device_fakes import FakeAgent, Gate, agent_factory, remote_metadata
from splitserve.kv_compat import Compat
from splitserve_worker.kv.layout import PoolView
from splitserve_worker.kv.nixl_backend import (
    NixlSenderBackend,
    StagingBuffer,
    StagingRing,
    staging_size,
)
from splitserve_worker.kv.transport import BackendContext, TransferTarget

pytestmark = pytest.mark.unit

L, NB, BS, H, D = 3, 8, 4, 2, 4
COMPAT = Compat("nixl-fake", "float32", BS, L, H, D, "LKBTHD-v1")
CPU = torch.device("cpu")


def decode_pool() -> torch.Tensor:
    return torch.zeros(L, 2, NB, BS, H, D)


def target(pool: torch.Tensor, blocks: tuple[int, ...], n: int) -> TransferTarget:
    return TransferTarget("r", "lease", "127.0.0.1:1", blocks, n, COMPAT.hash,
                          remote_metadata(pool))  # fmt: skip


def fresh(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, H, D, generator=g), torch.randn(n, H, D, generator=g))
            for _ in range(L)]  # fmt: skip


class Events:
    """``record`` for the backend: a Gate per staging copy, in order."""

    def __init__(self) -> None:
        self.gates: list[Gate] = []

    def __call__(self, device: torch.device) -> Gate:
        gate = Gate()
        self.gates.append(gate)
        return gate


def test_a_staged_layer_is_posted_only_once_the_event_after_its_copy_is_done() -> None:
    agents: list[FakeAgent] = []
    events = Events()
    backend = NixlSenderBackend(BackendContext(compat=COMPAT), lanes=1,
                                make_agent=agent_factory(agents), staged=lambda t: True,
                                record=events)  # fmt: skip
    pool, blocks, n = decode_pool(), (5, 1, 6), 10
    kv = fresh(n, 1)
    try:
        sender = backend.open(target(pool, blocks, n))
        for layer, (k, v) in enumerate(kv):
            sender.send_layer(layer, k, v, 0)  # returns with the copy's event still pending
        assert len(events.gates) == L, "one event per staged layer, recorded after its copy"
        assert events.gates[0].asked.wait(5), "the lane never looked at the copy's event"
        assert agents[0].posted == [], "a WRITE was posted before the device wrote its bytes"
        for gate in events.gates:
            gate.open()
        stats = sender.finish(10)
        assert stats.layers_sent == L and len(agents[0].posted) == L
        for layer, (k, v) in enumerate(kv):
            got_k, got_v = PoolView(pool).read(layer, list(blocks), 0, n)
            assert torch.equal(got_k, k) and torch.equal(got_v, v)
    finally:
        backend.close()


def test_host_layers_are_written_in_place_with_nothing_to_wait_for() -> None:
    agents: list[FakeAgent] = []
    events = Events()
    backend = NixlSenderBackend(BackendContext(compat=COMPAT), lanes=2,
                                make_agent=agent_factory(agents), record=events)  # fmt: skip
    pool, blocks, n = decode_pool(), (2, 3), 7
    kv = fresh(n, 2)
    try:
        sender = backend.open(target(pool, blocks, n))
        for layer, (k, v) in enumerate(kv):
            sender.send_layer(layer, k, v, 0)
        sender.finish(10)
        assert events.gates == [], "host tensors are registered and written from directly"
        for layer, (k, _) in enumerate(kv):
            assert torch.equal(PoolView(pool).read(layer, list(blocks), 0, n)[0], k)
        assert all(not a.registered for a in agents), "per-layer registrations are released"
    finally:
        backend.close()


def test_the_staging_ring_reuses_buffers_and_keeps_no_more_than_its_bound_idle() -> None:
    agents = [FakeAgent("a"), FakeAgent("b")]
    mib = 1 << 20
    ring = StagingRing(agents, max_idle_bytes=16 * mib)
    small = ring.take(3 * mib, CPU)
    assert small.nbytes == staging_size(3 * mib) == 4 * mib
    assert all(len(a.registered) == 1 for a in agents), "registered with every lane's agent"
    ring.give(small)
    assert ring.take(2 * mib, CPU) is small, "an idle buffer that fits is reused"
    ring.give(small)
    bigger = [ring.take(5 * mib, CPU) for _ in range(3)]  # none idle fits: three new ones
    assert all(b.nbytes == 8 * mib for b in bigger)
    for b in bigger:
        ring.give(b)
    assert ring.idle_bytes <= 16 * mib, "idle staging memory is bounded"
    idle = ring.idle_bytes // (4 * mib)
    assert all(len(a.registered) <= idle for a in agents), "freed buffers are deregistered"
    assert ring.take(7 * mib, CPU) in bigger, "the most recently returned stay for reuse"
    ring.close()
    assert ring.idle_bytes == 0 and all(len(a.registered) == 1 for a in agents)


def test_a_push_aborted_mid_write_gives_its_buffer_back_once_the_write_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    agents: list[FakeAgent] = []
    events = Events()
    backend = NixlSenderBackend(BackendContext(compat=COMPAT), lanes=1,
                                make_agent=agent_factory(agents), staged=lambda t: True,
                                record=events)  # fmt: skip
    returned = threading.Event()
    give = backend.ring.give

    def noted_give(buf: StagingBuffer) -> None:
        give(buf)
        returned.set()

    monkeypatch.setattr(backend.ring, "give", noted_give)
    pool, n = decode_pool(), 6
    (k, v), *_ = fresh(n, 3)
    try:
        agents[0].complete.clear()  # the write stays in flight
        sender = backend.open(target(pool, (0, 1), n))
        sender.send_layer(0, k, v, 0)
        events.gates[0].open()
        assert agents[0].any_posted.wait(5), "the layer was never posted"
        sender.abort("the request was cancelled")
        assert not returned.is_set(), "a buffer that a write still reads was given back"
        agents[0].complete.set()
        assert returned.wait(5), "the buffer was never given back"
        assert backend.ring.idle_bytes == staging_size(4 * 2 * n * H * D * 4)
    finally:
        backend.close()


def test_lanes_and_the_remote_agent_load_run_in_the_devices_cuda_context(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bound: dict[int, torch.device] = {}

    def set_device(device: torch.device) -> None:  # what bind_device calls
        bound[threading.get_ident()] = torch.device(device)

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    agents: list[FakeAgent] = []
    gpu = torch.device("cuda", 0)
    backend = NixlSenderBackend(BackendContext(compat=COMPAT), lanes=2,
                                make_agent=agent_factory(agents, bound), device=gpu)  # fmt: skip
    pool, n = decode_pool(), 4
    try:
        opened: list[object] = []
        t = threading.Thread(target=lambda: opened.append(backend.open(target(pool, (0,), n))))
        t.start()  # a thread of its own, as asyncio.to_thread gives the worker
        t.join(5)
        (sender,) = opened
        for layer, (k, v) in enumerate(fresh(n, 4)):
            sender.send_layer(layer, k, v, 0)  # type: ignore[attr-defined]
        sender.finish(10)  # type: ignore[attr-defined]
        calls = [c for a in agents for c in a.calls]
        assert {what for what, _ in calls} == {"add_remote_agent", "get_xfer_descs"}
        assert all(device == gpu for _, device in calls), calls
    finally:
        backend.close()

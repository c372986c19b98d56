"""Layers leave the engine thread before the device has written them, and go on the wire
only once it has: the ``tcp``/``grpc`` span sender hands a span to its stream thread
only after that span's copy to the host is done, and the engine thread waits for the
copy only to take a checksum. On the CPU the pool's tensors are host memory and are kept
as they are. The copy's event is a :class:`~device_fakes.Gate` the test opens; the GPU
runs of the same paths are in ``tests/gpu``."""

from __future__ import annotations

import threading
import zlib
from collections.abc import Iterator

import pytest
import torch
from device_fakes import Gate
from splitserve.kv_compat import Compat
from splitserve_worker.kv.layout import as_bytes
from splitserve_worker.kv.span_sender import SpanOut, SpanSender
from splitserve_worker.kv.staging import DONE, HostStaging, Ready
from splitserve_worker.kv.transport import BackendContext, TransferTarget

pytestmark = pytest.mark.unit

L, H, D = 2, 2, 4
COMPAT = Compat("staged", "float32", 16, L, H, D, "LKBTHD-v1")
TARGET = TransferTarget("r", "lease", "127.0.0.1:1", (0, 1), 20, COMPAT.hash)


class GatedStager:
    """A :class:`~splitserve_worker.kv.staging.Stager` whose copies finish when the test
    opens their gate (one per layer handed over)."""

    def __init__(self) -> None:
        self.gates: list[Gate] = []
        self._made = threading.Condition()

    def to_host(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Ready]:
        gate = Gate()
        with self._made:
            self.gates.append(gate)
            self._made.notify_all()
        return k.clone(), v.clone(), gate

    def gate(self, i: int) -> Gate:
        """The gate of the ``i``-th layer handed over, once it was."""
        with self._made:
            assert self._made.wait_for(lambda: len(self.gates) > i, 5), f"no layer {i} yet"
            return self.gates[i]


class RecordingStream:
    """A :class:`~splitserve_worker.kv.span_sender.Stream` that keeps what it was given."""

    def __init__(self) -> None:
        self.spans: list[tuple[int, int, bytes]] = []
        self.first = threading.Event()

    def run(self, spans: Iterator[SpanOut]) -> int:
        layers = set()
        for s in spans:
            self.spans.append((s.layer, s.start, b"".join(bytes(p) for p in s.parts)))
            self.first.set()
            layers.add(s.layer)
        return len(layers)

    def cancel(self) -> None:
        return None


def fresh(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, H, D, generator=g), torch.randn(n, H, D, generator=g)


def test_a_span_goes_on_the_wire_only_once_its_copy_to_the_host_is_done() -> None:
    stager, stream = GatedStager(), RecordingStream()
    sender = SpanSender(TARGET, BackendContext(compat=COMPAT), [stream], "test", stager)
    layers = [fresh(20, i) for i in range(L)]
    for i, (k, v) in enumerate(layers):
        sender.send_layer(i, k, v, 0)  # returns with both copies still running
    first = stager.gates[0]
    assert first.asked.wait(5), "the stream thread never looked at the copy's event"
    assert stream.spans == [], "a span went on the wire before its copy was done"
    for gate in stager.gates:
        gate.open()
    stats = sender.finish(10)
    assert stats.layers_sent == L
    assert stream.spans == [
        (i, 0, bytes(as_bytes(k)) + bytes(as_bytes(v))) for i, (k, v) in enumerate(layers)
    ]


def test_with_checksums_the_engine_thread_waits_for_the_copy_to_take_them() -> None:
    stager, stream = GatedStager(), RecordingStream()
    ctx = BackendContext(compat=COMPAT, checksums=True)
    sender = SpanSender(TARGET, ctx, [stream], "test", stager)
    layers = [fresh(20, 7 + i) for i in range(L)]
    for i, (k, v) in enumerate(layers):
        handed = threading.Event()

        t = threading.Thread(target=hand_over, args=(sender, i, k, v, handed))
        t.start()
        assert stager.gate(i).asked.wait(5)
        assert not handed.is_set(), "the checksum was taken before the copy was done"
        stager.gate(i).open()
        t.join(5)
        assert handed.is_set()
    stats = sender.finish(10)
    assert stats.layer_crc32 == [zlib.crc32(as_bytes(t)) for kv in layers for t in kv]


def hand_over(
    sender: SpanSender, i: int, k: torch.Tensor, v: torch.Tensor, handed: threading.Event
) -> None:
    """What the engine thread does with a layer."""
    sender.send_layer(i, k, v, 0)
    handed.set()


def test_host_layers_are_kept_as_they_are_and_ready_at_once() -> None:
    pool = torch.randn(40, H, D)
    fresh_k, view_v = torch.randn(8, H, D), pool[3:11]
    k, v, ready = HostStaging().to_host(fresh_k, view_v)
    assert k is fresh_k, "a fresh host tensor is sent as it is, not copied"
    assert v.data_ptr() != view_v.data_ptr() and torch.equal(v, view_v), "a view is copied"
    pool[3:11] = 0  # the engine reuses the pool: what was handed over stays
    assert v.abs().sum() > 0
    assert ready is DONE and ready.done()

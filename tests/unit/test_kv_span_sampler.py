"""Sampled KV checksums: which spans of a push carry a crc32 (one in N, counted over
every push of a backend, so short pushes take their turn), and that with full checksums
on every span does and each layer's crc32 is kept for Commit."""

from __future__ import annotations

import threading
import zlib
from collections.abc import Iterator

import pytest
import torch
from splitserve.kv_compat import Compat
from splitserve_worker.kv.span_sender import SpanOut, SpanSampler, SpanSender
from splitserve_worker.kv.transport import BackendContext, TransferTarget
from splitserve_worker.server.config import ConfigError, WorkerConfig

pytestmark = pytest.mark.unit

L, H, D = 4, 2, 4
COMPAT = Compat("sampled", "float32", 16, L, H, D, "LKBTHD-v1")
TARGET = TransferTarget("r", "lease", "127.0.0.1:1", (0, 1), 20, COMPAT.hash)


class Recording:
    def __init__(self) -> None:
        self.crcs: list[tuple[int, int | None, int]] = []
        self.lock = threading.Lock()

    def run(self, spans: Iterator[SpanOut]) -> int:
        layers = set()
        for s in spans:
            data = b"".join(bytes(p) for p in s.parts)
            with self.lock:
                self.crcs.append((s.layer, s.crc32, zlib.crc32(data)))
            layers.add(s.layer)
        return len(layers)

    def cancel(self) -> None:
        return None


def push(ctx: BackendContext, sampler: SpanSampler | None = None) -> tuple[Recording, list[int]]:
    stream = Recording()
    sender = SpanSender(TARGET, ctx, [stream], "test", sampler=sampler)
    g = torch.Generator().manual_seed(1)
    for layer in range(L):
        sender.send_layer(layer, torch.randn(20, H, D, generator=g),
                          torch.randn(20, H, D, generator=g), 0)  # fmt: skip
    return stream, sender.finish(10).layer_crc32


def test_the_sampler_takes_one_in_n() -> None:
    s = SpanSampler(3)
    assert [s.take() for _ in range(7)] == [True, False, False, True, False, False, True]
    assert not any(SpanSampler(0).take() for _ in range(5))
    with pytest.raises(ValueError, match="checksum_every"):
        SpanSampler(-1)


def test_one_span_in_n_carries_its_crc32_across_pushes() -> None:
    sampler = SpanSampler(3)  # a backend's: shared by its pushes
    ctx = BackendContext(compat=COMPAT, checksum_every=3)
    first, kept = push(ctx, sampler)
    second, _ = push(ctx, sampler)
    carried = [crc is not None for _, crc, _ in first.crcs + second.crcs]
    assert carried == [True, False, False, True, False, False, True, False]
    for _, crc, actual in first.crcs + second.crcs:
        assert crc is None or crc == actual
    assert kept == []  # a sampled push sends no per-layer crc32s to Commit


def test_full_checksums_cover_every_span_and_every_layer() -> None:
    stream, kept = push(BackendContext(compat=COMPAT, checksums=True, checksum_every=3))
    assert all(crc == actual for _, crc, actual in stream.crcs) and len(stream.crcs) == L
    assert len(kept) == 2 * L


def test_off_means_no_crc32_at_all() -> None:
    stream, kept = push(BackendContext(compat=COMPAT, checksum_every=0))
    assert [crc for _, crc, _ in stream.crcs] == [None] * L and kept == []


def test_workers_sample_checksums_by_default_and_refuse_a_negative_share() -> None:
    assert WorkerConfig(role="decode", model="m", token="t").checksum_every == 64
    with pytest.raises(ConfigError, match="--checksum-every"):
        WorkerConfig(role="decode", model="m", token="t", checksum_every=-1)

"""Device layers on their way to the wire, on a GPU that runs behind: the engine's
stream is held by a spinning kernel queued before each layer is written, so a copy or a
read that does not wait for it sees the layer's old bytes.

- :class:`~splitserve_worker.kv.staging.HostStaging` returns before the copy is done
  (nothing waits on the engine thread), into pinned memory, and its event holds until
  the layer is on the host with its values.
- ``tcp`` and ``grpc`` pushes of such layers land whole in a decode pool, with checksums
  off and on.

Skipped where CUDA is absent. On a GPU host: ``tests/gpu/README.md``.
"""

from __future__ import annotations

import asyncio
import zlib

import pytest
import torch
from kv_kit import bare_decode
from splitserve.kv_compat import Compat
from splitserve_worker.kv.layout import as_bytes
from splitserve_worker.kv.staging import HostStaging
from splitserve_worker.kv.transport import BackendContext, create_sender_backend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.integration,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SPIN_CYCLES = 200_000_000
"""GPU clock cycles a spinning kernel holds the stream (0.1 s at 2 GHz, more at idle
clocks): far longer than the host takes to queue and return."""
L, NB, BS, H, D = 4, 64, 16, 4, 64
COMPAT = Compat("staged-cuda", "float32", BS, L, H, D, "LKBTHD-v1")


def behind(value: torch.Tensor) -> torch.Tensor:
    """A fresh device tensor that holds ``value`` only once a spinning kernel queued
    before its write has run."""
    out = torch.zeros_like(value)
    torch.cuda._sleep(SPIN_CYCLES)
    out.copy_(value)
    return out


def test_host_staging_returns_at_once_and_its_event_holds_until_the_layer_is_there() -> None:
    want_k = torch.randn(300, H, D, device="cuda")
    want_v = torch.randn(300, H, D, device="cuda")
    staging = HostStaging()
    k, v, ready = staging.to_host(behind(want_k), behind(want_v))
    assert not ready.done(), "the copy finished before the GPU wrote the layer"
    assert k.device.type == "cpu" and k.is_pinned() and v.is_pinned()
    ready.wait()
    assert torch.equal(k, want_k.cpu()) and torch.equal(v, want_v.cpu())
    strided = behind(torch.randn(2, 300, H, D, device="cuda"))
    k2, v2, ready2 = staging.to_host(strided[0].transpose(0, 1), strided[1])  # views
    ready2.wait()
    assert torch.equal(k2, strided[0].transpose(0, 1).cpu()) and torch.equal(v2, strided[1].cpu())


@pytest.mark.parametrize("checksums", [False, True], ids=["no-checksums", "checksums"])
@pytest.mark.parametrize("backend", ["tcp", "grpc"])
def test_a_push_of_layers_the_gpu_has_not_written_yet_lands_whole(
    backend: str, checksums: bool
) -> None:
    async def scenario() -> None:
        async with bare_decode(COMPAT, NB, backends=("tcp", "grpc")) as d:
            n, blocks = 700, list(range(NB - 1, NB - 45, -1))
            lease = d.reserve("r", blocks, n, backend=backend)
            ctx = BackendContext(compat=COMPAT, token="kv-kit-token", checksums=checksums,
                                 clock=d.clock)  # fmt: skip
            sender_backend = create_sender_backend(backend, ctx)
            want = [(torch.randn(n, H, D, device="cuda"), torch.randn(n, H, D, device="cuda"))
                    for _ in range(L)]  # fmt: skip
            sender = sender_backend.open(d.target(lease))
            for layer, (k, v) in enumerate(want):
                sender.send_layer(layer, behind(k), behind(v), 0)
            stats = await asyncio.to_thread(sender.finish, 60)
            assert await asyncio.to_thread(d.receivers[backend].wait_layers, lease, 10)
            for layer, (k, v) in enumerate(want):
                got_k, got_v = d.read(lease, layer)
                assert torch.equal(got_k, k.cpu()) and torch.equal(got_v, v.cpu()), layer
            if checksums:
                assert stats.layer_crc32 == [zlib.crc32(as_bytes(t)) for kv in want for t in kv]
            sender_backend.close()

    asyncio.run(scenario())

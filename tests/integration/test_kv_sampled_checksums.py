"""Sampled KV checksums on the real ``tcp`` and ``grpc`` backends over a bare pool: with
one span in N carrying its crc32 (the workers' default), a corrupt span that carries one
is refused before its KV is used; with them off (``checksum_every=0``) the same corrupt
push lands, which is what the correctness guard is there to notice."""

from __future__ import annotations

import asyncio

import pytest
import torch
from kv_kit import bare_decode
from splitserve.kv_compat import Compat
from splitserve_worker.kv.faults import FaultConfig
from splitserve_worker.kv.transport import BackendContext, TransferError, create_sender_backend

pytestmark = pytest.mark.integration

TOKEN = "sampled-token"
L, NB, BS, H, D = 3, 40, 16, 2, 8
COMPAT = Compat("sampled", "float32", BS, L, H, D, "LKBTHD-v1")
CORRUPT = FaultConfig(corrupt_prob=1.0, seed=3)


def kv(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(n, H, D, generator=g), torch.randn(n, H, D, generator=g))
            for _ in range(L)]  # fmt: skip


@pytest.mark.parametrize("backend", ["tcp", "grpc"])
@pytest.mark.parametrize("every", [1, 0])
def test_a_corrupt_sampled_span_is_refused_and_unsampled_ones_land(
    backend: str, every: int
) -> None:
    async def scenario() -> None:
        async with bare_decode(COMPAT, NB, backends=(backend,), token=TOKEN) as d:
            n = 20
            lease = d.reserve("r", [4, 9], n, backend=backend)
            ctx = BackendContext(compat=COMPAT, token=TOKEN, checksum_every=every,
                                 faults=CORRUPT, streams=1, clock=d.clock)  # fmt: skip
            sender_backend = create_sender_backend(backend, ctx)
            sender = sender_backend.open(d.target(lease))
            layers = kv(n)
            for layer, (k, v) in enumerate(layers):
                sender.send_layer(layer, k, v, 0)
            try:
                if every:
                    with pytest.raises(TransferError) as e:
                        await asyncio.to_thread(sender.finish, 30)
                    assert "failed its checksum" in str(e.value), e.value
                else:
                    stats = await asyncio.to_thread(sender.finish, 30)
                    assert stats.layers_sent == L and stats.layer_crc32 == []
                    got_k, got_v = d.read(lease, 0)
                    assert torch.equal(got_v, layers[0][1])
                    assert not torch.equal(got_k, layers[0][0]), "nothing was corrupted"
            finally:
                sender_backend.close()

    asyncio.run(scenario())

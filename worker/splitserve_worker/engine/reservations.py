"""Blocks held for prompts whose K/V is written from outside (the decode side of a
disaggregated request), until the sequence is admitted or the hold is released."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve_worker.engine.errors import RequestError, UnknownRequest
from splitserve_worker.engine.kv_cache import KVCache


@dataclass
class Reservation:
    blocks: list[int]
    num_tokens: int


class Reservations:
    def __init__(self, kv: KVCache) -> None:
        self.kv = kv
        self._held: dict[str, Reservation] = {}

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._held

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, request_id: str, num_tokens: int) -> list[int]:
        """Allocate blocks for ``num_tokens`` positions (raises ``NoCapacity``)."""
        bs = self.kv.block_size
        ids = self.kv.blocks.allocate((num_tokens + bs - 1) // bs)
        self._held[request_id] = Reservation(ids, num_tokens)
        return list(ids)

    def get(self, request_id: str) -> Reservation:
        r = self._held.get(request_id)
        if r is None:
            raise UnknownRequest(request_id)
        return r

    def write(
        self, request_id: str, layer: int, start: int, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        r = self.get(request_id)
        n = int(k.shape[0])
        if start < 0 or start + n > r.num_tokens:
            raise RequestError(
                f"K/V for positions [{start}, {start + n}) is outside the reserved "
                f"{r.num_tokens} tokens"
            )
        slots = self.kv.slots(r.blocks, start, start + n)
        self.kv.write(layer, slots, k.to(self.kv.device), v.to(self.kv.device))

    def take(self, request_id: str) -> Reservation:
        """Hand the blocks over (to an admitted sequence): no longer held here."""
        r = self.get(request_id)
        del self._held[request_id]
        return r

    def release(self, request_id: str) -> int:
        """Free a hold; 0 if there is none."""
        r = self._held.pop(request_id, None)
        if r is None:
            return 0
        self.kv.blocks.free(reversed(r.blocks))
        return len(r.blocks)

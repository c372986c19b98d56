"""Block arithmetic over the KV pool, pure apart from the tensor copies it is asked for.

The pool is ONE tensor ``[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]``
(2 = K then V). Token ``t`` of a sequence whose blocks are ``block_ids`` lives in block
``block_ids[t // block_size]`` at offset ``t % block_size``; every (layer, K|V, block)
slice is contiguous, so a transport can address blocks directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CHUNK_BYTES = 4 << 20
"""Target payload of one KV span. The tcp port receives each in place, so per-span costs
are all that size changes: 4 MiB spent a quarter less sending CPU than 1 MiB
(``bench/kv_transfer.py``), and stays far under gRPC's message limit (64 MiB) for the
``grpc`` backend and the tcp wire's own (:data:`~.tcp_wire.MAX_SPAN_BYTES`)."""

MAX_RUN_COPIES = 64
"""A CPU pool write split into at most this many stretches of consecutive slots is done
as one plain copy per stretch (memcpy speed); beyond it, one indexed copy costs less."""


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass(frozen=True)
class Span:
    """Tokens ``[token, token + count)`` of a sequence, stored in ``block`` from ``offset``."""

    block: int
    offset: int
    token: int
    count: int


def block_spans(block_ids: list[int], start: int, count: int, block_size: int) -> list[Span]:
    """Split tokens ``[start, start + count)`` into per-block spans."""
    if start < 0 or count < 0:
        raise ValueError(f"bad token range start={start} count={count}")
    end = start + count
    if end > len(block_ids) * block_size:
        raise ValueError(
            f"tokens up to {end} do not fit in {len(block_ids)} blocks of {block_size}"
        )
    out = []
    t = start
    while t < end:
        idx, off = divmod(t, block_size)
        n = min(block_size - off, end - t)
        out.append(Span(block_ids[idx], off, t, n))
        t += n
    return out


def slot_runs(
    block_ids: list[int], start: int, count: int, block_size: int
) -> list[tuple[int, int, int]]:
    """``(first slot, first token counted from start, length)`` of each stretch of
    consecutive pool slots that tokens ``[start, start + count)`` occupy."""
    runs: list[tuple[int, int, int]] = []
    for s in block_spans(block_ids, start, count, block_size):
        slot = s.block * block_size + s.offset
        if runs and runs[-1][0] + runs[-1][2] == slot:
            first, token, n = runs[-1]
            runs[-1] = (first, token, n + s.count)
        else:
            runs.append((slot, s.token - start, s.count))
    return runs


def token_chunks(num_tokens: int, bytes_per_token: int, target: int = CHUNK_BYTES) -> list[int]:
    """Start offsets splitting ``num_tokens`` into messages of about ``target`` bytes."""
    per = max(1, target // max(1, bytes_per_token))
    return list(range(0, num_tokens, per))


class PoolView:
    """Reads and writes one sequence's tokens in the pool, by block id."""

    def __init__(self, pool: torch.Tensor) -> None:
        if pool.dim() != 6 or pool.shape[1] != 2:
            raise ValueError(
                "KV pool must be [num_layers, 2, num_blocks, block_size, kv_heads, head_dim], "
                f"got {tuple(pool.shape)}"
            )
        self.pool = pool
        self.num_layers, _, self.num_blocks, self.block_size, self.kv_heads, self.head_dim = (
            int(x) for x in pool.shape
        )
        self.dtype = pool.dtype
        self.token_elems = self.kv_heads * self.head_dim
        self.token_bytes = self.token_elems * pool.element_size()
        self._bytes: memoryview | None = None

    def slots(self, block_ids: list[int], start: int, count: int) -> torch.Tensor:
        """Flat slot index (block * block_size + offset) of each token in the range."""
        ids = torch.tensor(block_ids, dtype=torch.long)
        t = torch.arange(start, start + count, dtype=torch.long)
        return ids[t // self.block_size] * self.block_size + t % self.block_size

    def write(
        self, layer: int, block_ids: list[int], start: int, k: torch.Tensor, v: torch.Tensor,
        heads: range | None = None,
    ) -> None:  # fmt: skip
        """Copy ``k``/``v`` ``[n, len(heads), head_dim]`` into heads ``heads`` (None: all)
        of the blocks: one copy each."""
        n = int(k.shape[0])
        if n == 0:
            return
        flat = self.pool[layer].view(2, self.num_blocks * self.block_size, self.kv_heads, -1)
        nh = self.kv_heads
        if heads is not None and len(heads) != self.kv_heads:
            flat, nh = flat[:, :, heads.start : heads.stop], len(heads)
        k = k.to(self.pool.device).view(n, nh, -1)
        v = v.to(self.pool.device).view(n, nh, -1)
        if self.pool.device.type == "cpu":
            runs = slot_runs(block_ids, start, n, self.block_size)
            if len(runs) <= MAX_RUN_COPIES:
                # indexed copies move one element at a time; a stretch of slots is a memcpy
                for slot, t, m in runs:
                    flat[0, slot : slot + m].copy_(k[t : t + m])
                    flat[1, slot : slot + m].copy_(v[t : t + m])
                return
        slots = self.slots(block_ids, start, n).to(self.pool.device)
        flat[0].index_copy_(0, slots, k)
        flat[1].index_copy_(0, slots, v)

    def byte_views(
        self, layer: int, block_ids: list[int], start: int, count: int
    ) -> list[memoryview] | None:
        """Writable byte views of the tokens' K, then their V, in the pool: the order of a
        KV message's payload, for a transport that receives straight into the blocks.
        None for a pool that is not one contiguous tensor in host memory."""
        if self.pool.device.type != "cpu" or not self.pool.is_contiguous():
            return None
        if self._bytes is None:
            self._bytes = memoryview(self.pool.view(torch.uint8).reshape(-1).numpy())  # type: ignore[arg-type]
        runs = slot_runs(block_ids, start, count, self.block_size)
        plane, tb = self.num_blocks * self.block_size, self.token_bytes
        out = []
        for kv in (0, 1):
            base = (layer * 2 + kv) * plane
            for slot, _, m in runs:
                off = (base + slot) * tb
                out.append(self._bytes[off : off + m * tb])
        return out

    def read(
        self, layer: int, block_ids: list[int], start: int, count: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens' K and V, gathered (copies) from the blocks."""
        slots = self.slots(block_ids, start, count).to(self.pool.device)
        flat = self.pool[layer].view(2, self.num_blocks * self.block_size, self.kv_heads, -1)
        return flat[0].index_select(0, slots), flat[1].index_select(0, slots)

    def block_address(self, layer: int, kv: int, block: int) -> int:
        """Byte address of the start of (layer, K|V, block), for zero-copy backends."""
        return int(self.pool[layer, kv, block].data_ptr())


def as_bytes(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a CPU tensor (any dtype); copies to host only from a GPU."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


def owned(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when it is a fresh contiguous tensor (no view of anything else, such as
    the engine's pool), else a copy: what a transport may keep without copying again."""
    if t._base is None and t.is_contiguous() and not t.requires_grad:
        return t
    return t.detach().clone(memory_format=torch.contiguous_format)

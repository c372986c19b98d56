"""The paged KV pool: one preallocated tensor and the block allocator over it.

Layout ``LKBTHD-v1``: ``pool`` is shaped ``[num_layers, 2, num_blocks, block_size,
num_kv_heads, head_dim]`` (index 0 of the second axis holds K, 1 holds V), contiguous, so
one (layer, K|V, block) slice is one contiguous run of ``block_size * kv_heads * head_dim``
elements. A token at position ``p`` of a sequence lives in slot
``block_table[p // block_size] * block_size + p % block_size``.

With ``scratch_blocks`` the pool holds that many more blocks past the allocator's: padding
rows of a decode step run from static buffers (:mod:`.decode_graphs`) write their K/V
there, where no sequence reads.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from splitserve_worker.engine.block_pool import BlockPool

KV_LAYOUT = "LKBTHD-v1"


def bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return num_layers * 2 * block_size * num_kv_heads * head_dim * elem


class KVCache:
    """The pool tensor plus its :class:`BlockPool` (``free_blocks`` is exact)."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        max_events: int = 100_000,
        scratch_blocks: int = 0,
    ) -> None:
        self.num_layers = num_layers
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        # zeros, not empty: padded attention reads of unused slots must be finite
        self.pool = torch.zeros(
            (num_layers, 2, num_blocks + scratch_blocks, block_size, num_kv_heads, head_dim),
            dtype=dtype,
            device=self.device,
        )
        self.blocks = BlockPool(num_blocks, max_events=max_events)
        self.scratch_slot: int | None = num_blocks * block_size if scratch_blocks else None
        """A slot no sequence reads (in the first scratch block), when there is one."""
        slots = (num_blocks + scratch_blocks) * block_size
        self._flat = [
            (
                self.pool[i, 0].view(slots, num_kv_heads, head_dim),
                self.pool[i, 1].view(slots, num_kv_heads, head_dim),
            )
            for i in range(num_layers)
        ]

    @property
    def total_blocks(self) -> int:
        return self.blocks.total_blocks

    @property
    def free_blocks(self) -> int:
        return self.blocks.free_blocks

    @property
    def used_blocks(self) -> int:
        return self.blocks.used_blocks

    @property
    def block_bytes(self) -> int:
        """Bytes of one (layer, K|V, block) slice."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.pool.element_size()

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as ``[num_slots, kv_heads, head_dim]`` views of the pool."""
        return self._flat[layer]

    def layer_blocks(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as ``[num_blocks, block_size, kv_heads, head_dim]`` views."""
        return self.pool[layer, 0], self.pool[layer, 1]

    def slots(self, block_table: Sequence[int], start: int, end: int) -> torch.Tensor:
        """Slot ids of positions ``[start, end)`` of a sequence with this block table."""
        bs = self.block_size
        table = torch.tensor(block_table, dtype=torch.long)
        pos = torch.arange(start, end, dtype=torch.long)
        return (table[pos // bs] * bs + pos % bs).to(self.device)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``/``v`` ``[n, kv_heads, head_dim]`` into the given slots of a layer."""
        kf, vf = self._flat[layer]
        kf.index_copy_(0, slots, k.to(self.dtype))
        vf.index_copy_(0, slots, v.to(self.dtype))

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of K/V at the given slots, ``[n, kv_heads, head_dim]``, contiguous."""
        kf, vf = self._flat[layer]
        return kf.index_select(0, slots), vf.index_select(0, slots)

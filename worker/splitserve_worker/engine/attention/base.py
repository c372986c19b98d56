"""What an attention backend is, and what the model runner gives it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class Span:
    """The new tokens of one sequence in a forward: rows ``[lo, hi)`` of the flattened
    batch, at positions ``[start, start + hi - lo)``. Their K/V are already in the pool
    (the runner writes them before attention), as are those of the positions before."""

    lo: int
    hi: int
    start: int
    block_table: Sequence[int]

    @property
    def num_tokens(self) -> int:
        return self.hi - self.lo

    @property
    def end(self) -> int:
        """Context length after this forward: positions ``[0, end)`` are attended to."""
        return self.start + self.hi - self.lo

    @property
    def is_decode(self) -> bool:
        return self.hi - self.lo == 1


@dataclass(frozen=True)
class AttentionShape:
    """What every backend of one engine shares: the model's heads and the pool's layout."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    """Blocks of the pool tensor (a backend may see more than the allocator hands out)."""
    scale: float
    dtype: torch.dtype
    device: torch.device

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads


class AttentionBackend(Protocol):
    """Attention of a batch's query rows over the pool.

    :meth:`plan` is called once per forward (host work: index tensors, masks, shared by
    every layer); :meth:`attend` once per layer, with that plan.
    """

    name: str

    def plan(self, spans: Sequence[Span]) -> Any:
        """Everything the layers need for these spans (in row order, covering all rows)."""
        ...

    def attend(
        self, plan: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        kb: torch.Tensor, vb: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """Attention output ``[T, heads, head_dim]`` of ``q`` ``[T, heads, head_dim]``;
        ``k``/``v`` ``[T, kv_heads, head_dim]`` are the rows' own new K/V (also in the
        pool), ``kb``/``vb`` one layer's pool ``[num_blocks, block_size, kv_heads,
        head_dim]``."""
        ...


@runtime_checkable
class StaticDecodeBackend(AttentionBackend, Protocol):
    """A backend that also keeps, per batch-size bucket, fixed buffers that a decode-only
    plan lives in, so a captured CUDA graph can replay it after :meth:`refill` (decode
    from static buffers, :mod:`..decode_graphs`, needs one)."""

    def static_plan(self, batch: int) -> Any:
        """A decode plan of exactly ``batch`` rows whose tensors stay put (for a graph)."""
        ...

    def refill(self, plan: Any, spans: Sequence[Span]) -> None:
        """Write a decode batch of ``len(spans)`` rows (every span one token) into a
        :meth:`static_plan` of that size, in place."""
        ...

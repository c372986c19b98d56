"""Which part of a model each tensor-parallel rank holds (pure: no torch).

Attention is split by heads: rank ``r`` of ``T`` computes query heads
``[r * H / T, (r + 1) * H / T)``. KV heads split the same way while ``T <= K``; with more
ranks than KV heads each KV head is replicated on ``T / K`` consecutive ranks (the ranks
whose query heads read it), as the field does. The MLP is split by columns of gate/up and
rows of down. Embeddings and ``lm_head`` are replicated.
"""

from __future__ import annotations

from dataclasses import dataclass


class LayoutError(ValueError):
    """A model cannot be split over this many ranks; the message says which sizes do."""


@dataclass(frozen=True)
class TPLayout:
    world: int
    rank: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int

    def __post_init__(self) -> None:
        t, h, k = self.world, self.num_heads, self.num_kv_heads
        if t < 1:
            raise LayoutError(f"--tensor-parallel-size must be >= 1, got {t}")
        if not 0 <= self.rank < t:
            raise LayoutError(f"rank {self.rank} is outside a tensor-parallel group of {t}")
        fits = [d for d in range(1, h + 1) if self._fits(d)]
        if not self._fits(t):
            raise LayoutError(
                f"a model of {h} attention heads, {k} KV heads and an MLP of "
                f"{self.intermediate_size} cannot be split over {t} ranks; "
                f"--tensor-parallel-size may be {', '.join(map(str, fits))}"
            )

    def _fits(self, t: int) -> bool:
        h, k = self.num_heads, self.num_kv_heads
        kv_ok = k % t == 0 if t <= k else t % k == 0
        return h % t == 0 and kv_ok and self.intermediate_size % t == 0

    @property
    def heads_per_rank(self) -> int:
        return self.num_heads // self.world

    @property
    def kv_heads_per_rank(self) -> int:
        return max(1, self.num_kv_heads // self.world)

    @property
    def kv_replicas(self) -> int:
        """Ranks holding each KV head (1 unless ranks outnumber KV heads)."""
        return max(1, self.world // self.num_kv_heads)

    def heads(self, rank: int | None = None) -> range:
        r = self.rank if rank is None else rank
        n = self.heads_per_rank
        return range(r * n, (r + 1) * n)

    def kv_heads(self, rank: int | None = None) -> range:
        """The KV heads rank ``rank`` holds (this rank's by default)."""
        r = self.rank if rank is None else rank
        if self.world <= self.num_kv_heads:
            n = self.kv_heads_per_rank
            return range(r * n, (r + 1) * n)
        first = r // self.kv_replicas
        return range(first, first + 1)

    def kv_owners(self) -> list[int]:
        """One rank per distinct KV head range, in head order: the ranks whose KV pools
        together hold every KV head once."""
        return list(range(0, self.world, self.kv_replicas))

    def columns(self, size: int) -> range:
        """This rank's share of ``size`` columns split evenly (the MLP's)."""
        n = size // self.world
        return range(self.rank * n, (self.rank + 1) * n)

    def describe(self) -> str:
        """The layout, as the compatibility identity and the logs carry it."""
        return f"tp{self.world}-kv{self.kv_heads_per_rank}x{self.kv_replicas}"

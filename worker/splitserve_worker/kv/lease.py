"""Reservations on a decode worker, held under a lease, and what has arrived for each.

Pure bookkeeping with an injected clock: the server frees the blocks of what
:meth:`LeaseTable.expired` and :meth:`LeaseTable.pop` hand back. A reservation moves
RESERVED -> (layers arrive) -> COMMITTED -> ATTACHED (a Generate stream took it over);
it leaves the table when its blocks are handed to the engine's running batch, freed, or
its lease runs out.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from splitserve.v1.worker_pb2 import PromptLogprobs


LEASE_ID_BYTES = 8
"""A lease id is this many random bytes, as hex (16 characters)."""


class LeaseError(Exception):
    """No live reservation matches; the message says which and why."""


class State(StrEnum):
    RESERVED = "reserved"
    COMMITTED = "committed"
    ATTACHED = "attached"


@dataclass
class Lease:
    request_id: str
    lease_id: str
    block_ids: list[int]
    num_tokens: int
    num_layers: int
    expires_at: float
    backend: str
    ttl: float = 0.0
    state: State = State.RESERVED
    kv_heads: int = 1
    """KV heads of the pool the blocks are in: a span may carry some of them (a prefill
    rank pushing only its own heads); each layer is complete once every head's tokens
    came."""
    head_tokens: list[list[int]] = field(default_factory=list)
    """Tokens arrived per layer, per head of the pool."""
    bytes_received: int = 0
    first_token: int = -1
    first_logprob: float = 0.0
    first_top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None
    """The Commit's prompt scores, for the first chunk of the stream."""

    def __post_init__(self) -> None:
        if self.kv_heads < 1:
            raise ValueError(f"a lease's pool has at least one KV head, got {self.kv_heads}")
        if not self.head_tokens:
            self.head_tokens = [[0] * self.kv_heads for _ in range(self.num_layers)]

    @property
    def layer_tokens(self) -> list[int]:
        """Tokens arrived per layer, in every head."""
        return [min(heads) for heads in self.head_tokens]

    @property
    def layers_complete(self) -> int:
        return self.layers_complete_over(None)

    def layers_complete_over(self, heads: range | None) -> int:
        """Layers whose every token arrived in ``heads`` of the pool (None: in all of
        them): what one push of some heads acknowledges."""
        sel = slice(None) if heads is None else slice(heads.start, heads.stop)
        return sum(1 for per in self.head_tokens if min(per[sel], default=0) >= self.num_tokens)

    @property
    def complete(self) -> bool:
        return self.layers_complete == self.num_layers


class LeaseTable:
    """Thread-safe: the gRPC handlers, the transports and the reaper all touch it."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._by_request: dict[str, Lease] = {}
        self._by_lease: dict[str, Lease] = {}

    def now(self) -> float:
        """The table's clock (seconds, monotonic): what expiries are measured on. The
        handoff and the reaper read time here, so a test can move it."""
        return self._clock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_request)

    def add(
        self,
        request_id: str,
        block_ids: list[int],
        *,
        num_tokens: int,
        num_layers: int,
        ttl: float,
        backend: str,
        kv_heads: int = 1,
        lease_id: str | None = None,
    ) -> Lease:
        """``kv_heads``: the heads of the pool the blocks are in (spans may carry some of
        them). ``lease_id``: the id another table gave the same reservation (a decode
        worker's other tensor-parallel ranks mirror rank 0's); a fresh random one by
        default."""
        if ttl <= 0:
            raise ValueError(f"lease ttl must be > 0 seconds, got {ttl}")
        lease_id = lease_id or secrets.token_hex(LEASE_ID_BYTES)
        lease = Lease(
            request_id=request_id,
            lease_id=lease_id,
            block_ids=list(block_ids),
            num_tokens=num_tokens,
            num_layers=num_layers,
            expires_at=self._clock() + ttl,
            backend=backend,
            ttl=ttl,
            kv_heads=kv_heads,
        )
        with self._lock:
            if request_id in self._by_request:
                raise LeaseError(f"request {request_id!r} already holds a reservation")
            if lease_id in self._by_lease:  # 64 random bits: never in practice
                raise LeaseError(f"lease id {lease_id} is taken: Reserve again")
            self._by_request[request_id] = lease
            self._by_lease[lease_id] = lease
        return lease

    def contains(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._by_request

    def holds(self, lease: Lease) -> bool:
        """Whether ``lease`` is still the table's reservation for its request."""
        with self._lock:
            return self._by_request.get(lease.request_id) is lease

    def find(self, lease_id: str) -> Lease:
        """The live reservation holding ``lease_id`` (what a KV connection names), as
        :meth:`get` checks it."""
        with self._lock:
            lease = self._by_lease.get(lease_id)
        if lease is None:
            raise LeaseError(
                f"no reservation holds lease {lease_id!r} (never reserved, released, or "
                "expired): Reserve again"
            )
        return self.get(lease.request_id, lease_id)

    def get(self, request_id: str, lease_id: str | None = None) -> Lease:
        with self._lock:
            lease = self._by_request.get(request_id)
        if lease is None:
            raise LeaseError(
                f"no reservation for request {request_id!r} (never reserved, released, "
                "or its lease expired): Reserve again"
            )
        if lease_id is not None and lease.lease_id != lease_id:
            raise LeaseError(
                f"request {request_id!r} holds lease {lease.lease_id}, not {lease_id}: "
                "the handle is stale; Reserve again"
            )
        if self._clock() >= lease.expires_at and lease.state is not State.ATTACHED:
            raise LeaseError(f"the lease of request {request_id!r} expired: Reserve again")
        return lease

    @staticmethod
    def _check_range(lease: Lease, layer: int, start: int, count: int, heads: range) -> None:
        if not 0 <= heads.start < heads.stop <= lease.kv_heads:
            raise LeaseError(
                f"KV heads {heads.start}..{heads.stop} out of range for a pool of {lease.kv_heads}"
            )
        if not 0 <= layer < lease.num_layers:
            raise LeaseError(f"layer {layer} out of range 0..{lease.num_layers - 1}")
        if start < 0 or count < 0 or start + count > lease.num_tokens:
            raise LeaseError(
                f"tokens {start}..{start + count} out of range for a "
                f"{lease.num_tokens}-token reservation"
            )

    def record(
        self, lease: Lease, layer: int, start: int, count: int, nbytes: int, *, renew: bool = False
    ) -> None:
        """Tokens up to ``start + count`` of ``layer`` arrived (cumulative ends, in order
        per layer, as NIXL notifies them).

        ``renew``: the lease runs for its full TTL again from now (a push that keeps
        arriving is alive; only one that stops for a TTL is given up)."""
        self._arrived(lease, layer, start, count, nbytes, renew, None, cumulative=True)

    def add_span(
        self,
        lease: Lease,
        layer: int,
        start: int,
        count: int,
        nbytes: int,
        *,
        renew: bool = False,
        heads: range | None = None,
    ) -> None:
        """Tokens ``[start, start + count)`` of ``layer`` arrived in ``heads`` of the pool
        (None: in every head), in any order: those heads' counts grow by ``count`` (a push
        spread over several streams delivers a layer's spans out of order, and pushes of
        different heads arrive side by side; each span arrives once). ``renew`` as in
        :meth:`record`."""
        self._arrived(lease, layer, start, count, nbytes, renew, heads, cumulative=False)

    def _arrived(
        self,
        lease: Lease,
        layer: int,
        start: int,
        count: int,
        nbytes: int,
        renew: bool,
        heads: range | None,
        *,
        cumulative: bool,
    ) -> None:
        heads = range(lease.kv_heads) if heads is None else heads
        self._check_range(lease, layer, start, count, heads)
        with self._lock:
            per = lease.head_tokens[layer]
            for h in heads:
                if cumulative:
                    per[h] = max(per[h], start + count)
                else:
                    per[h] = min(lease.num_tokens, per[h] + count)
            lease.bytes_received += nbytes
            if renew:
                lease.expires_at = max(lease.expires_at, self._clock() + lease.ttl)

    def mark_all_layers(self, lease: Lease) -> None:
        with self._lock:
            lease.head_tokens = [[lease.num_tokens] * lease.kv_heads
                                 for _ in range(lease.num_layers)]  # fmt: skip

    def commit(
        self,
        lease: Lease,
        first_token: int,
        first_logprob: float,
        first_top_logprobs: list[tuple[int, float]] | None = None,
        prompt_logprobs: PromptLogprobs | None = None,
    ) -> None:
        with self._lock:
            lease.state = State.COMMITTED
            lease.first_token = first_token
            lease.first_logprob = first_logprob
            lease.first_top_logprobs = list(first_top_logprobs or ())
            lease.prompt_logprobs = prompt_logprobs

    def attach(self, lease: Lease) -> None:
        with self._lock:
            lease.state = State.ATTACHED

    def pop(self, request_id: str) -> Lease | None:
        with self._lock:
            lease = self._by_request.pop(request_id, None)
            if lease is not None:
                self._by_lease.pop(lease.lease_id, None)
            return lease

    def expired(self) -> list[Lease]:
        """Remove and return every lease past its expiry (attached ones live on)."""
        now = self._clock()
        with self._lock:
            gone = [
                lease
                for lease in self._by_request.values()
                if now >= lease.expires_at and lease.state is not State.ATTACHED
            ]
            for lease in gone:
                del self._by_request[lease.request_id]
                self._by_lease.pop(lease.lease_id, None)
        return gone

    def leases(self) -> list[Lease]:
        with self._lock:
            return list(self._by_request.values())

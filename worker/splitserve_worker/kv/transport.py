"""The KV transport interface and the registry that picks a backend by name.

A backend has two roles, each its own small interface:

- prefill side, :class:`SenderBackend`: ``open(target)`` gives a :class:`KVSender` for one
  request. The engine's layer-wise prefill calls ``send_layer`` as soon as each layer is
  computed (on the engine thread: it must copy what it keeps and return quickly; the push
  itself runs on another thread so it overlaps the next layer's compute); ``finish``
  waits until the decode side holds every layer; ``abort`` stops early.
- decode side, :class:`ReceiverBackend`: what a ``Reserve`` answer carries for this backend
  (``backend_metadata``), and ``wait_layers`` at ``Commit`` until every layer of a lease
  has landed in its reserved blocks.

Backends (``tcp``, ``grpc``, ``nixl``) are registered by name with the factories that
build each side, and imported only when first asked for, so a worker that never uses
NIXL never imports it. Registering a name twice is refused.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from splitserve.kv_compat import Compat

from splitserve_worker.kv.faults import FaultConfig
from splitserve_worker.kv.lease import Lease, LeaseTable

if TYPE_CHECKING:
    import torch
    from splitserve.tls import TlsConfig

    from splitserve_worker.kv.layout import PoolView


class TransferError(Exception):
    """A KV transfer failed; ``reason`` is a short label for metrics."""

    def __init__(self, message: str, reason: str = "error") -> None:
        super().__init__(message)
        self.reason = reason


class BackendUnavailable(Exception):
    """The backend's dependencies are missing here; the message says how to install them."""


@dataclass(frozen=True)
class RankTarget:
    """One tensor-parallel rank of a decode worker: the KV heads ``[kv_head_start,
    kv_head_stop)`` its own pool holds, and what reaches that pool."""

    rank: int
    kv_head_start: int
    kv_head_stop: int
    backend_metadata: bytes


@dataclass(frozen=True)
class TransferTarget:
    """The prefill side's view of a decode worker's reservation (from the handle)."""

    request_id: str
    lease_id: str
    decode_address: str
    block_ids: tuple[int, ...]
    num_tokens: int
    compat_hash: str
    backend_metadata: bytes = b""
    deadline_unix: float = 0.0
    kv_ranks: tuple[RankTarget, ...] = ()
    """The decode worker's ranks when its pool is split over them (:mod:`.head_split`
    pushes each its heads); empty: one pool of every head."""
    pool_heads: range | None = None
    """The KV heads of the receiving pool this push carries (a prefill rank's own, into a
    pool that holds more: :mod:`.head_split`); None: every head of it."""


@dataclass
class SendStats:
    layers_sent: int = 0
    bytes_sent: int = 0
    first_send: float = 0.0
    """``time.monotonic()`` when the first layer was handed over."""
    done: float = 0.0
    """``time.monotonic()`` when the decode side acknowledged the last layer."""
    layer_crc32: list[int] = field(default_factory=list)
    """K then V crc32 per layer (empty when checksums are off)."""


@runtime_checkable
class KVSender(Protocol):
    def send_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor, start_token: int) -> None:
        """Hand over tokens ``[start_token, start_token + len(k))`` of ``layer``.

        Called on the engine thread, once per layer span, layers in order. Copies what it
        keeps before returning. After a failure it does nothing (``finish`` raises)."""
        ...

    def finish(self, timeout: float) -> SendStats:
        """Block until the decode side holds every layer sent; raise TransferError if not."""
        ...

    def abort(self, reason: str) -> None:
        """Stop the push; safe to call more than once and after ``finish``."""
        ...


class SenderBackend(Protocol):
    name: str

    def open(self, target: TransferTarget) -> KVSender: ...

    def close(self) -> None: ...


class ReceiverBackend(Protocol):
    name: str

    def backend_metadata(self) -> bytes:
        """Carried in the Reserve handle; what a sender needs to reach the pool."""
        ...

    def wait_layers(self, lease: Lease, timeout: float) -> bool:
        """Block until every layer of ``lease`` has landed; False on timeout."""
        ...

    def forget(self, lease: Lease) -> None:
        """The lease is gone (committed, released or expired): drop what refers to it."""
        ...

    def close(self) -> None: ...


SPAN_BACKENDS = ("tcp", "grpc")
"""Backends whose spans arrive through the worker's own code (a push is open while a
connection or call carries them; the others write into the blocks by themselves): the
ones whose ports every tensor-parallel rank of a decode worker serves into its own pool."""

MAX_STREAMS = 8
"""Most concurrent connections one push may use."""


@dataclass(frozen=True)
class BackendContext:
    """What a backend is built from, on either side."""

    compat: Compat
    token: str = ""
    checksums: bool = False
    """Every span carries its crc32, and each layer's is checked again at Commit."""
    checksum_every: int = 0
    """With ``checksums`` off: one span in this many (counted over every push of the
    backend, so short pushes are sampled too) carries its crc32, which the receiver checks
    before the KV is used; 0: none. ``tcp`` and ``grpc`` only (``nixl`` writes the pool
    directly: only ``checksums`` checks it)."""
    faults: FaultConfig = field(default_factory=FaultConfig)
    pool: PoolView | None = None
    leases: LeaseTable | None = None
    name_hint: str = "splitserve"
    """A stable, unique-per-process name (NIXL agent names are built from it)."""
    streams: int = 0
    """Concurrent connections one push uses (``tcp``, ``grpc``); 0: chosen by the core
    count, up to :data:`MAX_STREAMS`."""
    tls: TlsConfig | None = None
    """TLS for pushes: the ``tcp`` backend's connections and the ``grpc`` backend's
    channels (``None``: plain)."""
    clock: Callable[[], float] = time.monotonic
    """What a sender measures a lease's remaining time on (the decode side uses its
    lease table's clock)."""


@dataclass(frozen=True)
class _Entry:
    sender: str
    """``module:factory`` building the prefill side from a :class:`BackendContext`."""
    receiver: str
    """``module:factory`` building the decode side."""


_REGISTRY: dict[str, _Entry] = {}


def register_backend(name: str, *, sender: str, receiver: str) -> None:
    """Make backend ``name`` available, built by the ``module:factory`` named for each
    side; no duplicates."""
    if name in _REGISTRY:
        raise ValueError(f"KV backend {name!r} is already registered (by {_REGISTRY[name]})")
    _REGISTRY[name] = _Entry(sender, receiver)


def backend_names() -> list[str]:
    return sorted(_REGISTRY)


def _entry(name: str) -> _Entry:
    entry = _REGISTRY.get(name)
    if entry is None:
        raise ValueError(f"unknown KV backend {name!r}: choose one of {backend_names()}")
    return entry


def _load(path: str) -> Callable[[BackendContext], object]:
    module, _, attr = path.partition(":")
    fn: Callable[[BackendContext], object] = getattr(importlib.import_module(module), attr)
    return fn


def create_sender_backend(name: str, ctx: BackendContext) -> SenderBackend:
    backend = _load(_entry(name).sender)(ctx)
    return backend  # type: ignore[return-value]


def create_receiver_backend(name: str, ctx: BackendContext) -> ReceiverBackend:
    if ctx.pool is None or ctx.leases is None:
        raise ValueError("a receiving KV backend needs the pool and the lease table")
    backend = _load(_entry(name).receiver)(ctx)
    return backend  # type: ignore[return-value]


def unavailable_reason(name: str) -> str | None:
    """None if backend ``name`` can be used here, else why not (its sender's module may
    say, with ``unavailable_reason()``)."""
    if name not in _REGISTRY:
        return f"unknown KV backend {name!r}: choose one of {backend_names()}"
    module = importlib.import_module(_REGISTRY[name].sender.partition(":")[0])
    check = getattr(module, "unavailable_reason", None)
    return check() if check is not None else None


register_backend("tcp", sender="splitserve_worker.kv.tcp_sender:TcpSenderBackend",
                 receiver="splitserve_worker.kv.span_receiver:make_tcp_receiver")  # fmt: skip
register_backend("grpc", sender="splitserve_worker.kv.grpc_sender:GrpcSenderBackend",
                 receiver="splitserve_worker.kv.span_receiver:make_grpc_receiver")  # fmt: skip
register_backend("nixl", sender="splitserve_worker.kv.nixl_backend:make_sender_backend",
                 receiver="splitserve_worker.kv.nixl_backend:make_receiver_backend")  # fmt: skip

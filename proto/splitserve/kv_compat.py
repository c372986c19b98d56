"""What a KV cache is, and the check two workers make before any of its bytes move.

Two workers can exchange KV blocks only when every field that shapes a block agrees:
model identity, dtype, block size, layers, KV heads, head dim and KV layout (the fields
a ``splitserve.v1.CompatInfo`` carries). Each side also hashes the checkpoint's own
shape (architecture, vocabulary, hidden size: :data:`IDENTITY_FIELDS`) into its hash, so
two checkpoints saved under one name still differ. When two hashes differ the error
names each differing field with both sides' values, so an operator sees at once which
flag or checkpoint to fix.

The engine builds its identity here (``compat_info`` -> :func:`compat_hash`), the KV
backends carry and check it. Standard library only.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

FIELDS = ("model", "dtype", "block_size", "num_layers", "kv_heads", "head_dim", "kv_layout")
"""Carried on the wire beside the hash, and named when two workers differ."""
IDENTITY_FIELDS = ("architecture", "vocab_size", "hidden_size")
"""Hashed when known (an engine knows them), never carried: a difference only in these
shows as the hash alone."""


class CompatError(Exception):
    """Two workers' KV caches are not interchangeable; the message names the difference."""


def compat_hash(fields: Mapping[str, Any]) -> str:
    """sha256 over the canonical JSON of :data:`FIELDS` and whichever of
    :data:`IDENTITY_FIELDS` ``fields`` holds."""
    missing = [f for f in FIELDS if f not in fields]
    if missing:
        raise CompatError(f"compat fields lack {missing}; they have {sorted(fields)}")
    keys = [*FIELDS, *(f for f in IDENTITY_FIELDS if f in fields)]
    canon = json.dumps({k: fields[k] for k in keys}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()


@dataclass(frozen=True)
class Compat:
    model: str
    dtype: str
    block_size: int
    num_layers: int
    kv_heads: int
    head_dim: int
    kv_layout: str
    hash: str = ""
    """Given by the worker that owns the cache (its own :func:`compat_hash`); computed
    from the fields above when left empty."""

    def __post_init__(self) -> None:
        if not self.hash:
            object.__setattr__(self, "hash", compat_hash(self.fields()))

    def fields(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("hash")
        return d

    @classmethod
    def from_mapping(cls, info: Mapping[str, Any]) -> Compat:
        """From an engine's ``compat_info()``: its fields, and the hash over all it holds."""
        hash_ = compat_hash(info)
        return cls(
            model=str(info["model"]),
            dtype=str(info["dtype"]),
            block_size=int(info["block_size"]),
            num_layers=int(info["num_layers"]),
            kv_heads=int(info["kv_heads"]),
            head_dim=int(info["head_dim"]),
            kv_layout=str(info["kv_layout"]),
            hash=hash_,
        )


def differences(local: Compat, remote: Compat) -> list[str]:
    """``field: this worker=<a>, peer=<b>`` for each field that differs."""
    out = []
    lf, rf = local.fields(), remote.fields()
    for name in FIELDS:
        if lf[name] != rf[name]:
            out.append(f"{name}: this worker={lf[name]!r}, peer={rf[name]!r}")
    return out


def check(local: Compat, remote: Compat, *, peer: str = "peer") -> None:
    """Raise :class:`CompatError` naming every difference unless the two caches agree."""
    if local.hash == remote.hash:
        return
    diffs = differences(local, remote)
    if not diffs:
        diffs = [
            f"hash: this worker={local.hash[:16]}, peer={remote.hash[:16]} (same fields: the "
            "checkpoints differ in architecture, vocabulary or hidden size)"
        ]
    raise CompatError(
        f"KV caches are incompatible with {peer}: "
        + "; ".join(d.replace("peer=", f"{peer}=") for d in diffs)
        + ". Start both workers with the same model, --dtype and --block-size."
    )

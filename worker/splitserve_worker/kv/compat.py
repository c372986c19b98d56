"""The compatibility check made before any KV moves between two workers.

Two workers can exchange KV blocks only when every field that shapes a block agrees:
model identity, dtype, block size, layers, KV heads, head dim and KV layout. Each side
carries a hash over a canonical form of these fields; when the hashes differ, the error
names each differing field with both sides' values, so an operator can see at once which
flag or checkpoint to fix.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

FIELDS = ("model", "dtype", "block_size", "num_layers", "kv_heads", "head_dim", "kv_layout")


class CompatError(Exception):
    """Two workers' KV caches are not interchangeable; the message names the difference."""


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

    def __post_init__(self) -> None:
        if not self.hash:
            object.__setattr__(self, "hash", compat_hash(self.fields()))

    def fields(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("hash")
        return d

    @classmethod
    def from_mapping(cls, info: Mapping[str, Any], hash_: str = "") -> Compat:
        """From an engine's ``compat_info()`` (extra keys ignored) and optionally its hash."""
        missing = [f for f in FIELDS if f not in info]
        if missing:
            raise CompatError(f"compat info lacks {missing}; it has {sorted(info)}")
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


def compat_hash(fields: Mapping[str, Any]) -> str:
    """sha256 over the canonical JSON of the compat fields."""
    canon = json.dumps({k: fields[k] for k in FIELDS}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()


def differences(local: Compat, remote: Compat) -> list[str]:
    """``field: local=<a> remote=<b>`` for each field that differs."""
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
        diffs = [f"hash: this worker={local.hash[:16]}, peer={remote.hash[:16]} (same fields)"]
    raise CompatError(
        f"KV caches are incompatible with {peer}: "
        + "; ".join(d.replace("peer=", f"{peer}=") for d in diffs)
        + ". Start both workers with the same model, --dtype and --block-size."
    )

"""The worker's settings, typed and checked when built."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from splitserve_worker.kv.faults import FaultConfig
from splitserve_worker.kv.transport import MAX_STREAMS

Role = Literal["prefill", "decode", "both"]
ROLES: tuple[Role, ...] = ("prefill", "decode", "both")
KV_BACKENDS = ("grpc", "nixl")


class ConfigError(ValueError):
    """A worker setting is out of range; the message names the flag."""


@dataclass(frozen=True)
class WorkerConfig:
    role: Role
    """``prefill`` runs prompts and pushes KV; ``decode`` reserves, receives and decodes;
    ``both`` does everything (the colocated baseline) and also accepts remote KV."""
    model: str
    """Built-in model name or a Hugging Face checkpoint folder."""
    token: str = field(repr=False, default="")
    """Shared secret every call must carry; never printed."""
    port: int = 0
    """gRPC port; 0 picks a free one (printed in the READY line)."""
    host: str = "127.0.0.1"
    advertise_address: str | None = None
    """``host:port`` others use to reach this worker (put in Reserve handles); default
    ``host:port``."""
    metrics_port: int | None = None
    """Prometheus ``/metrics`` port; ``None`` serves no metrics."""
    dtype: str = "auto"
    device: str | None = None
    kv_backend: str = "grpc"
    """How this worker pushes KV (prefill) and what Reserve offers by default (decode)."""
    lease_seconds: float = 30.0
    """How long reserved blocks wait for their KV and Commit before they are freed."""
    block_size: int = 16
    kv_cache_memory: int | None = None
    num_blocks: int | None = None
    threads: int | None = None
    """torch CPU threads; on small machines give each worker its own share."""
    checksums: bool = False
    """Per-layer crc32 on the KV stream and at Commit (catches corruption; costs a pass)."""
    kv_streams: int = 0
    """Concurrent connections a ``grpc`` push uses; 0 chooses by core count (2 on 8 or
    more, else 1)."""
    max_num_seqs: int = 64
    max_batch_tokens: int = 2048
    prefill_chunk_tokens: int = 512
    gpu_memory_fraction: float = 0.5
    """Share of the GPU memory free after the weights that the KV pool takes (unless
    ``kv_cache_memory`` or ``num_blocks``)."""
    faults: FaultConfig = field(default_factory=FaultConfig)
    transfer_timeout_s: float = 120.0
    """Longest a prefill worker waits for the decode side to acknowledge a push."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"--role must be one of {ROLES}, got {self.role!r}")
        if self.kv_backend not in KV_BACKENDS:
            raise ConfigError(f"--kv-backend must be one of {KV_BACKENDS}, got {self.kv_backend!r}")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"--port must be in [0, 65535], got {self.port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ConfigError(f"--metrics-port must be in [0, 65535], got {self.metrics_port}")
        if not self.lease_seconds > 0:
            raise ConfigError(f"--lease-seconds must be > 0, got {self.lease_seconds}")
        if self.block_size < 1:
            raise ConfigError(f"--block-size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"--num-blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ConfigError(f"--kv-cache-memory must be > 0 bytes, got {self.kv_cache_memory}")
        if not 0 <= self.kv_streams <= MAX_STREAMS:
            raise ConfigError(
                f"--kv-streams must be 0 (by core count) to {MAX_STREAMS}, got {self.kv_streams}"
            )
        if self.max_num_seqs < 1:
            raise ConfigError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_batch_tokens < self.max_num_seqs:
            raise ConfigError(
                f"--max-batch-tokens ({self.max_batch_tokens}) must be >= --max-num-seqs "
                f"({self.max_num_seqs}): every running sequence decodes in one step"
            )
        if self.prefill_chunk_tokens < 1:
            raise ConfigError(
                f"--prefill-chunk-tokens must be >= 1, got {self.prefill_chunk_tokens}"
            )
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ConfigError(
                f"--gpu-memory-fraction must be in (0, 1], got {self.gpu_memory_fraction}"
            )
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {self.threads}")
        if not self.token:
            raise ConfigError(
                "a worker token is required (--token-file or SPLITSERVE_WORKER_TOKEN)"
            )

    @property
    def serves_decode(self) -> bool:
        return self.role in ("decode", "both")

    @property
    def serves_prefill(self) -> bool:
        return self.role in ("prefill", "both")

    def engine_config(self) -> object:
        from splitserve_worker.engine.config import EngineConfig

        return EngineConfig(
            block_size=self.block_size,
            kv_cache_memory=self.kv_cache_memory,
            num_blocks=self.num_blocks,
            max_num_seqs=self.max_num_seqs,
            max_batch_tokens=self.max_batch_tokens,
            prefill_chunk_tokens=self.prefill_chunk_tokens,
            gpu_memory_fraction=self.gpu_memory_fraction,
            dtype=self.dtype,
            device=self.device,
            num_threads=self.threads,
            role=self.role,
        )

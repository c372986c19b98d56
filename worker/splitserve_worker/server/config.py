"""The worker's settings, typed and checked when built."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Literal

from splitserve.tls import TlsConfig, TlsError

from splitserve_worker.kv.faults import FaultConfig
from splitserve_worker.kv.transport import MAX_STREAMS

Role = Literal["prefill", "decode", "both"]
ROLES: tuple[Role, ...] = ("prefill", "decode", "both")
DEFAULT_CHECKSUM_EVERY = 64
"""Spans of KV per sampled crc32 by default: one span (about 4 MiB) in 64."""
KV_BACKENDS = ("tcp", "grpc", "nixl")
"""``tcp``: the fast path (one copy from the socket into the blocks); ``grpc``: grpcio's
own PushKV, for any gRPC peer; ``nixl``: NVIDIA NIXL (RDMA where the hardware has it)."""


class ConfigError(ValueError):
    """A worker setting is out of range; the message names the flag."""


ENGINE_FLAGS = {
    "block_size": "--block-size", "kv_cache_memory": "--kv-cache-memory",
    "num_blocks": "--num-blocks", "max_num_seqs": "--max-num-seqs",
    "max_batch_tokens": "--max-batch-tokens", "prefill_chunk_tokens": "--prefill-chunk-tokens",
    "gpu_memory_fraction": "--gpu-memory-fraction", "num_threads": "--threads",
    "dtype": "--dtype", "attention_backend": "--attention-backend",
}  # fmt: skip
"""The engine's settings and the worker flags that set them."""


def _as_flags(message: str) -> str:
    """An engine config error with its field names as the worker's flags."""
    return re.sub(r"\b(" + "|".join(ENGINE_FLAGS) + r")\b", lambda m: ENGINE_FLAGS[m[1]], message)


TP_ALLREDUCE = ("auto", "gloo", "shm", "nccl")


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
    kv_port: int = 0
    """Port of the decode side's ``tcp`` KV server; 0 picks a free one (Reserve answers
    name it). A decode worker's other tensor-parallel ranks take the ports after it
    (:func:`~.rank_kv.rank_port`)."""
    dtype: str = "auto"
    device: str | None = None
    kv_backend: str = "tcp"
    """How this worker pushes KV (prefill) and what Reserve offers by default (decode)."""
    lease_seconds: float = 30.0
    """How long reserved blocks wait for their KV and Commit before they are freed (a
    Reserve that asks for no lease of its own)."""
    max_lease_seconds: float = 300.0
    """Longest lease a Reserve gets, whatever it asks for (``lease_seconds`` when that is
    longer): a caller cannot hold blocks until the worker restarts."""
    block_size: int = 16
    kv_cache_memory: int | None = None
    num_blocks: int | None = None
    threads: int | None = None
    """torch CPU threads; on small machines give each worker its own share."""
    checksums: bool = False
    """crc32 on every span of the KV stream and per layer at Commit (catches any
    corruption; costs a pass over all the KV)."""
    checksum_every: int = DEFAULT_CHECKSUM_EVERY
    """With ``checksums`` off, one span in this many carries its crc32 (``tcp``, ``grpc``),
    checked before the KV is used: a link or a memory that corrupts bytes is seen, at a
    cost ``bench/kv_transfer.py`` measures (about 4 MiB checked per 256 MiB moved at the
    default); 0 turns them off. The correctness guard does not depend on them."""
    kv_streams: int = 0
    """Concurrent connections a ``tcp`` or ``grpc`` push uses; 0 chooses by core count (2
    on 8 or more, else 1)."""
    tls: TlsConfig = field(default_factory=TlsConfig)
    """TLS on this worker's gRPC and KV ports (certificate and key; ``mutual``: clients'
    certificates checked too) and on its calls to other workers (the CA: Commit, Release
    and KV pushes); plain when empty (see :mod:`splitserve.tls`)."""
    max_num_seqs: int = 64
    max_batch_tokens: int = 2048
    prefill_chunk_tokens: int = 512
    gpu_memory_fraction: float = 0.5
    """Share of the GPU memory free after the weights that the KV pool takes (unless
    ``kv_cache_memory`` or ``num_blocks``)."""
    drain_seconds: float = 2.0
    """On SIGTERM: how long running calls may go on before the worker exits."""
    faults: FaultConfig = field(default_factory=FaultConfig)
    transfer_timeout_s: float = 120.0
    """Longest a prefill worker waits for the decode side to acknowledge a push."""
    attention_backend: str = "auto"
    """``auto``, ``sdpa``, ``flex`` or ``flashinfer`` (see the engine's config)."""
    cuda_graphs: bool = True
    """Replay decode steps as CUDA graphs on CUDA (``--no-cuda-graphs`` turns it off)."""
    tensor_parallel_size: int = 1
    """Rank processes one engine runs over (each with its share of the heads and MLP)."""
    tp_allreduce: str = "auto"
    """How the ranks all-reduce: ``auto`` (NCCL on CUDA, shared memory on the CPU),
    ``gloo``, ``shm`` or ``nccl``."""
    switchable: bool = False
    """Hold the parts of both roles so that SwitchRole can change ``role`` in place (the
    decode side's KV port is open whatever the role); off, the role is fixed."""
    role_labels_file: str | None = None
    """A downward-API file of the pod's labels: a switchable worker switches itself to
    the role its ``role_label`` names whenever that label changes."""
    role_label: str = "splitserve.io/role"
    labels_poll_seconds: float = 5.0
    """How often the labels file is read for a changed role."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"--role must be one of {ROLES}, got {self.role!r}")
        if self.kv_backend not in KV_BACKENDS:
            raise ConfigError(f"--kv-backend must be one of {KV_BACKENDS}, got {self.kv_backend!r}")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"--port must be in [0, 65535], got {self.port}")
        if not 0 <= self.kv_port < 65536:
            raise ConfigError(f"--kv-port must be in [0, 65535], got {self.kv_port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ConfigError(f"--metrics-port must be in [0, 65535], got {self.metrics_port}")
        if not (self.lease_seconds > 0 and math.isfinite(self.lease_seconds)):
            raise ConfigError(f"--lease-seconds must be > 0, got {self.lease_seconds}")
        if not (self.max_lease_seconds > 0 and math.isfinite(self.max_lease_seconds)):
            raise ConfigError(
                f"--max-lease-seconds must be a finite number > 0, got {self.max_lease_seconds}"
            )
        if not (self.labels_poll_seconds > 0 and math.isfinite(self.labels_poll_seconds)):
            raise ConfigError(
                f"labels_poll_seconds must be a finite number > 0, got {self.labels_poll_seconds}"
            )
        if not 0 <= self.drain_seconds <= 3600:
            raise ConfigError(f"--drain-seconds must be in [0, 3600], got {self.drain_seconds}")
        if self.checksum_every < 0:
            raise ConfigError(
                "--checksum-every must be >= 0 (0: no sampled checksums), "
                f"got {self.checksum_every}"
            )
        if not 0 <= self.kv_streams <= MAX_STREAMS:
            raise ConfigError(
                f"--kv-streams must be 0 (by core count) to {MAX_STREAMS}, got {self.kv_streams}"
            )
        try:  # the files are read now: a wrong one stops the worker before it serves
            self.tls.check()
        except TlsError as e:
            raise ConfigError(str(e)) from None
        if self.tensor_parallel_size < 1:
            raise ConfigError(
                f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}"
            )
        if self.tp_allreduce not in TP_ALLREDUCE:
            raise ConfigError(
                f"--tp-allreduce must be one of {', '.join(TP_ALLREDUCE)}, "
                f"got {self.tp_allreduce!r}"
            )
        try:  # the engine's own checks, said with the flags' names
            self.engine_config()
        except ValueError as e:
            raise ConfigError(_as_flags(str(e))) from None
        if not self.token:
            raise ConfigError(
                "a worker token is required (--token-file or SPLITSERVE_WORKER_TOKEN)"
            )

    @property
    def serves_decode(self) -> bool:
        return self.switchable or self.role in ("decode", "both")

    @property
    def serves_prefill(self) -> bool:
        return self.switchable or self.role in ("prefill", "both")

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
            attention_backend=self.attention_backend,
            cuda_graphs=self.cuda_graphs,
        )

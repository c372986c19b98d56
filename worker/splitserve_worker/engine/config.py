"""Engine settings, checked when constructed."""

from __future__ import annotations

from dataclasses import dataclass

ROLES = ("both", "prefill", "decode")
ATTENTION_BACKENDS = ("auto", "sdpa", "flex", "flashinfer")
"""``auto`` picks the best one available (:mod:`.attention.registry`)."""


@dataclass
class EngineConfig:
    """How one engine runs. Every field is checked in ``__post_init__``."""

    block_size: int = 16
    """Tokens per KV block. 16 keeps internal fragmentation under one block per sequence
    while block tables stay short."""

    kv_cache_memory: int | None = None
    """Bytes for the KV pool. ``None``: a fraction of free GPU memory on CUDA
    (``gpu_memory_fraction``), or ``DEFAULT_CPU_KV_BYTES`` on the CPU."""

    gpu_memory_fraction: float = 0.5
    """Fraction of the GPU memory free after loading the weights that the KV pool takes
    when ``kv_cache_memory`` is not given."""

    num_blocks: int | None = None
    """Exact number of KV blocks; overrides the memory budget (handy in tests)."""

    max_num_seqs: int = 64
    """Most sequences in the running batch at once."""

    max_batch_tokens: int = 2048
    """Most tokens (decode and prefill together) computed in one step."""

    prefill_chunk_tokens: int = 512
    """Prefill tokens per step while sequences are decoding: long prompts are cut into
    chunks of this size so decode steps keep flowing between them. Capped at
    ``max_batch_tokens``."""

    enable_prefix_cache: bool = True
    """Reuse KV blocks of identical prompt prefixes (chained block hashes, LRU eviction)."""

    max_model_len: int | None = None
    """Longest sequence (prompt plus output) in tokens; ``None``: the model's limit."""

    dtype: str = "auto"
    """Weights and KV dtype: ``auto`` (the loaded model's), ``float32``, ``bfloat16``,
    ``float16``. Another dtype (or device) than the loaded model's converts that model in
    place."""

    device: str | None = None
    """``cuda``, ``cpu`` or ``None`` (CUDA when present)."""

    num_threads: int | None = None
    """CPU threads for torch (``torch.set_num_threads``); ``None`` leaves torch's default."""

    cpu_prepack: bool = True
    """On the CPU in float32, also keep the linear weights in oneDNN's prepacked layout,
    q/k/v and gate/up fused: decode steps run about twice as fast, for one more copy of
    the weights in memory. Ignored elsewhere."""

    attention_backend: str = "auto"
    """How attention reads the KV pool: ``sdpa`` (gather + SDPA, every device), ``flex``
    (FlexAttention over the pool in place; compiles per batch bucket), ``flashinfer``
    (CUDA, half precision, when installed), or ``auto``: flex on CUDA, sdpa on the CPU."""

    cuda_graphs: bool = True
    """On CUDA with a paged attention backend (flex), capture each decode batch-size
    bucket's forward once as a CUDA graph and replay it (one launch per step instead of
    hundreds). Ignored elsewhere."""

    static_decode: bool = False
    """Run decode steps from the per-bucket static buffers even without CUDA graphs: what
    a replay runs, eagerly (how the CPU checks the graph path's bookkeeping; it pads each
    step to its bucket). Needs a paged attention backend."""

    role: str = "both"
    """``both``, ``prefill`` or ``decode``: the label on this engine's metrics."""

    max_events: int = 100_000
    """Prefix-cache events kept until drained; the oldest are dropped past this."""

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(
                f"kv_cache_memory must be a positive byte count, got {self.kv_cache_memory}"
            )
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ValueError(
                f"gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction}"
            )
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_batch_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_batch_tokens ({self.max_batch_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so every running sequence can decode in one step"
            )
        if self.prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be >= 1, got {self.prefill_chunk_tokens}")
        self.prefill_chunk_tokens = min(self.prefill_chunk_tokens, self.max_batch_tokens)
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}"
            )
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                f"got {self.attention_backend!r}"
            )
        if self.max_events < 1:
            raise ValueError(f"max_events must be >= 1, got {self.max_events}")


DEFAULT_CPU_KV_BYTES = 512 * 1024 * 1024
"""KV pool size on the CPU when no budget is given: 512 MiB."""

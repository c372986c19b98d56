"""Choosing the attention backend: by name, or the best one available here.

``auto`` takes, on CUDA, :mod:`.flex` (paged, reads the pool in place, replayable in CUDA
graphs) when Triton is there, else :mod:`.sdpa`; on the CPU it takes :data:`CPU_DEFAULT`.
:mod:`.flashinfer` is taken only by name. A paged backend must first give what
:mod:`.sdpa` gives on a few rows written into the pool (:func:`self_check`): ``auto``
falls back to sdpa when it does not, a backend asked for by name fails the start.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve_worker.engine.attention import flashinfer, flex
from splitserve_worker.engine.attention.base import AttentionBackend, AttentionShape, Span
from splitserve_worker.engine.attention.flashinfer import FlashInferAttention
from splitserve_worker.engine.attention.flex import FlexAttention
from splitserve_worker.engine.attention.sdpa import SdpaAttention
from splitserve_worker.engine.config import ATTENTION_BACKENDS

CPU_DEFAULT = "sdpa"
"""What ``auto`` takes on the CPU: sdpa. Measured on two shared cores with the built-in
model (float32) at batch 16: flex's kernel is faster per layer call (0.24 against 0.41
ms over 80 positions; about 1.4 against 9.1 ms, gather included, over 1,024), but whole
decode steps were the same within the noise (85.6 ms both over 64-80 positions, and
127-167 against 127-155 ms over 1,024, one thread, CPU time), prefill runs the same
code in both, and every batch-size bucket costs flex a compile of 6-10 s (seven buckets
for 64 sequences, again for each pool size)."""


class AttentionUnavailable(ValueError):
    """The backend asked for cannot run here; the message says why and what to do."""


@dataclass(frozen=True)
class Selected:
    backend: AttentionBackend
    why: str
    """Why this backend, in words (for the engine's start line)."""


def unavailable_reason(name: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why backend ``name`` cannot run on ``device`` in ``dtype``, or ``None``."""
    if name == "sdpa":
        return None
    if name == "flex":
        return flex.unavailable_reason(device)
    if name == "flashinfer":
        return flashinfer.unavailable_reason(device, dtype)
    return f"unknown attention backend {name!r}: choose one of {', '.join(ATTENTION_BACKENDS)}"


def make(name: str, shape: AttentionShape, max_batch: int) -> AttentionBackend:
    """Backend ``name`` (not ``auto``); raises :class:`AttentionUnavailable`."""
    reason = unavailable_reason(name, shape.device, shape.dtype)
    if reason is not None:
        raise AttentionUnavailable(f"attention backend {name}: {reason}")
    if name == "sdpa":
        return SdpaAttention(shape)
    try:
        if name == "flex":
            return FlexAttention(shape, max_batch)
        return FlashInferAttention(shape)
    except RuntimeError as e:
        raise AttentionUnavailable(f"attention backend {name}: {e}") from e


def select(
    name: str, shape: AttentionShape, max_batch: int, pool: tuple[torch.Tensor, torch.Tensor]
) -> Selected:
    """The backend for ``name`` (``auto`` or a backend's name), checked on ``pool`` (one
    layer's K and V blocks, unused yet: the check writes a few blocks, then zeroes them)."""
    if name not in ATTENTION_BACKENDS:
        raise AttentionUnavailable(
            f"unknown attention backend {name!r}: choose one of {', '.join(ATTENTION_BACKENDS)}"
        )
    if name != "auto":
        backend = make(name, shape, max_batch)
        if backend.name != "sdpa":
            problem = self_check(backend, shape, pool)
            if problem is not None:
                raise AttentionUnavailable(
                    f"attention backend {name} disagrees with sdpa here ({problem}); "
                    "choose --attention-backend sdpa"
                )
        return Selected(backend, "asked for")
    device = shape.device
    if device.type != "cuda":
        if CPU_DEFAULT == "sdpa":
            return Selected(SdpaAttention(shape), f"auto: the {device.type} default")
        choice = CPU_DEFAULT
    else:
        choice = "flex"
    reason = unavailable_reason(choice, device, shape.dtype)
    if reason is not None:
        return Selected(SdpaAttention(shape), f"auto: {choice} unavailable ({reason})")
    try:
        backend = make(choice, shape, max_batch)
    except AttentionUnavailable as e:
        return Selected(SdpaAttention(shape), f"auto: {e}")
    problem = self_check(backend, shape, pool)
    if problem is not None:
        return Selected(SdpaAttention(shape), f"auto: {choice} failed its check ({problem})")
    return Selected(backend, f"auto: paged, on {device.type}")


CHECK_LENGTHS = (1, 17, 40)
"""Context lengths of the check's rows: one position, a partial second block, three blocks."""


def self_check(
    backend: AttentionBackend, shape: AttentionShape, pool: tuple[torch.Tensor, torch.Tensor]
) -> str | None:
    """Compare ``backend`` with sdpa on a few decode rows and one prefill chunk written
    into the first blocks of ``pool``; ``None`` when they agree, else what differed."""
    kb, vb = pool
    bs = shape.block_size
    chunk_start, chunk_len = 20, 3
    lengths = [*CHECK_LENGTHS, chunk_start + chunk_len]
    per = [(n + bs - 1) // bs for n in lengths]
    used = sum(per)
    if used > kb.shape[0]:
        return None  # a pool this small is a test's; nothing to check it on
    gen = torch.Generator(device="cpu").manual_seed(0)
    kb[:used].copy_(torch.randn(kb[:used].shape, generator=gen).to(kb.dtype))
    vb[:used].copy_(torch.randn(vb[:used].shape, generator=gen).to(vb.dtype))
    tables, first = [], 0
    for nblk in per:
        tables.append(list(range(first, first + nblk)))
        first += nblk
    spans = [Span(i, i + 1, n - 1, tables[i]) for i, n in enumerate(CHECK_LENGTHS)]
    rows = len(spans)
    spans.append(Span(rows, rows + chunk_len, chunk_start, tables[-1]))  # after 20 cached
    total = rows + chunk_len
    q = torch.randn((total, shape.num_heads, shape.head_dim), generator=gen).to(
        device=shape.device, dtype=shape.dtype
    )
    k = torch.zeros((total, shape.num_kv_heads, shape.head_dim), device=shape.device,
                    dtype=shape.dtype)  # fmt: skip
    reference = SdpaAttention(shape)
    try:
        plans = reference.plan(spans), backend.plan(spans)  # outside inference mode: the
        # buffers a plan keeps are written again by later steps
        with torch.inference_mode():
            want = reference.attend(plans[0], q, k, k, kb, vb).float()
            got = backend.attend(plans[1], q, k, k, kb, vb).float()
        tol = 1e-4 if shape.dtype == torch.float32 else 3e-2
        err = float((got - want).abs().max())
        if not err <= tol:
            return f"largest difference {err:.3g} > {tol:g}"
        return None
    except (RuntimeError, ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    finally:
        kb[:used].zero_()
        vb[:used].zero_()

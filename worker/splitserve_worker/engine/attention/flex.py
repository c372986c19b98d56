"""FlexAttention over the pool in place: decode rows attend through PyTorch's
``flex_attention`` with each sequence's block table as its block mask, so K/V are read
straight out of the pool's blocks, never gathered.

The pool's ``[num_blocks, block_size, kv_heads, head_dim]`` K (or V) of one layer is seen
as one ``[1, kv_heads, num_blocks * block_size, head_dim]`` sequence (a view). Each decode
row's block mask lists its full blocks (attended whole) and its last, partial block
(masked past the row's length by ``mask_mod``). Queries are folded to
``[B, kv_heads, group, head_dim]`` as in :mod:`.sdpa`. The kernel is compiled once per
batch-size bucket (:mod:`.buckets`) with static shapes; the block-mask tensors of each
bucket are fixed buffers refilled every step, which is also what lets a CUDA graph
replay them.

Prefill rows go through :func:`.sdpa.prefill_attention`: on the CPU, flex over the pool
was slower for prefill than SDPA's fused kernel on gathered K/V (256 rows after 512
cached: 22.6 ms against 13.7 ms per layer call, SmolLM2-135M's heads, two threads), and
prefill is compute-bound, where the gather is a small share.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from splitserve_worker.engine.attention.base import AttentionShape, Span
from splitserve_worker.engine.attention.buckets import batch_buckets, bucket_for
from splitserve_worker.engine.attention.sdpa import Prefill, prefill_attention, prefill_plan

Q_BLOCK = 128
"""Rows of the block mask's query blocks. A folded decode row has ``group`` query rows
(at most this many); Triton's decoding kernel needs a multiple of its 16-row tile."""

CPU_KERNEL_OPTIONS: dict[str, Any] = {"PARTITION_SIZE": 1 << 30}
"""Inductor's C++ flash-decoding template (taken for one-row queries against a long KV)
splits the whole pool's length, not the rows' own blocks, when rows differ in length: a
partition larger than any pool keeps the plain template, which walks only the listed
blocks."""


def unavailable_reason(device: torch.device) -> str | None:
    """Why flex cannot be compiled here, or ``None``."""
    if device.type == "cuda":
        if importlib.util.find_spec("triton") is None:
            return "flex on CUDA compiles through Triton: install triton (it comes with CUDA torch)"
        return None
    if device.type == "cpu":
        compilers = [os.environ.get("CXX", ""), "g++", "c++", "clang++"]
        if not any(c and shutil.which(c) for c in compilers):
            return "flex on the CPU compiles through inductor's C++ backend: install g++"
        return None
    return f"flex runs on CUDA or the CPU, not on {device.type}"


_compiled: Callable[..., Any] | None = None


def compiled_flex() -> Callable[..., Any]:
    """``flex_attention`` compiled with static shapes (one process-wide wrapper: dynamo
    keeps one compiled graph per input shape)."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(flex_attention, dynamic=False)
    return _compiled


def allow_recompiles(shapes: int) -> None:
    """Let dynamo keep ``shapes`` compiled versions of flex before it gives up compiling
    (its default, 8, is fewer than the buckets times the pool shapes one process may use)."""
    import torch._dynamo.config as dynamo_config

    if dynamo_config.recompile_limit < shapes:
        dynamo_config.recompile_limit = shapes


@dataclass
class DecodeBuffers:
    """One bucket's block-mask tensors and query staging; they never move."""

    batch: int
    kv_num: torch.Tensor
    """``[batch, 1, 1]`` int32: partial blocks of each row (0 or 1)."""
    kv_idx: torch.Tensor
    """``[batch, 1, 1, num_blocks]`` int32: the partial block first."""
    full_num: torch.Tensor
    full_idx: torch.Tensor
    fill: torch.Tensor
    """``[batch]`` int32: positions in use in each row's partial block."""
    q: torch.Tensor
    """``[batch, heads, head_dim]``: a smaller batch is padded into it."""
    mask: BlockMask


@dataclass
class FlexPlan:
    decode: DecodeBuffers | None
    rows: torch.Tensor | None
    """Rows of the batch that decode, when prefill rows share the forward."""
    prefills: list[Prefill]


class FlexAttention:
    """FlexAttention over the pool in place (see the module's docstring)."""

    name = "flex"

    def __init__(self, shape: AttentionShape, max_batch: int) -> None:
        reason = unavailable_reason(shape.device)
        if reason is not None:
            raise RuntimeError(reason)
        if shape.group > Q_BLOCK:
            raise RuntimeError(f"flex supports at most {Q_BLOCK} query heads per KV head")
        if shape.device.type == "cuda" and shape.block_size % 16:
            raise RuntimeError(
                "flex on CUDA needs a --block-size that is a multiple of 16, "
                f"got {shape.block_size}"
            )
        self.shape = shape
        self.buckets = batch_buckets(max_batch)
        self._buffers: dict[int, DecodeBuffers] = {}
        self._options = CPU_KERNEL_OPTIONS if shape.device.type == "cpu" else _cuda_options(shape)
        allow_recompiles(4 * len(self.buckets))
        self._flex = compiled_flex()

    # ---- plans ----
    def plan(self, spans: Sequence[Span]) -> FlexPlan:
        decode = [s for s in spans if s.is_decode]
        bs, device = self.shape.block_size, self.shape.device
        prefills = [prefill_plan(s, bs, device) for s in spans if not s.is_decode]
        if not decode:
            return FlexPlan(None, None, prefills)
        bucket = bucket_for(len(decode), self.buckets)
        if bucket is None:
            raise RuntimeError(
                f"{len(decode)} decode rows exceed the largest bucket {self.buckets[-1]}"
            )
        buf = self._buffers_for(bucket)
        self._refill(buf, decode)
        rows = None
        if prefills:
            rows = torch.tensor([s.lo for s in decode], dtype=torch.long, device=device)
        return FlexPlan(buf, rows, prefills)

    def static_plan(self, batch: int) -> FlexPlan:
        return FlexPlan(self._buffers_for(batch), None, [])

    def refill(self, plan: Any, spans: Sequence[Span]) -> None:
        assert isinstance(plan, FlexPlan) and plan.decode is not None
        self._refill(plan.decode, spans)

    def _buffers_for(self, batch: int) -> DecodeBuffers:
        buf = self._buffers.get(batch)
        if buf is None:
            buf = self._buffers[batch] = self._new_buffers(batch)
        return buf

    def _refill(self, buf: DecodeBuffers, spans: Sequence[Span]) -> None:
        n = len(spans)
        if n > buf.batch:
            raise ValueError(f"{n} rows do not fit a plan of {buf.batch}")
        bs = self.shape.block_size
        rows: list[list[int]] = []
        width = 1
        for s in spans:
            full, rest = divmod(s.end, bs)
            table = s.block_table
            rows.append([full, 1 if rest else 0, table[full] if rest else 0, rest, *table[:full]])
            width = max(width, full)
        for r in rows:
            r.extend([0] * (4 + width - len(r)))
        host = torch.tensor(rows, dtype=torch.int32)
        dev = host.to(self.shape.device, non_blocking=True)
        buf.full_num[:n, 0, 0] = dev[:, 0]
        buf.kv_num[:n, 0, 0] = dev[:, 1]
        buf.kv_idx[:n, 0, 0, 0] = dev[:, 2]
        buf.fill[:n] = dev[:, 3]
        buf.full_idx[:n, 0, 0, :width] = dev[:, 4:]
        buf.full_num[n:] = 0  # padding rows attend to nothing; their output is unused
        buf.kv_num[n:] = 0

    def _new_buffers(self, batch: int) -> DecodeBuffers:
        shape = self.shape
        dev, nb, bs = shape.device, shape.num_blocks, shape.block_size

        def ints(*size: int) -> torch.Tensor:
            return torch.zeros(size, dtype=torch.int32, device=dev)

        kv_num, kv_idx, full_num, full_idx = ints(batch, 1, 1), ints(batch, 1, 1, nb), \
            ints(batch, 1, 1), ints(batch, 1, 1, nb)  # fmt: skip
        fill = ints(batch)

        def mask_mod(
            b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor
        ) -> torch.Tensor:
            return (kv % bs) < fill[b]

        mask = BlockMask.from_kv_blocks(
            kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=(Q_BLOCK, bs), mask_mod=mask_mod,
            seq_lengths=(shape.group, nb * bs), compute_q_blocks=False,
        )  # fmt: skip
        q = torch.zeros((batch, shape.num_heads, shape.head_dim), dtype=shape.dtype, device=dev)
        return DecodeBuffers(batch, kv_num, kv_idx, full_num, full_idx, fill, q, mask)

    # ---- the layers ----
    def attend(
        self, plan: FlexPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        kb: torch.Tensor, vb: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        if plan.decode is not None and not plan.prefills:
            return self._decode(plan.decode, q, kb, vb)
        out = torch.empty_like(q)
        if plan.decode is not None:
            assert plan.rows is not None
            out[plan.rows] = self._decode(plan.decode, q[plan.rows], kb, vb)
        for p in plan.prefills:
            out[p.lo : p.hi] = prefill_attention(p, q, k, v, kb, vb, self.shape.scale)
        return out

    def _decode(
        self, buf: DecodeBuffers, q: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor
    ) -> torch.Tensor:
        n = q.shape[0]
        if n != buf.batch:
            buf.q[:n].copy_(q)
            q = buf.q
        shape = self.shape
        nb, bs, kvh, d = kb.shape
        keys = kb.view(1, nb * bs, kvh, d).transpose(1, 2)
        values = vb.view(1, nb * bs, kvh, d).transpose(1, 2)
        qf = q.reshape(buf.batch, kvh, shape.group, d)
        o = self._flex(qf, keys, values, block_mask=buf.mask, scale=shape.scale,
                       kernel_options=self._options)  # fmt: skip
        return o.reshape(buf.batch, shape.num_heads, d)[:n]


def _cuda_options(shape: AttentionShape) -> dict[str, Any]:
    """Triton tiles no wider than a KV block (its kernels need the block size to be a
    multiple of their KV tile)."""
    tile = 16
    while tile * 2 <= min(shape.block_size, 64) and shape.block_size % (tile * 2) == 0:
        tile *= 2
    return {"BLOCK_N": tile}

"""Gather + SDPA: each sequence's blocks are gathered out of the pool and attended with
PyTorch's ``scaled_dot_product_attention``. Runs on every device (the CPU default, and the
fallback anywhere).

Decode queries are folded to ``[B, kv_heads, group, head_dim]``: the query heads that share
a KV head become that head's ``group`` query rows, so query and KV head counts are equal
and SDPA can run a fused kernel with the padding mask (with unequal counts a masked call
falls back to the math kernel, which repeats K/V per group). Gathered K/V are views of one
index-select, never copied again to be contiguous.

Prefill chunks that start a sequence attend to their own fresh K/V with a causal kernel
(no gather); later chunks (after cached or earlier tokens) gather their context.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from splitserve_worker.engine.attention.base import AttentionShape, Span

PAD_LIMIT = 1.25
"""Decode attention pads every sequence of a group to the group's longest context; a
group takes the next (shorter) sequence only while the padded work stays within this
factor of the real work. A short sequence beside a long one gets its own group: padding
it would cost as much as attending over the long one again (on one core, a decode step of
SmolLM2-135M with contexts 1024, 1024, 64, 64, 64, 64 took 137-144 ms padded, 76 ms
grouped)."""

SPLIT_MIN_CTX = 256
"""Groups whose longest context is shorter than this are never split: their padding
costs less than another attention call per layer."""


def decode_groups(
    lens: Sequence[int], pad_limit: float = PAD_LIMIT, split_min: int = SPLIT_MIN_CTX
) -> list[list[int]]:
    """Indices of ``lens`` grouped for padded attention, longest first: each group's
    ``size * longest`` stays within ``pad_limit`` times the sum of its lengths, unless its
    longest is under ``split_min``."""
    groups: list[list[int]] = []
    total = 0
    for i in sorted(range(len(lens)), key=lambda j: -lens[j]):
        g = groups[-1] if groups else None
        if g is not None and (
            lens[g[0]] < split_min or (len(g) + 1) * lens[g[0]] <= pad_limit * (total + lens[i])
        ):
            g.append(i)
            total += lens[i]
        else:
            groups.append([i])
            total = lens[i]
    return groups


def gather(blocks: torch.Tensor, tables: torch.Tensor, length: int) -> torch.Tensor:
    """K or V of whole blocks ``tables`` (``[nblk]`` or ``[B, nblk]``) of one layer's
    ``[num_blocks, block_size, heads, dim]`` pool, cut to ``length`` positions, as a
    ``[..., heads, length, dim]`` view of one gathered copy."""
    _, bs, h, d = blocks.shape
    g = blocks.index_select(0, tables.reshape(-1))
    g = g.view(*tables.shape[:-1], tables.shape[-1] * bs, h, d)[..., :length, :, :]
    return g.transpose(-3, -2)


@dataclass
class DecodeGroup:
    index: torch.Tensor | None
    """Positions of the group's sequences among the decode rows; None: all, in order."""
    tables: torch.Tensor
    """``[b, nblk]`` block tables, padded with block 0 (masked out)."""
    lmax: int
    mask: torch.Tensor
    """``[b, 1, 1, lmax]``: True where a sequence has context."""


@dataclass
class Decode:
    rows: torch.Tensor
    """Rows of the batch that decode (one token each)."""
    groups: list[DecodeGroup]


@dataclass
class Prefill:
    lo: int
    hi: int
    ctx: int
    blocks: torch.Tensor | None
    """Blocks to read K/V from (a chunk after cached or earlier tokens); None: the chunk
    starts the sequence and attends only to its own fresh K/V."""
    mask: torch.Tensor | None


@dataclass
class SdpaPlan:
    decode: Decode | None
    prefills: list[Prefill]


def prefill_plan(span: Span, block_size: int, device: torch.device) -> Prefill:
    """How one multi-token span attends: causally over its own K/V, or over its context."""
    if span.start == 0:
        return Prefill(span.lo, span.hi, span.end, None, None)
    nblk = (span.end + block_size - 1) // block_size
    blocks = torch.tensor(list(span.block_table[:nblk]), dtype=torch.long, device=device)
    qpos = torch.arange(span.start, span.end, device=device).unsqueeze(1)
    mask = torch.arange(span.end, device=device).unsqueeze(0) <= qpos
    return Prefill(span.lo, span.hi, span.end, blocks, mask)


def prefill_attention(
    p: Prefill, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    kb: torch.Tensor, vb: torch.Tensor, scale: float,
) -> torch.Tensor:  # fmt: skip
    """Output ``[n, heads, dim]`` of one prefill chunk's rows of ``q``."""
    qp = q[p.lo : p.hi].transpose(0, 1).unsqueeze(0)
    if p.blocks is None:
        kp = k[p.lo : p.hi].transpose(0, 1).unsqueeze(0)
        vp = v[p.lo : p.hi].transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=True)
        return o[0].transpose(0, 1)
    kp = gather(kb, p.blocks, p.ctx).unsqueeze(0)
    vp = gather(vb, p.blocks, p.ctx).unsqueeze(0)
    group = qp.shape[1] // kp.shape[1]
    if qp.is_cuda and group > 1:
        # a masked call with unequal head counts gets only the math kernel on CUDA; with the
        # heads repeated the memory-efficient kernel takes the mask
        kp = kp.repeat_interleave(group, dim=1)
        vp = vp.repeat_interleave(group, dim=1)
    o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


class SdpaAttention:
    """Gather + SDPA (see the module's docstring)."""

    name = "sdpa"

    def __init__(self, shape: AttentionShape) -> None:
        self.shape = shape

    def plan(self, spans: Sequence[Span]) -> SdpaPlan:
        shape = self.shape
        device, bs = shape.device, shape.block_size
        decode_spans = [s for s in spans if s.is_decode]
        prefills = [prefill_plan(s, bs, device) for s in spans if not s.is_decode]
        decode: Decode | None = None
        if decode_spans:
            rows = torch.tensor([s.lo for s in decode_spans], dtype=torch.long, device=device)
            groups = decode_groups([s.end for s in decode_spans])
            if len(groups) == 1:  # the whole batch, in its own order
                parts = [_group(decode_spans, None, bs, device)]
            else:
                parts = [
                    _group([decode_spans[i] for i in g],
                           torch.tensor(g, dtype=torch.long, device=device), bs, device)
                    for g in groups
                ]  # fmt: skip
            decode = Decode(rows, parts)
        return SdpaPlan(decode, prefills)

    def attend(
        self, plan: SdpaPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        kb: torch.Tensor, vb: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        scale = self.shape.scale
        if plan.decode is not None and not plan.prefills:
            return self._decode(plan.decode, q, kb, vb)
        out = torch.empty_like(q)
        if plan.decode is not None:
            rows = plan.decode.rows
            out[rows] = self._decode(plan.decode, q[rows], kb, vb)
        for p in plan.prefills:
            out[p.lo : p.hi] = prefill_attention(p, q, k, v, kb, vb, scale)
        return out

    def _decode(
        self, d: Decode, q: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor
    ) -> torch.Tensor:
        if len(d.groups) == 1:
            return self._group(d.groups[0], q, kb, vb)
        out = torch.empty_like(q)
        for g in d.groups:
            assert g.index is not None
            out.index_copy_(0, g.index, self._group(g, q.index_select(0, g.index), kb, vb))
        return out

    def _group(
        self, g: DecodeGroup, q: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor
    ) -> torch.Tensor:
        b, heads, dim = q.shape
        kv_heads = kb.shape[2]
        kd = gather(kb, g.tables, g.lmax)
        vd = gather(vb, g.tables, g.lmax)
        qf = q.reshape(b, kv_heads, heads // kv_heads, dim)
        o = F.scaled_dot_product_attention(qf, kd, vd, attn_mask=g.mask, scale=self.shape.scale)
        return o.reshape(b, heads, dim)


def _group(
    spans: Sequence[Span], index: torch.Tensor | None, bs: int, device: torch.device
) -> DecodeGroup:
    lens = [s.end for s in spans]
    lmax = max(lens)
    nblk = (lmax + bs - 1) // bs
    tables = torch.tensor(
        [list(s.block_table[:nblk]) + [0] * (nblk - min(nblk, len(s.block_table)))
         for s in spans],
        dtype=torch.long,
        device=device,
    )  # fmt: skip
    m = torch.arange(lmax, device=device).unsqueeze(0) < torch.tensor(
        lens, device=device
    ).unsqueeze(1)
    return DecodeGroup(index, tables, lmax, m[:, None, None, :])

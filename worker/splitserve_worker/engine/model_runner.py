"""Layer-by-layer forward of a Llama-family model over the paged KV pool.

The decoder layers of the transformers model are driven one by one: embed, then per
layer input norm, q/k/v projections (q/k norms where the model has them), the model's
own rotary embedding, K/V written into the pool, attention reading K/V through block
tables, o_proj, residual, post-attention norm, MLP; then the final norm and lm_head
for the rows that need logits. Many sequences share one forward: their new tokens are
flattened into one ``[T, hidden]`` batch for every matmul; attention runs once for all
single-token (decode) rows and once per multi-token (prefill) chunk.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from splitserve_worker.engine.kv_cache import KVCache
from splitserve_worker.engine.linear import (
    LayerMatmuls,
    ModuleLayer,
    PackedLayer,
    packed_head,
    prepack_available,
)
from splitserve_worker.engine.prompt_logprobs import ChunkScores, score_rows

PACK_HINT = 16
"""Rows oneDNN lays prepacked weights out for: a typical decode batch."""


class UnsupportedModel(RuntimeError):
    """The model's layers cannot be driven one by one by this engine."""


@dataclass
class Chunk:
    """New tokens of one sequence for one forward."""

    block_table: Sequence[int]
    start: int
    """Tokens of this sequence whose KV is already in the pool (the first new position)."""
    token_ids: Sequence[int]
    need_logits: bool
    scores: ChunkScores | None = None
    """Prompt rows to score (prompt logprobs); the forward fills it in."""


@dataclass
class ModelShape:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int


def model_shape(config: Any) -> ModelShape:
    heads = int(config.num_attention_heads)
    hidden = int(config.hidden_size)
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return ModelShape(
        num_layers=int(config.num_hidden_layers),
        num_heads=heads,
        num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        head_dim=int(head_dim),
        hidden_size=hidden,
        vocab_size=int(config.vocab_size),
    )


class ModelRunner:
    def __init__(self, model: Any, kv: KVCache, *, prepack: bool = False) -> None:
        inner = getattr(model, "model", None)
        needed = ("embed_tokens", "layers", "norm", "rotary_emb")
        if inner is None or not all(hasattr(inner, n) for n in needed):
            raise UnsupportedModel(
                f"{type(model).__name__} is not a Llama-family causal LM (needs "
                f"model.embed_tokens, model.layers, model.norm, model.rotary_emb); "
                f"use Llama, Mistral, Qwen2 or Qwen3"
            )
        self.shape = model_shape(model.config)
        self.embed = inner.embed_tokens
        self.layers = list(inner.layers)[: self.shape.num_layers]
        self.norm = inner.norm
        self.rotary = inner.rotary_emb
        self.lm_head = model.lm_head
        attn0 = self.layers[0].self_attn
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if not hasattr(attn0, name):
                raise UnsupportedModel(
                    f"{type(attn0).__name__} has no {name}: not a Llama-style attention"
                )
        rope = getattr(sys.modules[type(attn0).__module__], "apply_rotary_pos_emb", None)
        if rope is None:
            raise UnsupportedModel(f"{type(attn0).__module__} has no apply_rotary_pos_emb")
        self.apply_rope: Callable[..., tuple[torch.Tensor, torch.Tensor]] = rope
        self.scaling = float(getattr(attn0, "scaling", self.shape.head_dim**-0.5))
        self.kv = kv
        self.device = kv.device
        self.prepacked = prepack and prepack_available(kv.device, kv.dtype)
        self.matmuls: list[LayerMatmuls]
        self.head: Callable[[torch.Tensor], torch.Tensor]
        if self.prepacked:
            with torch.inference_mode():
                self.matmuls = [PackedLayer(layer, PACK_HINT) for layer in self.layers]
                self.head = packed_head(self.lm_head, PACK_HINT)
        else:
            self.matmuls = [ModuleLayer(layer) for layer in self.layers]
            self.head = self.lm_head

    @torch.inference_mode()
    def forward(
        self, chunks: Sequence[Chunk], after_layer: Callable[[int], None] | None = None
    ) -> torch.Tensor:
        """Run the new tokens of ``chunks``; return logits ``[n_need, vocab]`` (float32) for
        the last token of each chunk with ``need_logits``, in chunk order. A chunk with
        ``scores`` gets its prompt rows scored into it.

        ``after_layer(i)`` is called once layer ``i``'s K/V are in the pool, before layer
        ``i + 1`` runs.
        """
        plan = _Plan.build(chunks, self.kv.block_size, self.device)
        h = self.embed(plan.input_ids)
        cos, sin = self.rotary(h, plan.positions.unsqueeze(0))
        cos, sin = cos[0], sin[0]
        hd = self.shape.head_dim
        for i, (layer, mm) in enumerate(zip(self.layers, self.matmuls, strict=True)):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            t = x.shape[0]
            q, k, v = mm.qkv(x)
            q = q.reshape(t, -1, hd)
            k = k.reshape(t, -1, hd)
            v = v.reshape(t, -1, hd)
            if hasattr(attn, "q_norm"):
                q = attn.q_norm(q)
                k = attn.k_norm(k)
            q, k = self.apply_rope(q, k, cos, sin, unsqueeze_dim=1)
            self.kv.write(i, plan.slots, k, v)
            o = self._attention(i, plan, q, k, v)
            h = h + mm.o(o.reshape(t, -1))
            h = h + mm.mlp(layer.post_attention_layernorm(h))
            if after_layer is not None:
                after_layer(i)
        for lo, want in plan.scored:
            score_rows(self.norm(h[lo : lo + len(want.targets)]), self.head, want)
        if plan.logit_rows.numel() == 0:
            return torch.empty((0, self.shape.vocab_size), device=self.device)
        last = self.norm(h.index_select(0, plan.logit_rows))
        return self.head(last).float()

    def _attention(
        self, layer: int, plan: _Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        kb, vb = self.kv.layer_blocks(layer)
        if plan.decode is not None and not plan.prefills:
            return self._decode_attention(plan.decode, q, kb, vb)
        out = torch.empty_like(q)
        if plan.decode is not None:
            rows = plan.decode.rows
            out[rows] = self._decode_attention(plan.decode, q[rows], kb, vb)
        for p in plan.prefills:
            qp = q[p.lo : p.hi].transpose(0, 1).unsqueeze(0)
            if p.blocks is None:
                kp = k[p.lo : p.hi].transpose(0, 1).unsqueeze(0)
                vp = v[p.lo : p.hi].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(
                    qp, kp, vp, is_causal=True, scale=self.scaling, enable_gqa=True
                )
            else:
                kp = _gather(kb, p.blocks, p.ctx).unsqueeze(0)
                vp = _gather(vb, p.blocks, p.ctx).unsqueeze(0)
                o = F.scaled_dot_product_attention(
                    qp, kp, vp, attn_mask=p.mask, scale=self.scaling, enable_gqa=True
                )
            out[p.lo : p.hi] = o[0].transpose(0, 1)
        return out

    def _decode_attention(
        self, d: _Decode, q: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor
    ) -> torch.Tensor:
        if len(d.groups) == 1:
            return self._group_attention(d.groups[0], q, kb, vb)
        out = torch.empty_like(q)
        for g in d.groups:
            assert g.index is not None
            out.index_copy_(0, g.index, self._group_attention(g, q.index_select(0, g.index),
                                                              kb, vb))  # fmt: skip
        return out

    def _group_attention(
        self, g: _DecodeGroup, q: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor
    ) -> torch.Tensor:
        kd = _gather(kb, g.tables, g.lmax)
        vd = _gather(vb, g.tables, g.lmax)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), kd, vd, attn_mask=g.mask, scale=self.scaling, enable_gqa=True
        )
        return o.squeeze(2)


def _gather(blocks: torch.Tensor, tables: torch.Tensor, length: int) -> torch.Tensor:
    """K or V of whole blocks ``tables`` (``[nblk]`` or ``[B, nblk]``) of one layer's
    ``[num_blocks, block_size, heads, dim]`` pool, cut to ``length`` positions, laid out
    ``[..., heads, length, dim]`` contiguous (what attention reads fastest)."""
    _, bs, h, d = blocks.shape
    g = blocks.index_select(0, tables.reshape(-1))
    g = g.view(*tables.shape[:-1], tables.shape[-1] * bs, h, d)[..., :length, :, :]
    return g.transpose(-3, -2).contiguous()


@dataclass
class _Prefill:
    lo: int
    hi: int
    ctx: int
    blocks: torch.Tensor | None
    """Blocks to read K/V from (a chunk after cached or earlier tokens); None: the chunk
    starts the sequence and attends only to its own fresh K/V."""
    mask: torch.Tensor | None


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


@dataclass
class _DecodeGroup:
    index: torch.Tensor | None
    """Positions of the group's sequences in the decode batch; None: all, in order."""
    tables: torch.Tensor
    """``[b, nblk]`` block tables, padded with block 0 (masked out)."""
    lmax: int
    mask: torch.Tensor
    """``[b, 1, 1, lmax]``: True where a sequence has context."""


@dataclass
class _Decode:
    rows: torch.Tensor
    groups: list[_DecodeGroup]


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


@dataclass
class _Plan:
    """Index tensors for one forward, shared by every layer."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    logit_rows: torch.Tensor
    decode: _Decode | None
    prefills: list[_Prefill]
    scored: list[tuple[int, ChunkScores]]
    """(first row, what to score) of each chunk that asked for prompt scores."""

    @staticmethod
    def build(chunks: Sequence[Chunk], bs: int, device: torch.device) -> _Plan:
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        logit_rows: list[int] = []
        decode_rows: list[int] = []
        decode_chunks: list[Chunk] = []
        prefills: list[_Prefill] = []
        scored: list[tuple[int, ChunkScores]] = []
        for c in chunks:
            lo = len(ids)
            n = len(c.token_ids)
            ids.extend(c.token_ids)
            table = c.block_table
            end = c.start + n
            pos.extend(range(c.start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(c.start, end))
            if c.need_logits:
                logit_rows.append(lo + n - 1)
            if c.scores is not None and c.scores.targets:
                scored.append((lo, c.scores))
            if n == 1:
                decode_rows.append(lo)
                decode_chunks.append(c)
            elif c.start == 0:
                prefills.append(_Prefill(lo, lo + n, end, None, None))
            else:
                nblk = (end + bs - 1) // bs
                blocks = torch.tensor(list(table[:nblk]), dtype=torch.long, device=device)
                qpos = torch.arange(c.start, end).unsqueeze(1)
                mask = (torch.arange(end).unsqueeze(0) <= qpos).to(device)
                prefills.append(_Prefill(lo, lo + n, end, blocks, mask))

        def tensor(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.long, device=device)

        decode: _Decode | None = None
        if decode_chunks:
            lens = [c.start + 1 for c in decode_chunks]
            groups = decode_groups(lens)
            if len(groups) == 1:  # the whole batch, in its own order
                parts = [_group(decode_chunks, None, bs, device)]
            else:
                parts = [_group([decode_chunks[i] for i in g], tensor(g), bs, device)
                         for g in groups]  # fmt: skip
            decode = _Decode(tensor(decode_rows), parts)
        return _Plan(
            input_ids=tensor(ids),
            positions=tensor(pos),
            slots=tensor(slots),
            logit_rows=tensor(logit_rows),
            decode=decode,
            prefills=prefills,
            scored=scored,
        )


def _group(
    chunks: Sequence[Chunk], index: torch.Tensor | None, bs: int, device: torch.device
) -> _DecodeGroup:
    lens = [c.start + 1 for c in chunks]
    lmax = max(lens)
    nblk = (lmax + bs - 1) // bs
    tables = torch.tensor(
        [list(c.block_table[:nblk]) + [0] * (nblk - min(nblk, len(c.block_table)))
         for c in chunks],
        dtype=torch.long,
        device=device,
    )  # fmt: skip
    m = torch.arange(lmax).unsqueeze(0) < torch.tensor(lens).unsqueeze(1)
    return _DecodeGroup(index, tables, lmax, m[:, None, None, :].to(device))

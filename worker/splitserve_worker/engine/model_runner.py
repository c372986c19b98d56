"""Layer-by-layer forward of a Llama-family model over the paged KV pool.

The decoder layers of the transformers model are driven one by one: embed, then per
layer input norm, q/k/v projections (q/k norms where the model has them), the model's
own rotary embedding, K/V written into the pool, attention reading K/V through block
tables, o_proj, residual, post-attention norm, MLP; then the final norm and lm_head
for the rows that need logits. Many sequences share one forward: their new tokens are
flattened into one ``[T, hidden]`` batch for every matmul; attention is the engine's
:mod:`attention backend <splitserve_worker.engine.attention>`'s, planned once per forward.

A forward is two halves: :meth:`ModelRunner.plan` (host work: index tensors and the
attention plan) and :meth:`ModelRunner.run` (device work only, no host sync unless prompt
scores are asked for), so a decode step's ``run`` can be captured in a CUDA graph over a
plan whose tensors stay put (:mod:`.decode_graphs`).

Over tensor-parallel ranks (:mod:`splitserve_worker.parallel`) the model is one rank's
shard: the rank computes its query heads and its KV heads' K/V, attention's output
projection and the MLP give partial sums that one all-reduce each completes, and the
leader rank sends each forward to the others first (:class:`ForwardStep`).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from splitserve_worker.engine.attention.base import AttentionBackend, AttentionShape, Span
from splitserve_worker.engine.kv_cache import KVCache
from splitserve_worker.engine.linear import (
    FusedLayer,
    LayerMatmuls,
    PackedLayer,
    packed_head,
    prepack_available,
)
from splitserve_worker.engine.prompt_logprobs import ChunkScores, score_rows
from splitserve_worker.parallel.collectives import RankGroup
from splitserve_worker.parallel.layout import TPLayout

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


@dataclass(frozen=True)
class RankPush:
    """A handoff in which every rank pushes its own KV heads (no gather): ``order`` says
    where (the server's, opaque here), ``start_token`` is the first position this
    chunk's layers hand over, ``last`` whether it is the prompt's last chunk."""

    order: object
    start_token: int
    last: bool


@dataclass(frozen=True)
class ForwardStep:
    """What the leader rank tells the other ranks to run: the same chunks (without what
    only the leader computes: logits and prompt scores), and from which position of the
    single chunk a handoff gathers each layer's K/V (``None``: no handoff), or, with
    ``push``, each rank hands its own heads over itself."""

    chunks: list[Chunk]
    export_from: int | None = None
    push: RankPush | None = None


@dataclass(frozen=True)
class StopRanks:
    """The leader is closing: the other ranks return."""


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


def rank_shape(shape: ModelShape, layout: TPLayout | None) -> ModelShape:
    """The heads one rank computes and holds (all of them without tensor parallelism)."""
    if layout is None:
        return shape
    return dataclasses.replace(
        shape, num_heads=layout.heads_per_rank, num_kv_heads=layout.kv_heads_per_rank
    )


class ModelRunner:
    def __init__(
        self,
        model: Any,
        kv: KVCache,
        attention: AttentionBackend,
        *,
        prepack: bool = False,
        group: RankGroup | None = None,
        layout: TPLayout | None = None,
    ) -> None:
        """With ``group`` (and its ``layout``) the model is one rank's shard
        (:mod:`splitserve_worker.parallel.sharded_load`): each forward all-reduces
        attention's output projection and the MLP, and the leader rank (0) first sends the
        other ranks the same forward (:meth:`follow` runs it there)."""
        inner = getattr(model, "model", None)
        needed = ("embed_tokens", "layers", "norm", "rotary_emb")
        if inner is None or not all(hasattr(inner, n) for n in needed):
            raise UnsupportedModel(
                f"{type(model).__name__} is not a Llama-family causal LM (needs "
                f"model.embed_tokens, model.layers, model.norm, model.rotary_emb); "
                f"use Llama, Mistral, Qwen2 or Qwen3"
            )
        self.group = group
        self.layout = layout
        self.full_shape = model_shape(model.config)
        self.shape = rank_shape(self.full_shape, layout)
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
        self.kv = kv
        self.device = kv.device
        self.attention = attention
        self.prepacked = prepack and prepack_available(kv.device, kv.dtype)
        self.matmuls: list[LayerMatmuls]
        self.head: Callable[[torch.Tensor], torch.Tensor]
        if self.prepacked:
            with torch.inference_mode():
                self.matmuls = [PackedLayer(layer, PACK_HINT) for layer in self.layers]
                self.head = packed_head(self.lm_head, PACK_HINT)
        else:
            self.matmuls = [FusedLayer(layer) for layer in self.layers]
            self.head = self.lm_head

    def forward(
        self, chunks: Sequence[Chunk], after_layer: Callable[[int], None] | None = None
    ) -> torch.Tensor:
        """Run the new tokens of ``chunks``; return logits ``[n_need, vocab]`` (float32) for
        the last token of each chunk with ``need_logits``, in chunk order. A chunk with
        ``scores`` gets its prompt rows scored into it.

        ``after_layer(i)`` is called once layer ``i``'s K/V are in the pool, before layer
        ``i + 1`` runs.
        """
        if self.group is not None and self.group.leader:
            self.group.send_step(ForwardStep([_plain(c) for c in chunks]))
        return self.run(self.plan(chunks), after_layer)

    def forward_export(
        self,
        chunk: Chunk,
        export_from: int,
        on_layer: Callable[[int, torch.Tensor, torch.Tensor], None],
        push: RankPush | None = None,
    ) -> torch.Tensor:
        """:meth:`forward` of one chunk, handing ``on_layer(i, k, v)`` every KV head of
        layer ``i`` for positions ``[export_from, chunk end)`` once the layer is done (with
        tensor parallelism each rank's heads are gathered for it). With ``push`` (tensor
        parallel), ``on_layer`` gets this rank's heads only, and every other rank hands
        over its own (:meth:`follow`)."""
        if self.group is not None and self.group.leader:
            self.group.send_step(ForwardStep([_plain(chunk)], export_from, push))
        slots = self.kv.slots(chunk.block_table, export_from, chunk.start + len(chunk.token_ids))

        def after(i: int) -> None:
            k, v = self.kv.read(i, slots) if push is not None else self.export_kv(i, slots)
            on_layer(i, k, v)

        return self.run(self.plan([chunk]), after)

    def export_kv(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V ``[n, kv_heads, head_dim]`` of every KV head of the model at ``slots``: this
        rank's own, or (tensor parallel) each head once from the ranks holding it."""
        k, v = self.kv.read(layer, slots)
        if self.group is None or self.layout is None:
            return k, v
        gk = self.group.all_gather(k)
        gv = self.group.all_gather(v)
        owners = self.layout.kv_owners()
        return (torch.cat([gk[r] for r in owners], dim=1),
                torch.cat([gv[r] for r in owners], dim=1))  # fmt: skip

    def follow(
        self,
        step: ForwardStep,
        on_layer: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
    ) -> None:
        """A non-leader rank's part of the leader's forward (no logits); with the step's
        ``push``, ``on_layer(i, k, v)`` gets this rank's heads of each layer."""
        if step.export_from is None:
            self.run(self.plan(step.chunks), logits=False)
            return
        c = step.chunks[0]
        slots = self.kv.slots(c.block_table, step.export_from, c.start + len(c.token_ids))

        def gather(i: int) -> None:
            if step.push is None:
                self.export_kv(i, slots)
            elif on_layer is not None:
                k, v = self.kv.read(i, slots)
                on_layer(i, k, v)

        self.run(self.plan(step.chunks), gather, logits=False)

    def plan(self, chunks: Sequence[Chunk]) -> StepPlan:
        """The index tensors and attention plan of one forward of ``chunks``."""
        return StepPlan.build(chunks, self.kv.block_size, self.device, self.attention)

    @torch.inference_mode()
    def run(
        self,
        plan: StepPlan,
        after_layer: Callable[[int], None] | None = None,
        *,
        logits: bool = True,
    ) -> torch.Tensor:
        """The forward of a :meth:`plan`: logits ``[logit rows, vocab]``, float32 (none,
        and no prompt scores, unless ``logits``)."""
        h = self.embed(plan.input_ids)
        cos, sin = self.rotary(h, plan.positions.unsqueeze(0))
        cos, sin = cos[0], sin[0]
        hd = self.shape.head_dim
        attention = self.attention
        group = self.group
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
            kb, vb = self.kv.layer_blocks(i)
            o = attention.attend(plan.attention, q, k, v, kb, vb)
            a = mm.o(o.reshape(t, -1))
            if group is not None:
                group.all_reduce(a)
            h = h + a
            m = mm.mlp(layer.post_attention_layernorm(h))
            if group is not None:
                group.all_reduce(m)
            h = h + m
            if after_layer is not None:
                after_layer(i)
        if not logits:
            return torch.empty(0)
        for lo, want in plan.scored:
            score_rows(self.norm(h[lo : lo + len(want.targets)]), self.head, want)
        if plan.logit_rows.numel() == 0:
            return torch.empty((0, self.shape.vocab_size), device=self.device)
        last = self.norm(h.index_select(0, plan.logit_rows))
        return self.head(last).float()


def _plain(c: Chunk) -> Chunk:
    """``c`` as the other ranks run it: its positions and blocks only."""
    return Chunk(list(c.block_table), c.start, list(c.token_ids), need_logits=False)


def attention_shape(shape: ModelShape, kv: KVCache, scale: float) -> AttentionShape:
    """What the attention backends of a model over ``kv`` are built for."""
    return AttentionShape(
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        block_size=kv.block_size,
        num_blocks=int(kv.pool.shape[2]),
        scale=scale,
        dtype=kv.dtype,
        device=kv.device,
    )


def attention_scale(model: Any) -> float:
    """The softmax scale of the model's attention (its own, or ``head_dim ** -0.5``)."""
    attn0 = model.model.layers[0].self_attn
    return float(getattr(attn0, "scaling", model_shape(model.config).head_dim ** -0.5))


@dataclass
class StepPlan:
    """Index tensors for one forward, shared by every layer."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    logit_rows: torch.Tensor
    attention: Any
    """The attention backend's plan of this forward."""
    scored: list[tuple[int, ChunkScores]]
    """(first row, what to score) of each chunk that asked for prompt scores."""

    @staticmethod
    def build(
        chunks: Sequence[Chunk], bs: int, device: torch.device, attention: AttentionBackend
    ) -> StepPlan:
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        logit_rows: list[int] = []
        spans: list[Span] = []
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
            spans.append(Span(lo, lo + n, c.start, table))
        rows = len(ids)
        host = torch.tensor([*ids, *pos, *slots, *logit_rows], dtype=torch.long)
        packed = host.to(device, non_blocking=True)
        return StepPlan(
            input_ids=packed[:rows],
            positions=packed[rows : 2 * rows],
            slots=packed[2 * rows : 3 * rows],
            logit_rows=packed[3 * rows :],
            attention=attention.plan(spans),
            scored=scored,
        )

"""How long one engine step takes (the roofline, or costs measured on a real engine), and
how long a KV handoff between two tensor-parallel layouts takes.

A *step* is one forward pass of one engine instance over a batch that may mix
prefill tokens (new prompt tokens, possibly a chunk of a prompt) and decode
sequences (one new token each). The simulator describes a step by five
numbers and asks a :class:`CostModel` for its duration:

``prefill_tokens``
    new prompt tokens in the step;
``prefill_attn``
    attention (query, context) pairs of those tokens: a chunk of ``n`` tokens
    after ``p`` cached ones contributes ``n * p + n (n + 1) / 2``;
``prefill_seqs``
    prompts in the step (each gets one row of logits);
``decode_seqs``
    sequences decoding one token;
``decode_ctx``
    the sum of their context lengths (each attends to its whole context).

Decode batches are simulated many steps at a time (the batch only changes
when a sequence joins or finishes), so a cost model also gives
:meth:`CostModel.decode_span`: the total time of ``k`` consecutive pure-decode
steps of ``B`` sequences whose context sum starts at ``C`` and grows by ``B``
per step. Both implementations compute it in closed form.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Protocol

from splitserve_operator.sim.hardware import GpuSpec
from splitserve_operator.sim.model_spec import ModelSpec


class CostModel(Protocol):
    """Step durations of one engine instance (all its tensor-parallel GPUs together)."""

    def step_time(
        self,
        prefill_tokens: int,
        prefill_attn: float,
        prefill_seqs: int,
        decode_seqs: int,
        decode_ctx: float,
    ) -> float:
        """Seconds for one step; side-effect free."""
        ...

    def decode_span(self, decode_seqs: int, decode_ctx: float, steps: int) -> float:
        """Seconds for ``steps`` pure-decode steps, context sum growing by
        ``decode_seqs`` per step; equals the sum of ``step_time`` over them."""
        ...


def _series(a: float, b: float, j0: int, j1: int) -> float:
    """sum_{j0 <= j < j1} (a + b j)."""
    n = j1 - j0
    if n <= 0:
        return 0.0
    return n * a + b * (j0 + j1 - 1) * n / 2


def sum_max_of_lines(a1: float, b1: float, a2: float, b2: float, k: int) -> float:
    """sum_{0 <= j < k} max(a1 + b1 j, a2 + b2 j), exactly."""
    if k <= 0:
        return 0.0
    if b1 == b2:
        return _series(max(a1, a2), b1, 0, k)
    jc = (a2 - a1) / (b1 - b2)  # where the lines cross (may overflow to +-inf)
    if b1 > b2:  # line 1 on top for j >= jc
        split = k if jc >= k else 0 if jc <= 0 else math.ceil(jc)
        return _series(a2, b2, 0, split) + _series(a1, b1, split, k)
    # line 1 on top for j <= jc
    split = k if jc >= k - 1 else 0 if jc < 0 else math.floor(jc) + 1
    return _series(a1, b1, 0, split) + _series(a2, b2, split, k)


@dataclass(frozen=True)
class RooflineCost:
    """A roofline per kernel group, summed: kernels of one step run one after
    another (the seed article: a prefill's large kernels leave no room for
    decode kernels to run alongside), each bound by compute or by memory.

    Per step, on one of the ``tp`` GPUs of an instance::

        gemm        = max(FLOPs of all matmuls / (F * gemm_eff(tokens)),
                          (streamed weights + KV written) / B)
        prefill_att = prefill attention FLOPs / F                  (flash attention)
        decode_att  = max(decode attention FLOPs / F, KV read / B)
        step        = overhead + all-reduces + gemm + prefill_att + decode_att

    with ``F = peak FLOP/s * compute_efficiency``, ``B = HBM bandwidth *
    memory_efficiency`` and ``gemm_eff(m) = m / (m + gemm_half_tokens)``: a
    matmul over few tokens fills fewer tiles (the article: each chunk "processes
    fewer tokens", so chunks lose efficiency).
    """

    model: ModelSpec
    gpu: GpuSpec
    tp: int = 1
    compute_efficiency: float = 0.6
    """Fraction of peak FLOP/s that large GEMMs and flash attention reach."""
    memory_efficiency: float = 0.8
    """Fraction of nominal HBM bandwidth that weight and KV reads reach."""
    gemm_half_tokens: float = 128.0
    """Tokens per step at which matmuls run at half their large-size efficiency
    (0 switches the size effect off)."""
    step_overhead_s: float = 0.5e-3
    """Fixed cost per step (scheduling, kernel launches, sampling)."""
    allreduce_latency_s: float = 8e-6
    """Latency of one all-reduce between the ``tp`` GPUs (two per layer per step)."""

    def __post_init__(self) -> None:
        # Per-GPU constants, computed once: step_time runs a million times a trace.
        m, tp = self.model, self.tp
        f = self.gpu.peak_flops * self.compute_efficiency
        b = self.gpu.hbm_bandwidth * self.memory_efficiency
        kv = m.kv_bytes_per_token_per_gpu(tp)
        consts = {
            "flops_rate": f,
            "bytes_rate": b,
            "_lin": m.linear_flops_per_token / tp / f,
            "_lm": m.lm_head_flops / tp / f,
            "_weights": m.streamed_weight_bytes / tp / b,
            "_kv_write": kv / b,
            "_pair": m.attn_flops_per_pair / tp / f,
            "_ctx": max(m.attn_flops_per_pair / tp / f, kv / b),
        }
        for k, v in consts.items():
            object.__setattr__(self, k, v)

    flops_rate: float = field(init=False, repr=False, compare=False)
    """Achievable FLOP/s per GPU: peak x compute_efficiency."""
    bytes_rate: float = field(init=False, repr=False, compare=False)
    """Achievable bytes/s per GPU: HBM bandwidth x memory_efficiency."""
    _lin: float = field(init=False, repr=False, compare=False)
    _lm: float = field(init=False, repr=False, compare=False)
    _weights: float = field(init=False, repr=False, compare=False)
    _kv_write: float = field(init=False, repr=False, compare=False)
    _pair: float = field(init=False, repr=False, compare=False)
    _ctx: float = field(init=False, repr=False, compare=False)

    def gemm_efficiency(self, tokens: int) -> float:
        h = self.gemm_half_tokens
        return tokens / (tokens + h) if h > 0 else 1.0

    def comm_time(self, tokens: int) -> float:
        """Two ring all-reduces of the hidden state per layer."""
        if self.tp <= 1:
            return 0.0
        msg = tokens * self.model.hidden * self.model.dtype_bytes
        ring = 2 * (self.tp - 1) / self.tp * msg / self.gpu.tp_link_bandwidth
        return 2 * self.model.layers * (self.allreduce_latency_s + ring)

    def gemm_time(self, tokens: int, logit_rows: int) -> float:
        """All matmuls of a step: compute at the size-dependent efficiency, or
        streaming the weights (and writing the new tokens' KV), whichever is slower."""
        h = self.gemm_half_tokens
        eff = tokens / (tokens + h) if h > 0 else 1.0
        compute = (tokens * self._lin + logit_rows * self._lm) / eff
        return max(compute, self._weights + tokens * self._kv_write)

    def step_time(
        self,
        prefill_tokens: int,
        prefill_attn: float,
        prefill_seqs: int,
        decode_seqs: int,
        decode_ctx: float,
    ) -> float:
        tokens = prefill_tokens + decode_seqs
        if tokens <= 0:
            return 0.0
        t = self.step_overhead_s + self.gemm_time(tokens, prefill_seqs + decode_seqs)
        if self.tp > 1:
            t += self.comm_time(tokens)
        return t + prefill_attn * self._pair + decode_ctx * self._ctx

    def decode_span(self, decode_seqs: int, decode_ctx: float, steps: int) -> float:
        if steps <= 0 or decode_seqs <= 0:
            return 0.0
        fixed = self.step_overhead_s + self.gemm_time(decode_seqs, decode_seqs)
        if self.tp > 1:
            fixed += self.comm_time(decode_seqs)
        # attention of step j reads ctx_j = decode_ctx + j * decode_seqs tokens of KV
        c = self._ctx
        return steps * fixed + _series(decode_ctx * c, decode_seqs * c, 0, steps)


@dataclass(frozen=True)
class MeasuredCost:
    """Step time as a linear fit of timings taken on a real engine.

    ``prefill: base + per_token * tokens + per_pair * attention pairs`` and
    ``decode: base + per_seq * sequences + per_ctx * context tokens``; a mixed
    step pays both parts. Build it with :meth:`fit` from measured samples.
    """

    prefill_base_s: float
    prefill_per_token_s: float
    decode_base_s: float
    decode_per_seq_s: float
    prefill_per_pair_s: float = 0.0
    decode_per_ctx_s: float = 0.0

    def step_time(
        self,
        prefill_tokens: int,
        prefill_attn: float,
        prefill_seqs: int,
        decode_seqs: int,
        decode_ctx: float,
    ) -> float:
        t = 0.0
        if prefill_tokens > 0:
            t += (
                self.prefill_base_s
                + self.prefill_per_token_s * prefill_tokens
                + self.prefill_per_pair_s * prefill_attn
            )
        if decode_seqs > 0:
            t += (
                self.decode_base_s
                + self.decode_per_seq_s * decode_seqs
                + self.decode_per_ctx_s * decode_ctx
            )
        return t

    def decode_span(self, decode_seqs: int, decode_ctx: float, steps: int) -> float:
        if steps <= 0 or decode_seqs <= 0:
            return 0.0
        first = self.decode_base_s + self.decode_per_seq_s * decode_seqs
        first += self.decode_per_ctx_s * decode_ctx
        return _series(first, self.decode_per_ctx_s * decode_seqs, 0, steps)

    @classmethod
    def fit(
        cls,
        prefill: Sequence[tuple[int, float]],
        decode: Sequence[tuple[int, float, float]],
    ) -> MeasuredCost:
        """Least-squares fit.

        ``prefill``: (prompt tokens, seconds) of single prompts run from an empty
        cache; ``decode``: (batch size, context sum, seconds per step). Needs at
        least three of each, at distinct sizes. Negative coefficients are
        clamped to zero (noise on a flat curve).
        """
        import numpy as np

        if len({n for n, _ in prefill}) < 3 or len({b for b, _, _ in decode}) < 2:
            raise ValueError("fit needs prefill at >= 3 lengths and decode at >= 2 batch sizes")
        n = np.array([p[0] for p in prefill], dtype=float)
        a = np.stack([np.ones_like(n), n, n * (n + 1) / 2], axis=1)
        pc, *_ = np.linalg.lstsq(a, np.array([p[1] for p in prefill]), rcond=None)
        bsz = np.array([d[0] for d in decode], dtype=float)
        ctx = np.array([d[1] for d in decode], dtype=float)
        cols = [np.ones_like(bsz), bsz]
        if len({c for _, c, _ in decode}) > 2:
            cols.append(ctx)
        dc, *_ = np.linalg.lstsq(
            np.stack(cols, axis=1), np.array([d[2] for d in decode]), rcond=None
        )
        p = [max(0.0, float(x)) for x in pc]
        d = [max(0.0, float(x)) for x in dc] + [0.0]
        return cls(
            prefill_base_s=p[0],
            prefill_per_token_s=p[1],
            prefill_per_pair_s=p[2],
            decode_base_s=d[0],
            decode_per_seq_s=d[1],
            decode_per_ctx_s=d[2],
        )


def transfer_end(
    link_free: float,
    prefill_start: float,
    prefill_end: float,
    transfer_s: float,
    layers: int,
    layerwise: bool,
) -> float:
    """When the last byte of a prefill's KV reaches the decode side.

    The link is a FIFO resource free from ``link_free``. Without overlap the
    transfer waits for the end of prefill. Layer-wise, layer ``i``'s share
    (``transfer_s / layers``) may leave once prefill has computed it (prefill
    time spread evenly over the layers): the transfer starts after the first
    layer and cannot end before the last layer's share has been sent after
    prefill ends.
    """
    if not layerwise:
        return max(link_free, prefill_end) + transfer_s
    first_layer_done = prefill_start + (prefill_end - prefill_start) / layers
    start = max(link_free, first_layer_done)
    return max(start + transfer_s, prefill_end + transfer_s / layers)


def exposed_transfer_s(transfer_s: float, prefill_s: float, layers: int, layerwise: bool) -> float:
    """Delay a transfer adds after prefill ends, on an idle link."""
    return transfer_end(0.0, 0.0, prefill_s, transfer_s, layers, layerwise) - prefill_s


def rank_heads(kv_heads: int, tp: int, rank: int) -> range:
    """The KV heads rank ``rank`` of ``tp`` holds: an even share when ``tp`` is at most
    ``kv_heads``, else one head, each head replicated on ``tp / kv_heads`` ranks (as the
    engine shards them)."""
    if tp <= kv_heads:
        return range(rank * kv_heads // tp, (rank + 1) * kv_heads // tp)
    head = rank * kv_heads // tp
    return range(head, head + 1)


@dataclass(frozen=True)
class KvFanout:
    """Who sends what in a handoff from a prefill worker of ``prefill_tp`` ranks to a
    decode worker of ``decode_tp``: each decode rank receives the heads it owns, each
    straight from a prefill rank that holds it (a replicated head's copies share the
    sending), so ``p != d`` fans out or in, and nothing is gathered through one rank.
    Counts are in heads of one token's KV over all layers."""

    prefill_tp: int
    decode_tp: int
    sent: tuple[int, ...]
    """Heads each prefill rank sends."""
    received: tuple[int, ...]
    """Heads each decode rank receives."""
    pairs: int
    """(prefill rank, decode rank) pairs that exchange heads: the streams of a handoff."""

    @property
    def busiest_rank(self) -> int:
        """Heads through the busiest rank of either side: with a link per rank it sets
        the handoff's time."""
        return max(*self.sent, *self.received)

    @property
    def total(self) -> int:
        """Heads moved in all (more than the model's KV heads where decode replicates)."""
        return sum(self.received)


@cache
def kv_fanout(kv_heads: int, prefill_tp: int, decode_tp: int) -> KvFanout:
    """The :class:`KvFanout` of a ``prefill_tp`` to ``decode_tp`` handoff."""
    if kv_heads < 1 or prefill_tp < 1 or decode_tp < 1:
        raise ValueError("kv_heads and both tensor-parallel sizes must be at least 1")
    owners: dict[int, list[int]] = {}
    for i in range(prefill_tp):
        for h in rank_heads(kv_heads, prefill_tp, i):
            owners.setdefault(h, []).append(i)
    sent = [0] * prefill_tp
    received = [0] * decode_tp
    pairs: set[tuple[int, int]] = set()
    for j in range(decode_tp):
        for h in rank_heads(kv_heads, decode_tp, j):
            holders = owners[h]
            i = holders[j % len(holders)]
            sent[i] += 1
            received[j] += 1
            pairs.add((i, j))
    return KvFanout(prefill_tp, decode_tp, tuple(sent), tuple(received), len(pairs))


def handoff_bytes_s(
    fanout: KvFanout, head_bytes: float, bandwidth: float, *, link_per_rank: bool
) -> float:
    """Seconds a handoff's bytes occupy the path: ``head_bytes`` is one head's KV of the
    prompt (all layers, K and V). With a link per rank (per-GPU NICs, NVLink) the
    busiest rank of either side sets the time; with one link per worker, all of it."""
    heads = fanout.busiest_rank if link_per_rank else max(sum(fanout.sent), fanout.total)
    return heads * head_bytes / bandwidth

"""The attention backends against a plain dense attention over the same pool, the batch
buckets, the static-buffer bookkeeping CUDA graphs replay, and how a backend is chosen."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from attention_backends import backend_params, paged_params
from splitserve_worker.engine.attention.base import AttentionShape, Span
from splitserve_worker.engine.attention.buckets import batch_buckets, bucket_for
from splitserve_worker.engine.attention.registry import (
    AttentionUnavailable,
    make,
    select,
    self_check,
)
from splitserve_worker.engine.decode_graphs import padded_inputs
from splitserve_worker.engine.model_runner import Chunk

pytestmark = pytest.mark.unit

BS, HEADS, KV_HEADS, DIM, BLOCKS = 16, 6, 2, 32, 64


def _shape(blocks: int = BLOCKS) -> AttentionShape:
    return AttentionShape(HEADS, KV_HEADS, DIM, BS, blocks, DIM**-0.5, torch.float32,
                          torch.device("cpu"))  # fmt: skip


def _pool(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(BLOCKS, BS, KV_HEADS, DIM, generator=g),
            torch.randn(BLOCKS, BS, KV_HEADS, DIM, generator=g))  # fmt: skip


def _dense(span: Span, q: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor) -> torch.Tensor:
    """The span's rows attended the plain way: its context copied out position by position."""
    pos = torch.arange(span.end)
    table = torch.tensor(list(span.block_table))
    slots = table[pos // BS] * BS + pos % BS
    k = kb.reshape(-1, KV_HEADS, DIM)[slots].repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = vb.reshape(-1, KV_HEADS, DIM)[slots].repeat_interleave(HEADS // KV_HEADS, dim=1)
    qpos = torch.arange(span.start, span.end)[:, None]
    mask = pos[None, :] <= qpos
    o = F.scaled_dot_product_attention(
        q[span.lo : span.hi].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
        attn_mask=mask, scale=DIM**-0.5,
    )  # fmt: skip
    return o.transpose(0, 1)


def _spans(lengths: Sequence[tuple[int, int]], seed: int) -> list[Span]:
    """(cached positions, new tokens) per sequence, blocks drawn at random from the pool."""
    rng = random.Random(seed)
    free = list(range(BLOCKS))
    rng.shuffle(free)
    spans, lo = [], 0
    for start, n in lengths:
        nblk = (start + n + BS - 1) // BS
        table, free = free[:nblk], free[nblk:]
        spans.append(Span(lo, lo + n, start, table))
        lo += n
    return spans


MIXES = {
    "decode": [(0, 1), (15, 1), (16, 1), (31, 1), (47, 1), (100, 1), (3, 1)],
    "decode and prefill": [(40, 1), (0, 9), (7, 1), (20, 12), (63, 1), (32, 5)],
    "prefill": [(0, 17), (16, 16)],
}


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("mix", list(MIXES))
def test_backend_equals_dense_attention(backend: str, mix: str) -> None:
    spans = _spans(MIXES[mix], seed=len(mix))
    kb, vb = _pool(1)
    rows = spans[-1].hi
    q = torch.randn(rows, HEADS, DIM, generator=torch.Generator().manual_seed(2))
    # the rows' own new K/V, as the runner hands them over (also in the pool)
    flat_k, flat_v = kb.reshape(-1, KV_HEADS, DIM), vb.reshape(-1, KV_HEADS, DIM)
    k = torch.cat([flat_k[[s.block_table[p // BS] * BS + p % BS for p in range(s.start, s.end)]]
                   for s in spans])  # fmt: skip
    v = torch.cat([flat_v[[s.block_table[p // BS] * BS + p % BS for p in range(s.start, s.end)]]
                   for s in spans])  # fmt: skip
    b = make(backend, _shape(), max_batch=16)
    with torch.inference_mode():
        got = b.attend(b.plan(spans), q, k, v, kb, vb)
    want = torch.cat([_dense(s, q, kb, vb) for s in spans])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", paged_params())
def test_a_static_plan_refilled_with_fewer_rows_forgets_the_longer_batch(backend: str) -> None:
    """One bucket's buffers serve every step: a step of fewer, shorter rows after a step of
    long ones must not attend to what the long step left in the buffers."""
    b = make(backend, _shape(), max_batch=8)
    kb, vb = _pool(3)
    plan = b.static_plan(8)
    for lengths in ([(100, 1)] * 8, [(5, 1), (17, 1), (0, 1)]):
        spans = _spans(lengths, seed=len(lengths))
        b.refill(plan, spans)
        q = torch.randn(8, HEADS, DIM, generator=torch.Generator().manual_seed(4))
        with torch.inference_mode():
            got = b.attend(plan, q, q[:, :KV_HEADS], q[:, :KV_HEADS], kb, vb)[: len(spans)]
        want = torch.cat([_dense(s, q, kb, vb) for s in spans])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_buckets_are_powers_of_two_up_to_the_batch_limit() -> None:
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert batch_buckets(24) == (1, 2, 4, 8, 16, 24)
    assert batch_buckets(1) == (1,)
    assert [bucket_for(n, batch_buckets(24)) for n in (1, 3, 8, 9, 17, 24, 25)] == [
        1, 4, 8, 16, 24, 24, None,
    ]  # fmt: skip
    with pytest.raises(ValueError):
        batch_buckets(0)


def test_static_inputs_pad_to_the_bucket_into_the_scratch_slot() -> None:
    chunks = [
        Chunk([4, 9], 20, [7], True),
        Chunk([2], 0, [5], True),
        Chunk([1, 3, 8], 47, [6], True),
    ]
    got = padded_inputs(chunks, 4, 16, scratch_slot=999)
    ids, pos, slots = got[:4], got[4:8], got[8:]
    assert ids == [7, 5, 6, 0] and pos == [20, 0, 47, 0]
    assert slots == [9 * 16 + 4, 2 * 16, 8 * 16 + 15, 999]
    with pytest.raises(ValueError, match="do not fit"):
        padded_inputs(chunks, 2, 16, scratch_slot=999)


def test_auto_takes_sdpa_on_the_cpu_and_names_are_checked() -> None:
    kb, vb = _pool(5)
    chosen = select("auto", _shape(), 8, (kb, vb))
    assert chosen.backend.name == "sdpa" and "auto" in chosen.why
    with pytest.raises(AttentionUnavailable, match="choose one of"):
        select("paged", _shape(), 8, (kb, vb))
    with pytest.raises(AttentionUnavailable, match="CUDA only"):
        select("flashinfer", _shape(), 8, (kb, vb))


class Wrong:
    """A backend whose answers are off: the check must refuse it."""

    name = "wrong"

    def plan(self, spans: Sequence[Span]) -> Any:
        return None

    def attend(self, plan: Any, q: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        return q * 0.5


def test_the_start_check_refuses_a_backend_that_disagrees_and_leaves_the_pool_clean() -> None:
    kb, vb = torch.zeros(BLOCKS, BS, KV_HEADS, DIM), torch.zeros(BLOCKS, BS, KV_HEADS, DIM)
    problem = self_check(Wrong(), _shape(), (kb, vb))  # type: ignore[arg-type]
    assert problem is not None and "difference" in problem
    assert kb.abs().sum() == 0 and vb.abs().sum() == 0
    for name in [p.id for p in backend_params()]:
        assert self_check(make(name, _shape(), 8), _shape(), (kb, vb)) is None, name

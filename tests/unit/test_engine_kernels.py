"""The engine's CPU kernels: prepacked linear layers padded to a good row count, and
decode attention grouped by context length."""

from __future__ import annotations

import random

import pytest
import torch
from splitserve_worker.engine.attention.sdpa import PAD_LIMIT, SPLIT_MIN_CTX, decode_groups
from splitserve_worker.engine.linear import MIN_ROWS, PackedLinear, prepack_available

pytestmark = pytest.mark.unit


@pytest.mark.skipif(
    not prepack_available(torch.device("cpu"), torch.float32), reason="no oneDNN prepacking"
)
@pytest.mark.parametrize("rows", [1, 2, MIN_ROWS - 1, MIN_ROWS, 9])
def test_packed_linear_matches_plain_linear_for_any_row_count(rows: int) -> None:
    torch.manual_seed(rows)
    w, b = torch.randn(48, 32), torch.randn(48)
    x = torch.randn(rows, 32)
    y = PackedLinear([w], [b], 16)(x)
    assert y.shape == (rows, 48)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)


def _check(lens: list[int], groups: list[list[int]]) -> None:
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    for g in groups:
        longest = max(lens[i] for i in g)
        assert lens[g[0]] == longest
        if longest >= SPLIT_MIN_CTX and len(g) > 1:
            assert len(g) * longest <= PAD_LIMIT * sum(lens[i] for i in g)


def test_decode_groups_keep_short_sequences_apart_from_a_long_one() -> None:
    lens = [65, 1025, 70, 66]
    groups = decode_groups(lens)
    _check(lens, groups)
    assert groups == [[1], [2, 3, 0]]


def test_decode_groups_batch_similar_lengths_together() -> None:
    assert decode_groups([300, 300, 290]) == [[0, 1, 2]]
    assert decode_groups([200, 5, 90]) == [[0, 2, 1]]  # short contexts: one padded group
    assert decode_groups([1]) == [[0]]
    assert decode_groups([]) == []


def test_decode_groups_bound_the_padding_for_any_lengths() -> None:
    rng = random.Random(0)
    for _ in range(200):
        lens = [rng.choice([rng.randint(1, 40), rng.randint(1, 3000)]) for _ in range(12)]
        _check(lens, decode_groups(lens))

"""How a model splits over tensor-parallel ranks (pure), and the shared-memory all-reduce
between ranks (here two threads of one process over one mapping)."""

from __future__ import annotations

import mmap
import threading

import pytest
import torch
from splitserve_worker.parallel.layout import LayoutError, TPLayout
from splitserve_worker.parallel.shm_allreduce import ShmAllReduce, ShmTimeout

pytestmark = pytest.mark.unit


def test_heads_and_kv_heads_split_evenly() -> None:
    layouts = [TPLayout(4, r, num_heads=8, num_kv_heads=4, intermediate_size=64) for r in range(4)]
    assert [list(x.heads()) for x in layouts] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [list(x.kv_heads()) for x in layouts] == [[0], [1], [2], [3]]
    assert [x.columns(64) for x in layouts][1] == range(16, 32)
    assert layouts[0].kv_owners() == [0, 1, 2, 3] and layouts[0].kv_replicas == 1


def test_more_ranks_than_kv_heads_replicate_each_kv_head_where_its_queries_are() -> None:
    layouts = [TPLayout(4, r, num_heads=8, num_kv_heads=2, intermediate_size=64) for r in range(4)]
    # query heads 0-3 read KV head 0, 4-7 read KV head 1 (groups of 4)
    assert [list(x.kv_heads()) for x in layouts] == [[0], [0], [1], [1]]
    for x in layouts:
        group = {h // 4 for h in x.heads()}
        assert group == set(x.kv_heads())
    assert layouts[0].kv_owners() == [0, 2] and layouts[0].kv_replicas == 2
    assert layouts[0].describe() == "tp4-kv1x2"


MISFITS = [(3, 4, 2, 128), (2, 4, 2, 127), (4, 4, 3, 128), (0, 4, 2, 128)]


@pytest.mark.parametrize(("world", "heads", "kv", "inter"), MISFITS)
def test_a_split_that_does_not_fit_is_refused_naming_the_sizes_that_do(
    world: int, heads: int, kv: int, inter: int
) -> None:
    with pytest.raises(LayoutError, match="tensor-parallel-size"):
        TPLayout(world, 0, num_heads=heads, num_kv_heads=kv, intermediate_size=inter)


def test_the_message_lists_the_sizes_that_fit() -> None:
    with pytest.raises(LayoutError, match=r"may be 1, 2, 4$"):
        TPLayout(3, 0, num_heads=4, num_kv_heads=2, intermediate_size=128)


def _pair(max_elems: int) -> list[ShmAllReduce]:
    size = ShmAllReduce.size_bytes(2, max_elems)
    mm = mmap.mmap(-1, size)
    return [ShmAllReduce(mm, r, 2, max_elems, timeout_s=5.0) for r in range(2)]


def test_shm_all_reduce_sums_in_rank_order_and_every_rank_gets_the_same_bits() -> None:
    ranks = _pair(1024)
    gen = torch.Generator().manual_seed(3)
    inputs = [[torch.randn(7, 33, generator=gen) for _ in range(50)] for _ in range(2)]
    outputs: list[list[torch.Tensor]] = [[], []]

    def run(r: int) -> None:
        for t in inputs[r]:
            x = t.clone()
            ranks[r].all_reduce(x)
            outputs[r].append(x)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for i in range(50):
        want = inputs[0][i] + inputs[1][i]
        assert torch.equal(outputs[0][i], want) and torch.equal(outputs[1][i], want)


def test_shm_all_reduce_ends_when_the_group_is_aborted() -> None:
    ranks = _pair(16)
    ranks[0].abort("rank 1 exited")  # as the launcher's watcher does
    with pytest.raises(ShmTimeout, match="rank 1 exited"):
        ranks[0].all_reduce(torch.ones(4))  # rank 1 never arrives


def test_shm_all_reduce_refuses_what_does_not_fit() -> None:
    with pytest.raises(ValueError, match="at most 16"):
        _pair(16)[0].all_reduce(torch.ones(17))

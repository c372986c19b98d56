"""The scheduler's policy, without a model: budgets, chunking, admission, preemption."""

from __future__ import annotations

import pytest
from splitserve.sampling import SamplingParams
from splitserve_worker.engine.block_pool import BlockPool
from splitserve_worker.engine.config import EngineConfig
from splitserve_worker.engine.scheduler import Scheduler
from splitserve_worker.engine.sequence import SeqStatus, Sequence

pytestmark = pytest.mark.unit


def _seq(rid: str, n: int, first: int = 3) -> Sequence:
    return Sequence(rid, n, [first + i for i in range(n)], SamplingParams(), None, 0)


def _advance(s: Scheduler, cache: bool = True) -> dict[str, int]:
    """One step: schedule, pretend the forward ran, append a token where one is due."""
    plan = s.schedule()
    done = {}
    for sc in plan.scheduled:
        completes = sc.completes
        s.commit(sc.seq, sc.num_tokens, cache=cache)
        if completes:
            sc.seq.tokens.append(7)
        done[sc.seq.request_id] = sc.num_tokens
    return done


def test_prefill_is_chunked_while_others_decode() -> None:
    cfg = EngineConfig(block_size=4, max_num_seqs=4, max_batch_tokens=16, prefill_chunk_tokens=5)
    s = Scheduler(cfg, BlockPool(64))
    s.add(_seq("short", 2))
    assert _advance(s) == {"short": 2}
    s.add(_seq("long", 23))
    steps = [_advance(s) for _ in range(6)]
    # the decoding sequence gets one token every step; the prompt 5 tokens at a time
    assert all(st["short"] == 1 for st in steps)
    assert [st.get("long") for st in steps] == [5, 5, 5, 5, 3, 1]


def test_prefill_uses_the_whole_budget_when_nothing_decodes() -> None:
    cfg = EngineConfig(block_size=4, max_num_seqs=4, max_batch_tokens=16, prefill_chunk_tokens=5)
    s = Scheduler(cfg, BlockPool(64))
    s.add(_seq("a", 10))
    s.add(_seq("b", 10))
    assert _advance(s) == {"a": 10, "b": 6}


def test_admission_waits_for_blocks_and_batch_room() -> None:
    cfg = EngineConfig(block_size=4, max_num_seqs=2, max_batch_tokens=32, prefill_chunk_tokens=32)
    pool = BlockPool(5)
    s = Scheduler(cfg, pool)
    for rid in ("a", "b", "c"):
        s.add(_seq(rid, 8))
    assert set(_advance(s)) == {"a", "b"}  # c: batch full (and 1 block left)
    assert [q.request_id for q in s.waiting] == ["c"]
    s.remove(s.running[0])
    assert "c" in _advance(s)


def test_out_of_blocks_preempts_the_newest_and_it_recomputes() -> None:
    cfg = EngineConfig(block_size=4, max_num_seqs=4, max_batch_tokens=32, prefill_chunk_tokens=32)
    pool = BlockPool(4)
    preempted: list[str] = []
    s = Scheduler(cfg, pool, on_preempt=lambda q: preempted.append(q.request_id))
    s.add(_seq("old", 4))
    s.add(_seq("new", 4, first=50))
    _advance(s)  # both prefilled: 1 block each, plus a token sampled
    for _ in range(6):
        _advance(s)
        pool.check_invariants()
    assert preempted and preempted[0] == "new"
    new = next(q for q in [*s.running, *s.waiting] if q.request_id == "new")
    assert new.num_output >= 1  # keeps what it generated; recomputes it all when readmitted


def test_a_sequence_that_asks_to_recompute_its_prompt_reads_no_cached_block() -> None:
    cfg = EngineConfig(block_size=4, max_num_seqs=4, max_batch_tokens=32, prefill_chunk_tokens=32)
    pool = BlockPool(16)
    s = Scheduler(cfg, pool)
    a = _seq("a", 10)  # its blocks registered, as pushed KV is when committed
    s.add(a)
    _advance(s)
    b = _seq("b", 10)
    b.reuse_prefix = False  # the correctness guard's re-run
    s.add(b)
    plan = s.schedule()
    assert plan.prefix_hit == 0 and b.num_computed == 0 and b.num_cached_tokens == 0
    (mine,) = [sc for sc in plan.scheduled if sc.seq is b]  # a decodes beside it
    assert mine.num_tokens == 10
    assert not set(b.block_table) & set(a.block_table), "it shares a block of the cached KV"
    s.remove(a)
    s.remove(b)
    assert pool.free_blocks == 16
    pool.check_invariants()


def test_prefix_hit_reuses_blocks_and_counts() -> None:
    cfg = EngineConfig(block_size=4, max_num_seqs=4, max_batch_tokens=32, prefill_chunk_tokens=32)
    pool = BlockPool(16)
    s = Scheduler(cfg, pool)
    a = _seq("a", 10)
    s.add(a)
    _advance(s)
    s.remove(a)
    b = _seq("b", 11)  # same first 10 tokens, one more
    s.add(b)
    plan = s.schedule()
    assert plan.prefix_hit == 8 and plan.prefix_queried == 11
    assert plan.scheduled[0].num_tokens == 3 and b.num_computed == 8
    # a full-prompt hit still computes the last token
    s.remove(b)
    c = _seq("c", 8)
    s.add(c)
    plan = s.schedule()
    assert plan.prefix_hit == 4 and plan.scheduled[0].num_tokens == 4
    s.remove(c)
    assert pool.free_blocks == 16
    pool.check_invariants()
    assert c.status is SeqStatus.FINISHED

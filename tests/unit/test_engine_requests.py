"""The request table without a model: one entry per id, the batch limit, what abort and
release free and send, and the counts the gauges publish."""

from __future__ import annotations

import pytest
import torch
from splitserve import metric_names as names
from splitserve.metric_registry import Metrics
from splitserve.sampling import SamplingParams
from splitserve_worker.engine.config import EngineConfig
from splitserve_worker.engine.errors import NoCapacity, RequestError, UnknownRequest
from splitserve_worker.engine.kv_cache import KVCache
from splitserve_worker.engine.metrics import EngineMetrics
from splitserve_worker.engine.requests import RequestLimits, RequestTable
from splitserve_worker.engine.scheduler import Scheduler
from splitserve_worker.engine.sequence import FinishReason

pytestmark = pytest.mark.unit

BLOCKS = 16


def table(max_num_seqs: int = 4, metrics: EngineMetrics | None = None) -> RequestTable:
    cfg = EngineConfig(block_size=4, max_num_seqs=max_num_seqs, max_batch_tokens=64)
    kv = KVCache(num_layers=1, num_blocks=BLOCKS, block_size=4, num_kv_heads=1, head_dim=2,
                 dtype=torch.float32, device="cpu")  # fmt: skip
    limits = RequestLimits(vocab_size=32, max_model_len=48, max_num_seqs=max_num_seqs)
    return RequestTable(Scheduler(cfg, kv.blocks), kv, limits, device=torch.device("cpu"),
                        metrics=metrics)  # fmt: skip


def add(t: RequestTable, rid: str, n: int = 6) -> None:
    prompt = list(range(1, n + 1))
    t.check(rid, prompt, SamplingParams(max_tokens=4))
    t.add(t.new_sequence(rid, prompt, SamplingParams(max_tokens=4)))


def test_one_id_names_one_entry_sequence_or_reservation() -> None:
    t = table()
    add(t, "seq")
    t.reserve("held", 5)
    for rid in ("seq", "held"):
        with pytest.raises(RequestError, match="already in use"):
            t.check(rid, [1, 2], SamplingParams())
        with pytest.raises(RequestError, match="already in use"):
            t.reserve(rid, 5)
    assert "seq" in t and "held" in t and "other" not in t
    assert t.get("seq") is not None and t.get("held") is None


def test_reservations_count_toward_the_batch_limit() -> None:
    t = table(max_num_seqs=2)
    add(t, "a")
    t.reserve("b", 5)
    with pytest.raises(NoCapacity, match="decode batch full"):
        t.reserve("c", 5)
    assert (t.num_waiting, t.num_running, t.num_reserved) == (1, 0, 1)
    assert t.tokens_in_flight() == 6


def test_release_frees_a_reservation_once() -> None:
    t = table()
    ids = t.reserve("r", 9)  # 9 tokens in blocks of 4
    assert len(ids) == 3 and t.kv.free_blocks == BLOCKS - 3
    assert t.release("r") == 3
    assert t.release("r") == 0
    assert t.kv.free_blocks == BLOCKS
    with pytest.raises(UnknownRequest):
        t.reservation("r")


def test_abort_frees_the_blocks_and_sends_one_final_output_next_step() -> None:
    t = table()
    add(t, "a")
    t.scheduler.schedule()  # admitted: holds the blocks of its prompt
    assert t.num_running == 1 and t.kv.free_blocks < BLOCKS
    assert t.abort("a")
    assert not t.abort("a")
    assert t.kv.free_blocks == BLOCKS and t.num_running == 0 and "a" not in t
    (out,) = t.take_deferred()
    assert out.request_id == "a" and out.finished and out.finish_reason == "abort"
    assert t.take_deferred() == [] and not t.has_work()


def test_a_finish_that_is_not_an_abort_is_returned_not_deferred() -> None:
    t = table()
    add(t, "a")
    seq = t.get("a")
    assert seq is not None
    out = t.finish(seq, FinishReason.LENGTH)
    assert out.finished and out.finish_reason == "length"
    assert t.take_deferred() == [] and t.num_waiting == 0


def test_gauges_show_the_tables_counts() -> None:
    m = Metrics()
    t = table(metrics=EngineMetrics(m, "decode"))
    add(t, "a")
    t.reserve("b", 8)
    t.update_gauges()

    def gauge(spec: names.MetricSpec) -> float | None:
        return m.registry.get_sample_value(spec.name, {"role": "decode"})

    assert gauge(names.WAITING) == 1 and gauge(names.RUNNING) == 0
    assert gauge(names.KV_BLOCKS_USED) == 2 and gauge(names.KV_BLOCKS_FREE) == BLOCKS - 2

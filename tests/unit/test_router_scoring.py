"""Each scorer, filter and the picker, with worked numbers."""

from __future__ import annotations

import pytest
from splitserve.roles import Role
from splitserve_worker.router.prefix_index import BlockEvent, EventKind, PrefixIndex
from splitserve_worker.router.scoring import (
    KVFreeScorer,
    LoadScorer,
    PrefixScorer,
    RouteRequest,
    RunningScorer,
    WorkerView,
    can_decode,
    can_prefill,
    decode_profile,
    has_room,
    healthy,
    pick_max,
    prefill_profile,
)

pytestmark = pytest.mark.unit


def w(name: str, role: Role = Role.PREFILL, **kw: object) -> WorkerView:
    return WorkerView(name=name, role=role, **kw)  # type: ignore[arg-type]


def test_prefix_scorer_is_fraction_of_prompt_blocks_cached() -> None:
    req = RouteRequest(64, block_hashes=(1, 2, 3, 4), cached_blocks={"a": 3, "b": 4})
    assert PrefixScorer()(req, [w("a"), w("b"), w("c")]) == [0.75, 1.0, 0.0]


def test_prefix_scorer_without_hashes_scores_zero() -> None:
    assert PrefixScorer()(RouteRequest(5), [w("a")]) == [0.0]


def test_load_scorer_prefers_less_work_ahead() -> None:
    req = RouteRequest(1024)
    scores = LoadScorer(token_scale=1024)(
        req, [w("idle"), w("busy", tokens_in_flight=1024), w("queued", assigned=1, waiting=1)]
    )
    assert scores == [1.0, 0.5, pytest.approx(1 / 3)]
    assert all(0.0 <= s <= 1.0 for s in scores)


def test_kv_free_scorer_is_free_fraction() -> None:
    scores = KVFreeScorer()(
        RouteRequest(1),
        [w("a", free_blocks=25, total_blocks=100), w("b", free_blocks=0, total_blocks=8)],
    )
    assert scores == [0.25, 0.0]


def test_running_scorer_counts_running_and_assigned() -> None:
    scores = RunningScorer()(
        RouteRequest(1),
        [w("a", running=16, max_running=64), w("b", assigned=64, max_running=64), w("c")],
    )
    assert scores == [0.75, 0.0, 1.0]


def test_filters() -> None:
    ws = [
        w("p", Role.PREFILL),
        w("d", Role.DECODE, free_blocks=1, total_blocks=10),
        w("x", Role.BOTH, free_blocks=9, total_blocks=10),
        w("sick", Role.BOTH, healthy=False),
    ]
    req = RouteRequest(40, block_size=16, exclude=frozenset({"p"}))
    assert [v.name for v in healthy(req, ws)] == ["d", "x"]
    assert [v.name for v in can_prefill(req, ws)] == ["p", "x", "sick"]
    assert [v.name for v in can_decode(req, ws)] == ["d", "x", "sick"]
    # 40 tokens need 3 blocks plus one for the next token
    assert req.blocks_needed == 4
    assert [v.name for v in has_room(req, ws)] == ["p", "x", "sick"]


def test_picker_breaks_ties_by_assigned_then_name() -> None:
    ws = [w("b", assigned=1), w("c"), w("a")]
    assert pick_max(ws, [0.5, 0.5, 0.5]).name == "a"
    assert pick_max(ws, [0.9, 0.5, 0.5]).name == "b"


def test_prefill_profile_trades_prefix_against_load() -> None:
    idx = PrefixIndex()
    idx.stored("warm", [1, 2, 3, 4])
    hashes = (1, 2, 3, 4)
    workers = [w("warm", tokens_in_flight=512), w("cold")]
    req = RouteRequest(64, hashes, cached_blocks=idx.match(hashes))
    # prefix weight 2: warm = 2*1 + 1/(1+(512)/2048) = 2.8 > cold = 1.0
    choice = prefill_profile(prefix=2.0, load=1.0).choose(req, workers)
    assert choice is not None and choice.worker.name == "warm"
    assert choice.score == pytest.approx(2.0 + 0.8)
    # without the prefix weight the idle worker wins
    choice = prefill_profile(prefix=0.0, load=1.0).choose(req, workers)
    assert choice is not None and choice.worker.name == "cold"


def test_decode_profile_skips_full_workers_and_none_when_all_filtered() -> None:
    ws = [
        w("full", Role.DECODE, free_blocks=1, total_blocks=100),
        w("roomy", Role.DECODE, free_blocks=80, total_blocks=100),
    ]
    prof = decode_profile(1.0, 1.0, 0.5)
    choice = prof.choose(RouteRequest(100), ws)
    assert choice is not None and choice.worker.name == "roomy"
    assert prof.choose(RouteRequest(100_000), ws) is None
    assert prof.choose(RouteRequest(10, exclude=frozenset({"full", "roomy"})), ws) is None


def test_prefix_index_match_walks_until_first_miss() -> None:
    idx = PrefixIndex()
    idx.stored("a", [1, 2, 3])
    idx.stored("b", [1, 2])
    idx.stored("c", [2, 3])  # no first block: useless for this prompt
    assert idx.match([1, 2, 3, 4]) == {"a": 3, "b": 2}
    assert idx.match([1, 2, 3, 4], among={"b"}) == {"b": 2}
    assert idx.match([9, 1]) == {}
    assert idx.match([]) == {}
    idx.apply("a", BlockEvent(EventKind.EVICTED, (2,)))
    assert idx.match([1, 2, 3]) == {"a": 1, "b": 2}
    idx.apply("b", BlockEvent(EventKind.CLEARED))
    assert idx.match([1, 2, 3]) == {"a": 1}
    assert idx.blocks_of("b") == 0
    idx.remove_worker("a")
    assert len(idx) == 2  # only c's two blocks are left
    assert idx.match([1]) == {}

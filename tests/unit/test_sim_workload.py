"""Workloads and trace formats: Poisson, rate scaling, Mooncake and Azure replay."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from splitserve_operator.sim.synth import azure_like, mooncake_like
from splitserve_operator.sim.traces import (
    load_azure,
    load_mooncake,
    load_trace,
    save_azure,
    save_mooncake,
)
from splitserve_operator.sim.workload import (
    Fixed,
    LogNormal,
    Uniform,
    WorkloadError,
    parse_length,
    poisson,
)

pytestmark = pytest.mark.unit

TRACES = Path(__file__).resolve().parents[2] / "bench" / "traces"


def test_poisson_rate_and_lengths() -> None:
    w = poisson(5.0, 20_000, 1000, Uniform(10, 20), seed=1)
    assert w.rate == pytest.approx(5.0, rel=0.03)
    gaps = np.diff(w.arrival)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    assert set(np.unique(w.prompt)) == {1000}
    assert w.output.min() >= 10 and w.output.max() <= 20


def test_at_rate_scales_time_and_keeps_order() -> None:
    w = poisson(2.0, 1000, 100, 10, seed=2)
    fast = w.at_rate(8.0)
    assert fast.rate == pytest.approx(8.0)
    assert np.allclose(fast.arrival, (w.arrival - w.arrival[0]) * w.rate / 8.0)
    assert np.array_equal(fast.prompt, w.prompt)


def test_parse_length() -> None:
    assert parse_length("512") == Fixed(512)
    assert parse_length("uniform:10:20") == Uniform(10, 20)
    assert parse_length("lognormal:2000:0.5") == LogNormal(2000.0, 0.5)
    sample = LogNormal(2000.0, 0.5).sample(np.random.default_rng(0), 50_000)
    assert sample.mean() == pytest.approx(2000, rel=0.03)
    with pytest.raises(WorkloadError):
        parse_length("gamma:3")


def test_mooncake_round_trip(tmp_path: Path) -> None:
    w = mooncake_like(300, 600.0, seed=3)
    p = tmp_path / "t.jsonl"
    save_mooncake(w, p)
    back = load_mooncake(p)
    assert np.array_equal(back.prompt, w.prompt) and np.array_equal(back.output, w.output)
    assert back.hash_ids is not None and list(back.hash_ids) == list(w.hash_ids or [])
    assert np.allclose(back.arrival, w.arrival - w.arrival[0], atol=1e-3)  # ms resolution
    # one hash per started 512-token block
    assert all(len(h) == -(-n // 512) for h, n in zip(back.hash_ids, back.prompt, strict=True))


def test_mooncake_reuses_prefixes() -> None:
    w = mooncake_like(2000, 3600.0, seed=4)
    assert w.hash_ids is not None
    seen: set[int] = set()
    reused = 0
    for ids in w.hash_ids:
        reused += ids[0] in seen
        seen.update(ids)
    assert reused / len(w) > 0.9  # system prompts and conversations recur


def test_azure_round_trip_and_timestamp_format(tmp_path: Path) -> None:
    p = tmp_path / "a.csv"
    p.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.1805900,396,109\n"
        "2023-11-16 18:15:47.0000000,879,1\n"
    )
    w = load_azure(p)
    assert list(w.prompt) == [374, 879, 396]  # sorted by time
    assert np.allclose(w.arrival, [0.0, 0.31941, 3.5], atol=1e-6)
    w2 = azure_like(200, 600.0, seed=5, kind="code")
    save_azure(w2, tmp_path / "b.csv")
    back = load_trace(tmp_path / "b.csv")
    assert np.array_equal(back.prompt, w2.prompt)
    assert np.allclose(back.arrival, w2.arrival - w2.arrival[0], atol=1e-5)


def test_bad_traces_say_why(tmp_path: Path) -> None:
    p = tmp_path / "x.jsonl"
    p.write_text('{"timestamp": 1, "input_length": 3}\n')
    with pytest.raises(WorkloadError, match=r"x\.jsonl:1"):
        load_mooncake(p)
    q = tmp_path / "y.csv"
    q.write_text("time,prompt\n1,2\n")
    with pytest.raises(WorkloadError, match="ContextTokens"):
        load_azure(q)
    with pytest.raises(WorkloadError, match="format"):
        load_trace(tmp_path / "z.parquet")


@pytest.mark.parametrize(
    "name", ["mooncake_sample.jsonl", "azure_conv_sample.csv", "azure_code_sample.csv"]
)
def test_shipped_sample_traces_load(name: str) -> None:
    w = load_trace(TRACES / name)
    assert len(w) == 1000
    assert w.duration > 0 and w.prompt.min() >= 1 and w.output.min() >= 1

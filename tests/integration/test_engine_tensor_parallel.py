"""Tensor parallelism over gloo and the shared-memory all-reduce, in float32 on the CPU:
greedy tokens of a TP=2 engine (rank 0 here, rank 1 a process of its own) equal a TP=1
engine's and transformers' ``generate`` for 32 prompts at once, with chunked prefill,
prefix-cache hits and preemption, on a model whose KV heads split evenly over the ranks
and on one with a single KV head (replicated on both); a layer-wise prefill's K/V comes
out with every head, as a TP=1 prefill's does."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from splitserve.sampling import SamplingParams
from splitserve_worker.engine.config import EngineConfig
from splitserve_worker.engine.engine import Engine
from splitserve_worker.models import LoadedModel, load_model
from splitserve_worker.server.ranks import RankedEngine, start_ranked_engine

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MAX_NEW = 10
NUM_PROMPTS = 32
SHARED = [random.Random(99).randrange(3, 256) for _ in range(40)]
# a pool too small for all of them (preemption), chunks of 32 (chunked prefill), the
# prefix cache on (the shared 40-token prefix is hit)
CONFIG = EngineConfig(num_blocks=14, max_num_seqs=8, max_batch_tokens=64,
                      prefill_chunk_tokens=32, dtype="float32", num_threads=1)  # fmt: skip


def _prompts() -> list[list[int]]:
    rng = random.Random(4321)
    out = []
    for i in range(NUM_PROMPTS):
        n = rng.choice([1, 3, 15, 16, 17, 33, 50, 90])
        body = [rng.randrange(3, 256) for _ in range(n)]
        out.append(SHARED + body if i % 3 == 0 else body)
    return out


def _generate(loaded: LoadedModel, prompts: list[list[int]]) -> list[list[int]]:
    refs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            out = loaded.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                do_sample=False, pad_token_id=loaded.tokenizer.pad_token_id,
            )  # fmt: skip
            refs.append(out[0, len(p) :].tolist())
    return refs


def _run(engine: Engine, prompts: list[list[int]]) -> tuple[list[list[int]], list[str], int]:
    """Every prompt at once: (tokens, preempted request ids, prompt tokens served from
    the prefix cache)."""
    preempted: list[str] = []
    engine.scheduler._on_preempt = lambda s: preempted.append(s.request_id)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=MAX_NEW))
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    cached = 0
    for _ in range(20_000):
        if not engine.has_work():
            break
        for o in engine.step():
            assert o.error is None, o.error
            got[o.request_id] += o.new_token_ids
            if o.finished:
                cached += o.num_cached_tokens
    assert not engine.has_work()
    assert engine.kv.free_blocks == engine.kv.total_blocks
    return [got[f"r{i}"] for i in range(len(prompts))], preempted, cached


@pytest.fixture(scope="module", params=["kv-even-gloo", "kv-replicated-shm"])
def case(
    request: pytest.FixtureRequest, tiny_model_path: Path, tiny_model_path_kv1: Path
) -> Iterator[tuple[Path, RankedEngine]]:
    torch.set_num_threads(1)
    path = tiny_model_path if request.param.startswith("kv-even") else tiny_model_path_kv1
    allreduce = request.param.rsplit("-", 1)[1]
    ranked = start_ranked_engine(str(path), 2, CONFIG, allreduce=allreduce)
    try:
        yield path, ranked
    finally:
        ranked.close()
        assert all(p.poll() is not None for p in ranked.ranks.procs)


def test_tp2_greedy_tokens_equal_tp1_and_transformers(case: tuple[Path, RankedEngine]) -> None:
    path, ranked = case
    engine = ranked.engine
    layout = engine.layout
    assert layout is not None and engine.group is not None
    loaded = load_model(str(path))
    kv_heads = int(loaded.config.num_key_value_heads)
    # each rank holds its own heads (a replica of the one KV head when it is alone)
    assert engine.kv.num_kv_heads == max(1, kv_heads // 2)
    assert layout.kv_replicas == (2 if kv_heads == 1 else 1)
    prompts = _prompts()
    reference = _generate(loaded, prompts)
    assert len({tuple(r) for r in reference}) > NUM_PROMPTS // 2
    tp1, _, _ = _run(Engine(loaded, CONFIG), prompts)
    tp2, preempted, cached = _run(engine, prompts)
    assert tp2 == tp1 == reference
    assert preempted, "the pool was meant to be too small for all of them at once"
    assert cached > 0, "the shared prefix was meant to be served from the prefix cache"
    assert engine.group.stats.all_reduces > 0
    assert all(p.poll() is None for p in ranked.ranks.procs)


def test_tp2_layerwise_prefill_hands_over_every_kv_head(case: tuple[Path, RankedEngine]) -> None:
    path, ranked = case
    prompt = [random.Random(5).randrange(3, 256) for _ in range(70)]
    tp1 = Engine(load_model(str(path)), CONFIG)

    def export(engine: Engine, rid: str) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]:
        layers: list[tuple[torch.Tensor, torch.Tensor]] = []

        def on_layer(i: int, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
            if start == 0:
                layers.append((k.clone(), v.clone()))
            else:
                pk, pv = layers[i]
                layers[i] = (torch.cat([pk, k]), torch.cat([pv, v]))

        res = engine.prefill_export(rid, prompt, SamplingParams(max_tokens=1), on_layer)
        return res.first_token, layers

    want_tok, want = export(tp1, "p1")
    got_tok, got = export(ranked.engine, "p2")
    assert got_tok == want_tok
    assert len(got) == len(want) == tp1.shape.num_layers
    for (gk, gv), (wk, wv) in zip(got, want, strict=True):
        assert gk.shape == wk.shape == (len(prompt), tp1.shape.num_kv_heads, tp1.shape.head_dim)
        torch.testing.assert_close(gk, wk, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(gv, wv, rtol=1e-4, atol=1e-5)
    assert ranked.engine.kv.free_blocks == ranked.engine.kv.total_blocks


def test_all_reduce_probes_run_on_every_rank_and_leave_them_in_step(
    case: tuple[Path, RankedEngine],
) -> None:
    path, ranked = case
    group = ranked.engine.group
    assert group is not None
    kinds = ["gloo", "shm"] if group.kind == "shm" else ["gloo"]
    for kind in kinds:
        assert group.probe(kind, 576, 5) > 0
    if group.kind != "shm":
        with pytest.raises(ValueError, match="no shared-memory all-reduce"):
            group.probe("shm", 576, 5)
    # the other rank is still in step: forwards run on both and give the right tokens
    prompts = _prompts()[:3]
    one_rank = Engine(load_model(str(path)), CONFIG)
    assert _run(ranked.engine, prompts)[0] == _run(one_rank, prompts)[0]

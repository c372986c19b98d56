"""Layer-wise prefill on one engine, K/V written into another's reserved blocks, decode
there: the same tokens as one engine doing both."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from attention_backends import backend_params
from splitserve.sampling import SamplingParams
from splitserve_worker.engine.config import EngineConfig
from splitserve_worker.engine.engine import Engine
from splitserve_worker.engine.errors import NoCapacity, RequestError, UnknownRequest
from splitserve_worker.engine.prefix_cache import EventKind
from splitserve_worker.models import LoadedModel, load_model

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tiny(tiny_model_path: Path) -> LoadedModel:
    torch.set_num_threads(1)
    return load_model(str(tiny_model_path))


def _colocated(engine: Engine, rid: str, prompt: list[int], sp: SamplingParams) -> list[int]:
    engine.add_request(rid, prompt, sp)
    toks: list[int] = []
    while engine.has_work():
        for o in engine.step():
            toks += o.new_token_ids
    return toks


def _disaggregated(
    pre: Engine, dec: Engine, rid: str, prompt: list[int], sp: SamplingParams
) -> tuple[list[int], list[int]]:
    blocks = dec.reserve(rid, len(prompt))
    assert dec.kv.free_blocks == dec.kv.total_blocks - len(blocks)
    layers: list[int] = []

    def on_layer(layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        layers.append(layer)
        assert k.shape[1:] == (dec.kv.num_kv_heads, dec.kv.head_dim)
        assert 0 < k.shape[0] <= len(prompt) - start
        dec.write_layer(rid, layer, start, k, v)

    res = pre.prefill_export(rid, prompt, sp, on_layer)
    dec.admit_prefilled(rid, prompt, res.first_token, res.first_logprob, sp)
    toks = [res.first_token]
    while dec.has_work():
        for o in dec.step():
            toks += o.new_token_ids
    return toks, layers


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("n", [1, 7, 16, 40, 130])
def test_disaggregated_greedy_equals_colocated(tiny: LoadedModel, n: int, backend: str) -> None:
    """Prefilled layer by layer on one engine, admitted and decoded on another, each with
    ``backend``: the tokens of one sdpa engine doing both."""
    prompt = [random.Random(n).randrange(3, 256) for _ in range(n)]
    sp = SamplingParams(max_tokens=10)
    both = Engine(tiny, EngineConfig(num_blocks=64, attention_backend="sdpa"))
    pre = Engine(tiny, EngineConfig(num_blocks=64, role="prefill", max_batch_tokens=64,
                                    attention_backend=backend))  # fmt: skip
    dec = Engine(tiny, EngineConfig(num_blocks=64, role="decode", attention_backend=backend))
    want = _colocated(both, "a", prompt, sp)
    got, layers = _disaggregated(pre, dec, "a", prompt, sp)
    assert got == want
    nl = tiny.config.num_hidden_layers
    chunks = -(-n // 64)
    assert layers == list(range(nl)) * chunks
    assert pre.kv.free_blocks == pre.kv.total_blocks
    assert dec.kv.free_blocks == dec.kv.total_blocks


def test_seeded_sampling_is_the_same_split_or_not(tiny: LoadedModel) -> None:
    prompt = list(range(10, 50))
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=5, max_tokens=12)
    want = _colocated(Engine(tiny, EngineConfig(num_blocks=32)), "s", prompt, sp)
    pre = Engine(tiny, EngineConfig(num_blocks=32))
    dec = Engine(tiny, EngineConfig(num_blocks=32))
    got, _ = _disaggregated(pre, dec, "s", prompt, sp)
    assert got == want


def test_callback_runs_before_the_next_layer(tiny: LoadedModel) -> None:
    pre = Engine(tiny, EngineConfig(num_blocks=16))
    seen: list[tuple[int, int]] = []
    layers = pre.runner.layers
    calls = {"n": 0}
    hooks = [
        layer.post_attention_layernorm.register_forward_hook(
            lambda *_a, i=i: seen.append((i, calls["n"]))
        )
        for i, layer in enumerate(layers)
    ]
    try:

        def on_layer(layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
            calls["n"] += 1

        pre.prefill_export("x", list(range(3, 30)), None, on_layer)
    finally:
        for h in hooks:
            h.remove()
    # when layer i reached its MLP, exactly the callbacks of layers 0..i-1 had been made
    assert calls["n"] == len(layers)
    assert seen == [(i, i) for i in range(len(layers))]


def test_prefill_export_exports_cached_prefix_and_caches_blocks(tiny: LoadedModel) -> None:
    pre = Engine(tiny, EngineConfig(num_blocks=32))
    prompt = list(range(3, 3 + 40))
    first: dict[int, torch.Tensor] = {}
    pre.prefill_export("a", prompt, None, lambda i, k, v, s: first.setdefault(i, k.clone()))
    stored = [e for e in pre.drain_events() if e.kind is EventKind.STORED]
    hashes = [h for e in stored for h in e.block_hashes]
    assert hashes == pre.block_hashes(prompt)  # the two full blocks
    second: dict[int, tuple[torch.Tensor, int]] = {}
    res = pre.prefill_export("b", prompt, None, lambda i, k, v, s: second.setdefault(i, (k, s)))
    assert res.num_cached_tokens == 32
    for i, (k, s) in second.items():
        assert s == 0 and k.shape[0] == len(prompt)
        torch.testing.assert_close(k, first[i], rtol=1e-4, atol=1e-5)
    assert pre.kv.free_blocks == pre.kv.total_blocks


def test_reserve_release_and_errors(tiny: LoadedModel) -> None:
    dec = Engine(
        tiny,
        EngineConfig(num_blocks=8, max_num_seqs=2, max_batch_tokens=16, prefill_chunk_tokens=16),
    )
    ids = dec.reserve("a", 33)
    assert len(ids) == 3 and dec.kv.free_blocks == 5
    with pytest.raises(RequestError, match="already in use"):
        dec.reserve("a", 4)
    with pytest.raises(NoCapacity):
        dec.reserve("b", 6 * 16)
    dec.reserve("b", 4)
    with pytest.raises(NoCapacity, match="batch full"):
        dec.reserve("c", 4)
    with pytest.raises(RequestError, match="outside the reserved"):
        dec.write_layer("a", 0, 30, torch.zeros(5, 2, 16), torch.zeros(5, 2, 16))
    with pytest.raises(UnknownRequest):
        dec.write_layer("zz", 0, 0, torch.zeros(1, 2, 16), torch.zeros(1, 2, 16))
    with pytest.raises(RequestError, match="reserved"):
        dec.admit_prefilled("a", [5] * 10, 7, None)
    assert dec.release("a") == 3
    assert dec.release("a") == 0
    assert dec.release("b") == 1
    assert dec.kv.free_blocks == dec.kv.total_blocks
    with pytest.raises(UnknownRequest):
        dec.admit_prefilled("a", [5] * 33, 7, None)


def test_admitted_request_that_is_already_done(tiny: LoadedModel) -> None:
    dec = Engine(tiny, EngineConfig(num_blocks=8))
    dec.reserve("a", 5)
    dec.admit_prefilled("a", [4] * 5, 9, None, SamplingParams(max_tokens=1))
    (out,) = dec.step()
    assert out.finished and out.finish_reason == "length" and out.new_token_ids == []
    assert dec.kv.free_blocks == dec.kv.total_blocks


def test_prefill_export_without_room_says_so(tiny: LoadedModel) -> None:
    pre = Engine(tiny, EngineConfig(num_blocks=4))
    pre.reserve("hold", 40)
    with pytest.raises(NoCapacity, match="free KV blocks"):
        pre.prefill_export("a", list(range(3, 40)), None, lambda *a: None)
    pre.release("hold")
    assert pre.kv.free_blocks == 4

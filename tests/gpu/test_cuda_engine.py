"""The engine's CUDA-only paths: each attention backend against ``generate`` on CUDA,
decode steps replayed as CUDA graphs against the same steps run eagerly, sampling with
penalties and seeds on the GPU, and the fused q/k/v and gate/up matmuls.

Skipped where CUDA is absent (CI has none). On a GPU host: ``pytest -m gpu tests/gpu``.
The model is shaped like the built-in one (30 layers, 9 query and 3 KV heads of 64,
hidden 576) with random weights, so nothing is downloaded.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from attention_backends import backend_params
from splitserve.sampling import SamplingParams
from splitserve_worker.engine.attention.base import StaticDecodeBackend
from splitserve_worker.engine.attention.registry import make, self_check
from splitserve_worker.engine.config import EngineConfig
from splitserve_worker.engine.engine import Engine
from splitserve_worker.engine.linear import FusedLayer
from splitserve_worker.models import LoadedModel, load_model
from tiny_models import save_tiny_llama

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.integration,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MAX_NEW = 24
LENGTHS = (1, 5, 17, 64, 300, 1000)
SHAPE: dict[str, Any] = dict(
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, max_position_embeddings=8192,
)  # fmt: skip


def prompt(n: int) -> list[int]:
    return [random.Random(n).randrange(3, 256) for _ in range(n)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path: Path = save_tiny_llama(tmp_path_factory.mktemp("cuda-engine"), **SHAPE)
    return load_model(str(path), device="cuda")


@pytest.fixture(scope="module")
def reference(model: LoadedModel) -> list[list[int]]:
    out = []
    gen_cfg = model.model.generation_config
    eos, gen_cfg.eos_token_id = gen_cfg.eos_token_id, None  # as ignore_eos
    try:
        with torch.inference_mode():
            for n in LENGTHS:
                ids = torch.tensor([prompt(n)], device="cuda")
                gen = model.model.generate(ids, attention_mask=torch.ones_like(ids),
                                           do_sample=False, max_new_tokens=MAX_NEW,
                                           pad_token_id=0)  # fmt: skip
                out.append(gen[0, n:].tolist())
    finally:
        gen_cfg.eos_token_id = eos
    return out


Requests = dict[str, tuple[list[int], SamplingParams]]


def run(engine: Engine, params: Requests) -> dict[str, list[int]]:
    for rid, (p, sp) in params.items():
        engine.add_request(rid, p, sp)
    got: dict[str, list[int]] = {rid: [] for rid in params}
    while engine.has_work():
        for o in engine.step():
            assert o.error is None, o.error
            got[o.request_id] += o.new_token_ids
    assert engine.kv.free_blocks == engine.kv.total_blocks
    return got


def greedy() -> Requests:
    sp = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    return {f"r{i}": (prompt(n), sp) for i, n in enumerate(LENGTHS)}


@pytest.mark.parametrize("backend", backend_params("cuda", torch.float32))
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_each_backend_matches_generate_on_cuda(
    model: LoadedModel, reference: list[list[int]], backend: str, graphs: bool
) -> None:
    cfg = EngineConfig(num_blocks=2048, attention_backend=backend, cuda_graphs=graphs,
                       max_batch_tokens=512, prefill_chunk_tokens=256)  # fmt: skip
    engine = Engine(model, cfg)
    assert engine.attention.name == backend
    got = run(engine, greedy())
    assert [got[f"r{i}"] for i in range(len(LENGTHS))] == reference
    replayed = engine.decode_graphs
    if graphs and isinstance(engine.attention, StaticDecodeBackend):
        assert replayed is not None and replayed.capture
        assert replayed.stats.captures >= 1 and replayed.stats.replays > MAX_NEW // 2
    elif not graphs:
        assert replayed is None


def test_auto_takes_flex_with_graphs_on_cuda(model: LoadedModel) -> None:
    engine = Engine(model, EngineConfig(num_blocks=512))
    assert engine.attention.name == "flex", engine.describe()
    assert engine.decode_graphs is not None and engine.decode_graphs.capture
    assert isinstance(engine.runner.matmuls[0], FusedLayer)
    attn = model.model.model.layers[0].self_attn
    # the model's own projections are slices of one fused weight: no second copy
    assert attn.k_proj.weight.untyped_storage().data_ptr() == (
        attn.q_proj.weight.untyped_storage().data_ptr()
    )


def test_replayed_steps_give_the_tokens_of_the_same_steps_run_eagerly(
    model: LoadedModel,
) -> None:
    """The same padded static-buffer steps, replayed from graphs or run eagerly, as
    requests of different lengths join and finish (steps move between buckets); greedy
    and seeded sampled requests alike."""

    def params() -> Requests:
        out = {}
        for i in range(20):
            n = 4 + 3 * i
            sp = SamplingParams(max_tokens=n, ignore_eos=True)
            if i % 3:
                sp = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.9, top_p=0.9,
                                    seed=i)  # fmt: skip
            out[f"q{i}"] = (prompt(10 + 37 * i), sp)
        return out

    eager_cfg = EngineConfig(num_blocks=2048, static_decode=True, cuda_graphs=False)
    eager_engine = Engine(model, eager_cfg)
    assert eager_engine.decode_graphs is not None and not eager_engine.decode_graphs.capture
    eager = run(eager_engine, params())
    engine = Engine(model, EngineConfig(num_blocks=2048, cuda_graphs=True))
    replayed = run(engine, params())
    assert replayed == eager
    graphs = engine.decode_graphs
    assert graphs is not None and graphs.capture and len(graphs.stats.buckets) >= 3
    assert graphs.stats.replays > graphs.stats.captures


def test_penalties_bias_and_seeds_sample_on_the_gpu(model: LoadedModel) -> None:
    sp = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.8, top_k=40, min_p=0.01,
                        presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2,
                        logit_bias=((5, 3.0),), logprobs=True, top_logprobs=3, seed=11)  # fmt: skip
    alone = run(Engine(model, EngineConfig(num_blocks=512)), {"s": (prompt(40), sp)})
    crowd = {f"o{i}": (prompt(20 + i), SamplingParams(max_tokens=10, temperature=1.0))
             for i in range(6)}  # fmt: skip
    crowd["s"] = (prompt(40), sp)
    together = run(Engine(model, EngineConfig(num_blocks=512)), crowd)
    assert together["s"] == alone["s"] and len(alone["s"]) == 16


@pytest.mark.parametrize("backend", backend_params("cuda", torch.bfloat16))
def test_each_backend_agrees_with_sdpa_in_bfloat16(backend: str, tmp_path: Path) -> None:
    lm = load_model(str(save_tiny_llama(tmp_path, dtype="bfloat16", **SHAPE)), device="cuda")
    engine = Engine(lm, EngineConfig(num_blocks=256, attention_backend="sdpa"))
    shape = engine.runner.attention.shape  # type: ignore[attr-defined]
    kv = engine.kv.layer_blocks(0)
    assert self_check(make(backend, shape, 16), shape, kv) is None

"""Tensor parallelism over NCCL: a two-rank engine on two GPUs (rank 0 in this process,
rank 1 a process of its own on the second GPU) gives transformers' greedy tokens in
float32, batched with chunked prefill and prefix-cache hits, and its layer-wise prefill
hands over every KV head as a one-rank engine's does, from GPU memory.

Skipped without two CUDA devices (one GPU cannot hold two NCCL ranks)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from splitserve.sampling import SamplingParams
from splitserve_worker.engine.config import EngineConfig
from splitserve_worker.engine.engine import Engine
from splitserve_worker.models import load_model
from splitserve_worker.server.ranks import start_ranked_engine
from tiny_models import save_tiny_llama

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.integration,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="needs two CUDA devices",
    ),
]

MAX_NEW = 16
CONFIG = EngineConfig(num_blocks=256, max_batch_tokens=128, prefill_chunk_tokens=64,
                      dtype="float32", device="cuda", attention_backend="sdpa")  # fmt: skip


def test_tp2_over_nccl_gives_generates_tokens(tmp_path: Path) -> None:
    path = save_tiny_llama(tmp_path / "m", hidden_size=256, num_attention_heads=8,
                           num_key_value_heads=2, intermediate_size=512)  # fmt: skip
    rng = random.Random(3)
    shared = [rng.randrange(3, 256) for _ in range(40)]
    prompts = [
        (shared if i % 2 else []) + [rng.randrange(3, 256) for _ in range(n)]
        for i, n in enumerate((1, 7, 33, 90, 200, 16, 17, 64))
    ]
    loaded = load_model(str(path), dtype="float32", device="cuda")
    want = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            out = loaded.model.generate(ids, attention_mask=torch.ones_like(ids),
                                        max_new_tokens=MAX_NEW, do_sample=False,
                                        pad_token_id=loaded.tokenizer.pad_token_id)  # fmt: skip
            want.append(out[0, len(p) :].tolist())
    ranked = start_ranked_engine(str(path), 2, CONFIG, allreduce="nccl")
    try:
        engine = ranked.engine
        assert engine.group is not None and engine.group.kind == "nccl"
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, SamplingParams(max_tokens=MAX_NEW))
        got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        while engine.has_work():
            for o in engine.step():
                assert o.error is None, o.error
                got[o.request_id] += o.new_token_ids
        assert [got[f"r{i}"] for i in range(len(prompts))] == want
        assert engine.kv.free_blocks == engine.kv.total_blocks

        tp1 = Engine(loaded, CONFIG)
        exported: list[list[torch.Tensor]] = [[], []]
        for j, e in enumerate((tp1, engine)):
            e.prefill_export(f"x{j}", prompts[4], SamplingParams(max_tokens=1),
                             lambda i, k, v, s, j=j: exported[j].append(k.clone()))  # fmt: skip
        for a, b in zip(exported[0], exported[1], strict=True):
            assert a.is_cuda and b.is_cuda and a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    finally:
        ranked.close()
    assert all(p.poll() is not None for p in ranked.ranks.procs)

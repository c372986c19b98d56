"""The CUDA paths: the engine, worker processes and every KV backend on one GPU.

Skipped where CUDA is absent (CI has none). On a GPU host: ``tests/gpu/README.md``.
Models have random weights, so nothing is downloaded. Checksums are off throughout:
their host copy would order the device work that the transports must order themselves.

- The engine on CUDA gives transformers' greedy tokens on CUDA (float32), batched, on a
  model shaped like the built-in one (30 layers, 9 query and 3 KV heads of 64).
- A request prefilled in one CUDA worker process and decoded in another gives the tokens
  of one ``both`` worker and of ``generate``, over ``tcp``, ``grpc`` and ``nixl`` (the
  pool registered as GPU memory), for prompts of a few tokens to 3,000; afterwards no
  block is held on either side.
- On a bfloat16 model large enough that the GPU runs behind the engine thread (hidden
  2048, 6,000-token prompts), disaggregated tokens over each backend equal colocated
  ones: a transport that read a layer before the GPU wrote it would differ.
  Against transformers, at least ``bf16_agreement.MIN_AGREEMENT`` of those tokens are
  its own choice teacher-forced (the rest rounding ties within ``MAX_TIE_GAP`` logits).
- A streamed completion through the router over the CUDA workers equals ``generate``.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from bf16_agreement import teacher_forced_agreement
from splitserve.roles import Role
from splitserve.sampling import SamplingParams
from splitserve.v1 import worker_pb2 as pb
from splitserve_worker.client import WorkerClient
from splitserve_worker.commands.up import WorkerProcs
from splitserve_worker.engine.config import EngineConfig
from splitserve_worker.engine.engine import Engine
from splitserve_worker.kv.transport import unavailable_reason
from splitserve_worker.models import load_model
from splitserve_worker.router.discovery import WorkerEndpoint
from stack_kit import ALWAYS_REMOTE, router
from tiny_models import save_tiny_llama
from worker_kit import all_free, collect, prompt_of, split_request

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

LENGTHS = (3, 40, 700, 3000)
MAX_NEW = 16
NUM_BLOCKS = "1024"  # three workers share one GPU: each pool sized, not a share of free memory
LONG = 6000
"""Prompt length on the large model: a 6,000-token prefill keeps the GPU behind."""
CHUNK = "2048"
"""Prefill chunk on both sides alike (the prefill worker's ``--max-batch-tokens`` and the
colocated worker's ``--prefill-chunk-tokens``): in bfloat16 the same chunks give the same
bits, so split and colocated tokens may be compared exactly."""
NIXL_SKIP = unavailable_reason("nixl")
BACKENDS = ["tcp", "grpc", pytest.param("nixl", marks=[pytest.mark.nixl, pytest.mark.skipif(
    NIXL_SKIP is not None, reason=NIXL_SKIP or "")])]  # fmt: skip
BUILTIN_SHAPE: dict[str, Any] = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
)
LARGE_SHAPE: dict[str, Any] = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=12,
    num_attention_heads=16,
    num_key_value_heads=4,
    max_position_embeddings=8192,
    initializer_range=0.02,  # a deep bf16 model at 0.1 overflows to the same token each step
)
"""About 0.75 B parameters: each layer of a 6,000-token prefill is ~1 TFLOP of GPU work,
several times what the engine thread takes to queue it."""


@pytest.fixture(scope="module")
def model_f32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("gpu-f32"), **BUILTIN_SHAPE)


@pytest.fixture(scope="module")
def model_large_bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("gpu-bf16"), dtype="bfloat16", **LARGE_SHAPE)


def generate_on_cuda(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy ``generate`` on CUDA in the checkpoint's dtype, EOS ignored."""
    loaded = load_model(str(path), device="cuda")
    model = loaded.model
    model.generation_config.eos_token_id = None
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=MAX_NEW, pad_token_id=0)  # fmt: skip
            out.append(gen[0, len(p) :].tolist())
    del loaded, model
    torch.cuda.empty_cache()
    return out


@pytest.fixture(scope="module")
def reference(model_f32: Path) -> list[list[int]]:
    return generate_on_cuda(model_f32, [prompt_of(n) for n in LENGTHS])


def trio(path: Path, *extra: str) -> WorkerProcs:
    """A prefill, a decode and a both worker on the GPU, checksums off."""
    backend = "tcp" if NIXL_SKIP else "nixl"
    roles = [Role.PREFILL, Role.DECODE, Role.BOTH]
    args = ["--device", "cuda", "--num-blocks", NUM_BLOCKS, *extra]
    return WorkerProcs(str(path), roles, secrets.token_hex(8), kv_backend=backend,
                       extra_args=args, echo=False)  # fmt: skip


@pytest.fixture(scope="module")
def workers_f32(model_f32: Path) -> Iterator[tuple[WorkerProcs, list[WorkerEndpoint]]]:
    with trio(model_f32) as procs:
        yield procs, procs.start(timeout_s=300)


@pytest.fixture(scope="module")
def workers_large_bf16(
    model_large_bf16: Path,
) -> Iterator[tuple[WorkerProcs, list[WorkerEndpoint]]]:
    chunks = ["--max-batch-tokens", CHUNK, "--prefill-chunk-tokens", CHUNK]
    with trio(model_large_bf16, *chunks) as procs:
        yield procs, procs.start(timeout_s=300)


def long_prompt(n: int, backend: str) -> list[int]:
    """A prompt of its own per backend: no prefix-cache hit shortens a later prefill."""
    salt = sum(map(ord, backend))
    return [3 + (i * 131 + salt) % 250 for i in range(n)]


async def split_and_colocated(
    token: str,
    eps: list[WorkerEndpoint],
    backend: str,
    tag: str,
    prompts: list[list[int]],
    layers: int,
) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """Each prompt once disaggregated (prefill -> decode over ``backend``) and once on
    the ``both`` worker: (split tokens, colocated tokens, bytes pushed per prompt)."""
    p, d, b = (WorkerClient(e.address, token) for e in eps)
    sp = pb.SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    split, colocated, sent = [], [], []
    try:
        for h in (await p.health(), await d.health(), await b.health()):
            assert h.compat.num_layers == layers
        for prompt in prompts:
            n = len(prompt)
            colocated.append(await collect(b.generate(f"{tag}-both-{backend}-{n}", prompt, sp)))
            rid = f"{tag}-split-{backend}-{n}"
            tokens, resp = await split_request(p, d, rid, prompt, sp, backend, timeout=120)
            split.append(tokens)
            assert resp.first_token == tokens[0]
            sent.append(resp.bytes_sent)
            print(f"{tag} {backend} {n} tokens: {resp.bytes_sent / 1e6:.1f} MB in "
                  f"{resp.transfer_seconds * 1e3:.1f} ms, exposed "
                  f"{resp.exposed_transfer_seconds * 1e3:.2f} ms, prefill "
                  f"{resp.prefill_seconds * 1e3:.1f} ms")  # fmt: skip
        for c in (p, d):
            h = await all_free(c)
            assert (h.free_blocks, h.leases) == (h.total_blocks, 0)
    finally:
        for c in (p, d, b):
            await c.close()
    return split, colocated, sent


def test_engine_on_cuda_matches_generate(model_f32: Path, reference: list[list[int]]) -> None:
    engine = Engine(load_model(str(model_f32), device="cuda"), EngineConfig(num_blocks=1024))
    assert engine.device.type == "cuda" and engine.kv.pool.is_cuda
    for i, n in enumerate(LENGTHS):  # all at once: batched decode, chunked prefill
        engine.add_request(f"r{i}", prompt_of(n), SamplingParams(max_tokens=MAX_NEW,
                                                                 ignore_eos=True))  # fmt: skip
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(LENGTHS))}
    while engine.has_work():
        for o in engine.step():
            assert o.error is None, o.error
            got[o.request_id] += o.new_token_ids
    assert [got[f"r{i}"] for i in range(len(LENGTHS))] == reference
    assert engine.kv.blocks.free_blocks == 1024


@pytest.mark.parametrize("backend", BACKENDS)
def test_split_on_cuda_matches_colocated_and_generate(
    workers_f32: tuple[WorkerProcs, list[WorkerEndpoint]],
    reference: list[list[int]],
    backend: str,
) -> None:
    procs, eps = workers_f32
    prompts = [prompt_of(n) for n in LENGTHS]
    split, colocated, sent = asyncio.run(
        split_and_colocated(procs.token, eps, backend, "f32", prompts, layers=30)
    )
    assert colocated == reference
    assert split == reference
    per_token = 30 * 2 * 3 * 64 * 4  # layers, K and V, KV heads, head dim, float32
    assert sent == [n * per_token for n in LENGTHS]


@pytest.mark.parametrize("backend", BACKENDS)
def test_split_from_a_gpu_running_behind_matches_colocated_in_bf16(
    workers_large_bf16: tuple[WorkerProcs, list[WorkerEndpoint]],
    model_large_bf16: Path,
    backend: str,
) -> None:
    procs, eps = workers_large_bf16
    prompts = [long_prompt(LONG, backend), long_prompt(LONG // 3, backend)]
    split, colocated, sent = asyncio.run(
        split_and_colocated(procs.token, eps, backend, "bf16", prompts, layers=12)
    )
    assert len({t for c in colocated for t in c}) > 1, "the model only repeats one token"
    assert split == colocated
    per_token = 12 * 2 * 4 * 128 * 2  # layers, K and V, KV heads, head dim, bfloat16
    assert sent == [len(p) * per_token for p in prompts]
    # transformers' own bf16 kernels round differently, so free-running outputs part at
    # the first near-tie: judge each token against transformers teacher-forced on the
    # same tokens, at least MIN_AGREEMENT of them its choice and the rest rounding ties
    if backend == BACKENDS[0]:
        loaded = load_model(str(model_large_bf16), device="cuda")
        try:
            teacher_forced_agreement(loaded.model, prompts, colocated).check()
        finally:
            del loaded
            torch.cuda.empty_cache()


def test_router_stream_over_cuda_workers(
    workers_f32: tuple[WorkerProcs, list[WorkerEndpoint]],
    model_f32: Path,
    reference: list[list[int]],
) -> None:
    from transformers import AutoTokenizer

    procs, eps = workers_f32
    tok = AutoTokenizer.from_pretrained(str(model_f32))
    rt = router(procs.token, tok, [eps[0], eps[1]], disaggregation=ALWAYS_REMOTE)
    body = {"prompt": prompt_of(700), "max_tokens": MAX_NEW, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    with rt as base, httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(x) for x in lines[:-1]]
    ids = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []]
    assert ids == reference[2]
    assert chunks[-1]["usage"]["completion_tokens"] == MAX_NEW

"""Tensor-parallel workers through the router's API: a prefill worker over two ranks
handing off to a decode worker over one (over the tcp and the grpc KV backends), and a
colocated worker over two ranks, give transformers' greedy tokens, and the same seeded
samples as each other; the ranks' processes end with their worker."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from splitserve.roles import Role
from splitserve_worker.commands.up import WorkerProcs
from splitserve_worker.router.discovery import WorkerEndpoint
from stack_kit import (  # noqa: F401  (fixtures)
    ALWAYS_REMOTE,
    PROMPTS,
    alive,
    child_pids,
    complete,
    decisions,
    reference_fixture,
    router,
    tokenizer_fixture,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TP = {Role.PREFILL: 2, Role.DECODE: 1, Role.BOTH: 2}


@pytest.fixture(scope="module")
def tp_workers(tiny_model_path: Path) -> Iterator[tuple[str, list[WorkerEndpoint], list[int]]]:
    token = secrets.token_hex(8)
    roles = [Role.PREFILL, Role.DECODE, Role.BOTH]
    procs = WorkerProcs(str(tiny_model_path), roles, token, threads=1, echo=False,
                        tensor_parallel=TP)  # fmt: skip
    with procs:
        eps = procs.start(timeout_s=300)
        ranks = [c for wp in procs.procs for c in child_pids(wp.proc.pid)]
        assert len(ranks) == 2  # one more rank each for the prefill and colocated workers
        yield token, eps, ranks
    assert not [p for p in ranks if alive(p)]


def _stack(eps: list[WorkerEndpoint], role: str) -> list[WorkerEndpoint]:
    by = {e.role: e for e in eps}
    return [by[Role.PREFILL], by[Role.DECODE]] if role == "disaggregated" else [by[Role.BOTH]]


@pytest.mark.parametrize(
    ("stack", "backend"),
    [("disaggregated", "tcp"), ("disaggregated", "grpc"), ("colocated", "tcp")],
)
def test_tp_stacks_give_transformers_greedy_tokens(
    stack: str, backend: str, tp_workers: Any, tokenizer: Any, reference: list[list[int]]
) -> None:
    token, eps, _ = tp_workers
    extra: dict[str, Any] = {"disaggregation": ALWAYS_REMOTE} if stack == "disaggregated" else {}
    with router(token, tokenizer, _stack(eps, stack), kv_backend=backend, **extra) as base:
        for prompt, want in zip(PROMPTS, reference, strict=True):
            assert complete(base, prompt, stream=False) == want
            assert complete(base, prompt, stream=True) == want
        made = decisions(base)
    kind = "remote" if stack == "disaggregated" else "local"
    assert made.get(kind, 0) == 2 * len(PROMPTS)


def test_seeded_samples_agree_across_tp_stacks(tp_workers: Any, tokenizer: Any) -> None:
    token, eps, _ = tp_workers
    got = []
    for stack in ("disaggregated", "colocated"):
        extra = {"disaggregation": ALWAYS_REMOTE} if stack == "disaggregated" else {}
        with router(token, tokenizer, _stack(eps, stack), **extra) as base:
            got.append([complete(base, p, stream=False, temperature=0.9, seed=11) for p in PROMPTS])
    assert got[0] == got[1]

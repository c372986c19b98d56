"""The correctness guard on real worker processes: with the prefill worker flipping a byte
of every pushed layer (``SPLITSERVE_FAULT_KV_CORRUPT_PROB=1``) and KV checksums off, the
guard's local re-run on the decode worker disagrees with what the user was sent, within
the configured sample, and says so in ``splitserve_guard_checks_total`` and the log; on a
clean transfer every re-run matches (the re-run reads none of the blocks the push filled,
or it could not tell them apart)."""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from splitserve.metric_names import GUARD_CHECKS
from splitserve.roles import Role
from splitserve_worker.commands.up import WorkerProcs
from splitserve_worker.kv.faults import ENV_CORRUPT, ENV_SEED
from splitserve_worker.router.config import GuardConfig
from stack_kit import ALWAYS_REMOTE, PROMPTS, router, tokenizer_fixture  # noqa: F401

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SAMPLE = 2
"""One request in SAMPLE is re-run: the mismatch must show within that many."""
NO_CHECKSUMS = ["--checksum-every", "0"]


def guard_outcomes(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics").text
    found = re.findall(GUARD_CHECKS.name + r'\{outcome="(\w+)"\} (\S+)', text)
    return {k: float(v) for k, v in found if float(v)}


def complete(base: str, prompt: list[int]) -> list[int]:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    ids: list[int] = r.json()["choices"][0]["token_ids"]
    assert len(ids) == 8
    return ids


@pytest.fixture(scope="module")
def corrupt_workers(tiny_model_path: Path) -> Iterator[tuple[str, Any]]:
    token = secrets.token_hex(8)
    with WorkerProcs(str(tiny_model_path), [Role.PREFILL, Role.DECODE], token, threads=1,
                     extra_args=NO_CHECKSUMS, echo=False) as procs:  # fmt: skip
        with pytest.MonkeyPatch.context() as env:  # the workers' environment, theirs alone
            env.setenv(ENV_CORRUPT, "1.0")
            env.setenv(ENV_SEED, "11")
            eps = procs.start(timeout_s=300)
        yield token, eps


@pytest.fixture(scope="module")
def clean_workers(tiny_model_path: Path) -> Iterator[tuple[str, Any]]:
    token = secrets.token_hex(8)
    with WorkerProcs(str(tiny_model_path), [Role.PREFILL, Role.DECODE], token, threads=1,
                     extra_args=NO_CHECKSUMS, echo=False) as procs:  # fmt: skip
        yield token, procs.start(timeout_s=300)


def test_corrupt_kv_is_caught_by_the_guard_within_its_sample(
    corrupt_workers: tuple[str, Any], tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    token, eps = corrupt_workers
    guard = GuardConfig(sample_share=1 / SAMPLE, min_interval_s=3600.0)
    rt = router(token, tokenizer, eps, disaggregation=ALWAYS_REMOTE, guard=guard)
    with rt as base:
        for prompt in PROMPTS[:SAMPLE]:
            complete(base, prompt)  # each answered, wrong or not: the guard never fails one
        rt.call(rt.service.dispatcher.drain(timeout=60.0), timeout=90.0)
        outcomes = guard_outcomes(base)
    assert outcomes == {"mismatch": 1.0}, outcomes
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "correctness guard: request cmpl-" in logged, logged[-2000:]


def test_on_clean_kv_every_rerun_matches(clean_workers: tuple[str, Any], tokenizer: Any) -> None:
    token, eps = clean_workers
    rt = router(token, tokenizer, eps, disaggregation=ALWAYS_REMOTE,
                guard=GuardConfig(sample_share=1.0))  # fmt: skip
    with rt as base:
        for prompt in PROMPTS:
            complete(base, prompt)
        rt.call(rt.service.dispatcher.drain(timeout=60.0), timeout=90.0)
        outcomes = guard_outcomes(base)
    assert outcomes == {"match": float(len(PROMPTS))}, outcomes

"""A worker that evicts cached blocks under pressure tells the router, and the router's
prefix index drops them: real worker processes with small KV pools, a router in this
process, and the index read on the router's own event loop."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from splitserve.prefix_hash import block_hashes
from splitserve.roles import Role
from splitserve_worker.commands.up import WorkerProcs
from splitserve_worker.router.discovery import WorkerEndpoint
from splitserve_worker.router.local import RouterThread
from stack_kit import ALWAYS_REMOTE, router, tokenizer_fixture  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BLOCK = 16
POOL_BLOCKS = 32
"""Each worker's whole KV pool: four prompts of eight blocks fill it, a fifth evicts."""
PROMPT_BLOCKS = 8
PRESSURE = 5
"""Prompts sent after the first, each of PROMPT_BLOCKS new blocks: 40 > POOL_BLOCKS."""


def prompt(salt: int) -> list[int]:
    """PROMPT_BLOCKS full blocks, sharing no block with another salt's."""
    return [3 + salt] + [3 + (i * 37 + salt * 101) % 250 for i in range(PROMPT_BLOCKS * BLOCK - 1)]


@pytest.fixture(scope="module")
def small_pools(tiny_model_path: Path) -> Iterator[tuple[str, list[WorkerEndpoint]]]:
    token = secrets.token_hex(8)
    roles = [Role.PREFILL, Role.DECODE]
    extra = ["--num-blocks", str(POOL_BLOCKS)]
    with WorkerProcs(str(tiny_model_path), roles, token, threads=1, extra_args=extra,
                     echo=False) as procs:  # fmt: skip
        yield token, procs.start(timeout_s=300)


def held(rt: RouterThread, tokens: list[int]) -> dict[str, int]:
    """Leading blocks of ``tokens`` the router's index says each worker holds."""
    index = rt.service.planner.index
    hashes = block_hashes(tokens, BLOCK)

    async def look() -> dict[str, int]:
        return index.match(hashes)

    return rt.call(look())


def blocks_known(rt: RouterThread, worker: str) -> int:
    index = rt.service.planner.index

    async def look() -> int:
        return index.blocks_of(worker)

    return rt.call(look())


def wait_until(check: Any, what: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (got := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.05)
    return got


def complete(base: str, tokens: list[int]) -> None:
    r = httpx.post(f"{base}/v1/completions", json={"prompt": tokens, "max_tokens": 2,
                   "temperature": 0, "ignore_eos": True}, timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text


def _whole(blocks: int) -> int:
    """``blocks`` once a whole prompt's blocks are indexed (0 before: not yet)."""
    return blocks if blocks >= PROMPT_BLOCKS - 1 else 0


def test_blocks_a_worker_evicts_leave_the_routers_prefix_index(
    small_pools: tuple[str, list[WorkerEndpoint]], tokenizer: Any
) -> None:
    token, eps = small_pools
    prefill = next(e.name for e in eps if e.role is Role.PREFILL)
    names = [e.name for e in eps]
    rt = router(token, tokenizer, eps, disaggregation=ALWAYS_REMOTE)
    with rt as base:
        # the router follows the events before anything is measured: a first prompt shows
        complete(base, prompt(0))
        wait_until(lambda: held(rt, prompt(0)).get(prefill), "the first STORED events")
        first = prompt(1)
        complete(base, first)
        # STORED events come in batches: wait for the whole prompt, not its first batch
        stored = wait_until(lambda: _whole(held(rt, first).get(prefill, 0)),
                            "the prompt's blocks stored")  # fmt: skip
        assert stored >= PROMPT_BLOCKS - 1, held(rt, first)
        for salt in range(2, 2 + PRESSURE):
            complete(base, prompt(salt))
        # least recently used first: the first prompt's blocks went, and the index says so
        wait_until(lambda: prefill not in held(rt, first), "the evicted blocks dropped")
        last = prompt(1 + PRESSURE)
        newest = wait_until(lambda: _whole(held(rt, last).get(prefill, 0)),
                            "the newest prompt stored")  # fmt: skip
        assert newest >= PROMPT_BLOCKS - 1, held(rt, last)
        # no worker is believed to hold more blocks than its whole pool
        for name in names:
            assert blocks_known(rt, name) <= POOL_BLOCKS, (name, blocks_known(rt, name))

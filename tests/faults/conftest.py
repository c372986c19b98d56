"""Fixtures and client helpers for fault tests; the stack itself is in ``fault_stack``.

Test modules cannot import a conftest, so the helpers reach them through the ``kit``
fixture.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from fault_stack import LEASE_S, ROUTER_CONFIG, Outcome, Relay, Stack, start_stack
from splitserve.roles import Role


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)


@pytest.fixture
def stack_factory(tmp_path: Path) -> Iterator[Any]:
    """``make(model, roles, **kw) -> Stack``; every stack made is stopped afterwards."""
    made: list[Stack] = []

    def make(model: Path, roles: Sequence[Role], **kw: Any) -> Stack:
        d = tmp_path / f"stack{len(made)}"
        d.mkdir()
        s = start_stack(model, roles, d, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()


# ---------------------------------------------------------------- clients


def prompt_of(i: int, n: int = 80, vocab: int = 256) -> list[int]:
    """A distinct prompt per ``i`` (no shared prefix beyond the first token).

    Drawn from a generator seeded with ``i``: an arithmetic formula repeated itself (its
    prompts for ``i`` and ``i + 253`` were the same), so one scenario's prompts were
    already in the prefix caches of the workers an earlier one used, and the router sent
    them back there."""
    rng = random.Random(i)
    return [1] + [rng.randrange(3, vocab) for _ in range(n - 1)]


async def one_request(
    client: httpx.AsyncClient,
    stack: Stack,
    index: int,
    prompt: list[int],
    max_tokens: int,
    bound_s: float,
    stream: bool = True,
) -> Outcome:
    """One completion; never waits longer than ``bound_s`` (then it counts as hung)."""
    out = Outcome(index)
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream, "return_token_ids": True}  # fmt: skip
    t0 = time.monotonic()

    async def run() -> None:
        url = f"{stack.base_url}/v1/completions"
        async with client.stream("POST", url, json=body, headers=stack.headers()) as r:
            out.status = r.status_code
            if r.status_code != 200:
                raw = await r.aread()
                out.error_body = json.loads(raw)
                out.error = out.error_body["error"]["message"]
                return
            if not stream:
                data = json.loads(await r.aread())
                ch = data["choices"][0]
                out.tokens = list(ch.get("token_ids") or [])
                out.finish_reason = ch["finish_reason"]
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.error_body = chunk
                    out.error = chunk["error"]["message"]
                    continue
                for c in chunk.get("choices", []):
                    out.tokens.extend(c.get("token_ids") or [])
                    if c.get("finish_reason"):
                        out.finish_reason = c["finish_reason"]

    try:
        await asyncio.wait_for(run(), bound_s)
    except TimeoutError:
        out.hung = True
    except httpx.HTTPError as e:
        out.error = f"client-side failure: {e!r}"
    out.seconds = time.monotonic() - t0
    return out


async def many_requests(
    stack: Stack, prompts: Sequence[list[int]], max_tokens: int, bound_s: float
) -> list[Outcome]:
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(bound_s), limits=limits) as client:
        return list(
            await asyncio.gather(
                *(one_request(client, stack, i, p, max_tokens, bound_s)
                  for i, p in enumerate(prompts))
            )
        )  # fmt: skip


def describe(outcomes: Sequence[Outcome]) -> str:
    bad = [o for o in outcomes if not o.completed]
    return "; ".join(
        f"#{o.index}: status={o.status} hung={o.hung} tokens={len(o.tokens)} "
        f"finish={o.finish_reason} error={o.error!r}"
        for o in bad[:8]
    )


def reference_tokens(model: Path, prompts: Sequence[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy tokens of each prompt on one in-process engine (no handoff, no fault)."""
    from splitserve.sampling import SamplingParams
    from splitserve_worker.engine.config import EngineConfig
    from splitserve_worker.engine.engine import Engine
    from splitserve_worker.models import load_model

    engine = Engine(load_model(str(model)), EngineConfig(num_blocks=1024, num_threads=1))
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    out: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, sp)
        out[str(i)] = []
    for _ in range(100_000):
        if not engine.has_work():
            break
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    return [out[str(i)] for i in range(len(prompts))]


def metric_values(text: str, name: str) -> dict[str, float]:
    """``{labels: value}`` of one metric family in Prometheus text format."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            found[key[len(name) :]] = float(value)
    return found


async def router_metric(stack: Stack, name: str) -> dict[str, float]:
    async with httpx.AsyncClient(timeout=5.0) as client:
        r = await client.get(f"{stack.base_url}/metrics")
    return metric_values(r.text, name)


@dataclass(frozen=True)
class Kit:
    """The helpers above, for test modules (which cannot import a conftest)."""

    lease_s: float = LEASE_S
    router_config: Mapping[str, Any] = field(default_factory=lambda: ROUTER_CONFIG)

    prompt_of = staticmethod(prompt_of)
    one_request = staticmethod(one_request)
    many_requests = staticmethod(many_requests)
    describe = staticmethod(describe)
    reference_tokens = staticmethod(reference_tokens)
    router_metric = staticmethod(router_metric)
    Relay = Relay


@pytest.fixture
def kit() -> Kit:
    return Kit()


FAULT_ROLES = [Role.PREFILL, Role.PREFILL, Role.DECODE, Role.DECODE, Role.DECODE]
"""Two prefill and three decode workers: room to lose one of each and still serve."""


class WholeStacks:
    """Hands each fault scenario a whole stack (:data:`FAULT_ROLES`): the one the last
    scenario left when every worker is alive, idle and seen healthy by the router
    (:meth:`Stack.gaps`), else a fresh one. No scenario inherits another's dead or
    frozen workers, or depends on the order the scenarios run in."""

    def __init__(self, model: Path, tmp: pytest.TempPathFactory) -> None:
        self.model = model
        self.tmp = tmp
        self.current: Stack | None = None
        self.started = 0
        self.replaced: list[list[str]] = []
        """Why each stack that was not whole was replaced (for the test log)."""

    def whole(self) -> Stack:
        if self.current is not None:
            gaps = asyncio.run(self.current.gaps())
            if gaps:
                self.replaced.append(gaps)
                print(f"fault stack replaced: {'; '.join(gaps)}")
                self.current.stop()
                self.current = None
        if self.current is None:
            self.current = start_stack(self.model, FAULT_ROLES, self.tmp.mktemp("fault-stack"))
            self.started += 1
            gaps = asyncio.run(self.current.gaps())
            assert not gaps, f"a fresh fault stack is not whole: {gaps}"
        return self.current

    def stop(self) -> None:
        if self.current is not None:
            self.current.stop()
            self.current = None


@pytest.fixture(scope="module")
def whole_stacks(
    tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WholeStacks]:
    stacks = WholeStacks(tiny_model_path, tmp_path_factory)
    try:
        yield stacks
    finally:
        stacks.stop()


@pytest.fixture
def fault_stack(whole_stacks: WholeStacks) -> Stack:
    """A whole stack for one fault scenario (see :class:`WholeStacks`)."""
    return whole_stacks.whole()

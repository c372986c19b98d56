"""The transports' failure-injection knob, on a real stack with 50 requests in flight.

Prefill workers run with ``SPLITSERVE_FAULT_KV_FAIL_PROB`` (a layer push fails) or
``SPLITSERVE_FAULT_KV_CORRUPT_PROB`` (a layer arrives with one byte flipped) and
``--checksums``. Every request still completes with exactly the greedy tokens of a
fault-free engine (a corrupt layer is caught, never decoded), the router retried the
hit requests, and no worker holds a block afterwards. With the knob off (the default)
nothing is injected.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from splitserve.roles import Role
from splitserve_worker.kv.faults import ENV_CORRUPT, ENV_FAIL, ENV_SEED, FaultConfig

pytestmark = [pytest.mark.slow, pytest.mark.integration]

N = 50
MAX_TOKENS = 12
BOUND_S = 60.0


def test_knob_is_off_by_default() -> None:
    assert not FaultConfig.from_env({}).enabled
    assert FaultConfig.from_env({ENV_FAIL: "0.5"}).enabled
    with pytest.raises(ValueError, match=ENV_CORRUPT):
        FaultConfig.from_env({ENV_CORRUPT: "lots"})
    with pytest.raises(ValueError, match="within"):
        FaultConfig.from_env({ENV_CORRUPT: "1.5"})


def test_failed_and_corrupt_layers_are_retried_never_decoded_never_leaked(
    tiny_model_path: Path, stack_factory: Any, kit: Any
) -> None:
    s = stack_factory(
        tiny_model_path,
        [Role.PREFILL, Role.DECODE],
        worker_env={ENV_FAIL: "0.06", ENV_CORRUPT: "0.06", ENV_SEED: "7"},
        worker_args=["--checksums"],
    )
    prompts = [kit.prompt_of(7000 + i, 64 + i) for i in range(N)]
    expected = kit.reference_tokens(tiny_model_path, prompts, MAX_TOKENS)

    async def go() -> None:
        base = await s.baseline()
        outcomes = await kit.many_requests(s, prompts, MAX_TOKENS, BOUND_S)
        assert all(o.completed for o in outcomes), kit.describe(outcomes)
        wrong = [o.index for o in outcomes if o.tokens != expected[o.index]]
        assert not wrong, f"requests {wrong} decoded different tokens than a fault-free engine"
        retries = await kit.router_metric(s, "splitserve_router_retries_total")
        assert retries.get('{reason="prefill_failed"}', 0) > 0, f"nothing was injected: {retries}"
        settled = await s.wait_settled(base)
        for i, h in settled.items():
            assert (h.free_blocks, h.leases, h.running) == (base[i], 0, 0), (i, h)
        assert len(settled) == 2

    asyncio.run(go())
    logs = "\n".join(s.logs())
    for evidence in ("injected KV transfer failure", "failed its checksum"):
        assert evidence in logs, f"the router never reported {evidence!r}"

"""A switchable worker follows its pod's role label (the downward-API labels file): a
changed label switches it in place, a label naming no role leaves it serving, and it
switches back when the label does; on an in-process worker over real gRPC."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest
from splitserve.v1 import worker_pb2 as pb
from splitserve_worker.client import WorkerClient
from splitserve_worker.server.app import start_worker
from splitserve_worker.server.config import WorkerConfig
from worker_kit import all_free, prompt_of, split_request

pytestmark = pytest.mark.integration

TOKEN = "label-token-3"
LABEL = "splitserve.io/role"
SHORT = pb.SamplingParams(max_tokens=6, ignore_eos=True)


async def until(check: Any, what: str, tries: int = 4000) -> None:
    for _ in range(tries):
        if await check():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never: {what}")


def write(path: Path, role: str) -> None:
    path.write_text(f'app.kubernetes.io/component="flex"\n{LABEL}="{role}"\n')


async def test_the_worker_switches_when_its_pods_label_changes(
    tiny_model_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import torch
    from splitserve_worker.models import load_model

    torch.set_num_threads(1)
    labels = tmp_path / "labels"
    write(labels, "decode")
    loaded = load_model(str(tiny_model_path))
    common: dict[str, Any] = {"model": str(tiny_model_path), "token": TOKEN,
                              "num_blocks": 200, "threads": 1, "drain_seconds": 0.5}  # fmt: skip
    fixed = await start_worker(WorkerConfig(role="prefill", **common), loaded=loaded)
    flex = await start_worker(
        WorkerConfig(
            role="decode",
            switchable=True,
            role_labels_file=str(labels),
            labels_poll_seconds=0.01,
            **common,
        ),
        loaded=loaded,
    )
    try:
        pc, fc = WorkerClient(fixed.address, TOKEN), WorkerClient(flex.address, TOKEN)
        base = (await fc.health()).free_blocks
        before, _ = await split_request(pc, fc, "before", prompt_of(20), SHORT)

        async def role_is(role: int) -> bool:
            h = await fc.health()
            return h.role == role and not h.switching

        write(labels, "prefill")
        await until(lambda: role_is(pb.ROLE_PREFILL), "the worker serves prefill")
        assert (await fc.health()).switches == 1
        # a label naming no role: it keeps serving prefill
        caplog.set_level(logging.WARNING, logger="splitserve_worker.server.pod_labels")

        async def refused() -> bool:
            return "keeping the role prefill" in caplog.text and "'router'" in caplog.text

        write(labels, "router")
        await until(refused, "the label naming no role refused")
        assert await role_is(pb.ROLE_PREFILL)
        write(labels, "decode")
        await until(lambda: role_is(pb.ROLE_DECODE), "the worker serves decode again")
        assert (await fc.health()).switches == 2
        after, _ = await split_request(pc, fc, "after", prompt_of(20), SHORT)
        assert after == before  # greedy: the same tokens after two switches
        assert (await all_free(fc)).free_blocks == base
    finally:
        await flex.stop(grace=0.2)
        await fixed.stop(grace=0.2)

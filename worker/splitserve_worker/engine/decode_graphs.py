"""Decode steps run from static buffers, one set per batch-size bucket, and on CUDA
captured once per bucket as a CUDA graph and replayed.

A decode step of ``n`` sequences runs padded to the smallest bucket holding ``n``
(:mod:`.attention.buckets`). Each bucket owns fixed input tensors (token ids, positions,
KV slots), a fixed logit-row index, and its attention backend's static decode plan (the
block tables as buffers): :meth:`DecodeGraphs.load` copies a step's rows into them,
padding rows read token 0 at position 0, write their K/V into the pool's scratch slot
and attend to nothing. The forward over those buffers is :meth:`ModelRunner.run
<splitserve_worker.engine.model_runner.ModelRunner.run>` itself: on CUDA it is captured
on a bucket's first use (after two warm-up runs, which also compile its kernels) and
replayed afterwards; without capture it runs eagerly over the same buffers, which is how
the CPU checks this bookkeeping.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from splitserve_worker.engine.attention.base import Span, StaticDecodeBackend
from splitserve_worker.engine.attention.buckets import bucket_for
from splitserve_worker.engine.model_runner import Chunk, ModelRunner, StepPlan

log = logging.getLogger(__name__)

WARMUP_RUNS = 2
"""Eager runs of a bucket before its capture: the first compiles and allocates, the second
runs as the graph will."""


def padded_inputs(
    chunks: Sequence[Chunk], batch: int, block_size: int, scratch_slot: int
) -> list[int]:
    """Token ids, then positions, then KV slots of a decode step's rows, each padded to
    ``batch`` rows (token 0, position 0, the scratch slot)."""
    n = len(chunks)
    if n > batch:
        raise ValueError(f"{n} rows do not fit a bucket of {batch}")
    pad = batch - n
    ids = [c.token_ids[0] for c in chunks] + [0] * pad
    pos = [c.start for c in chunks] + [0] * pad
    slots = [
        c.block_table[c.start // block_size] * block_size + c.start % block_size for c in chunks
    ] + [scratch_slot] * pad
    return [*ids, *pos, *slots]


@dataclass
class Bucket:
    """One bucket's buffers, and its graph once captured."""

    batch: int
    inputs: torch.Tensor
    """``[3, batch]``: token ids, positions, KV slots."""
    plan: StepPlan
    graph: Any = None
    logits: torch.Tensor | None = None
    """The captured run's output (overwritten by each replay)."""


@dataclass
class GraphStats:
    captures: int = 0
    replays: int = 0
    capture_failed: str | None = None
    """Why capturing stopped (steps then run eagerly from the same buffers)."""
    eager_runs: int = 0
    padding_rows: int = 0
    """Rows run only to fill a bucket, over all steps."""
    buckets: list[int] = field(default_factory=list)


class DecodeGraphs:
    """Decode steps from per-bucket static buffers (see the module's docstring)."""

    def __init__(self, runner: ModelRunner, buckets: Sequence[int], *, capture: bool) -> None:
        attention = runner.attention
        if not isinstance(attention, StaticDecodeBackend):
            raise ValueError(
                f"attention backend {runner.attention.name} has no static decode plan: "
                "decode steps cannot run from static buffers with it"
            )
        if runner.kv.scratch_slot is None:
            raise ValueError("static decode needs a KV pool with a scratch block")
        if capture and runner.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.runner = runner
        self.attention: StaticDecodeBackend = attention
        self.buckets = tuple(buckets)
        self.capture = capture
        self.stats = GraphStats()
        self._scratch = runner.kv.scratch_slot
        self._buckets: dict[int, Bucket] = {}
        self._pool: Any = torch.cuda.graph_pool_handle() if capture else None

    def takes(self, chunks: Sequence[Chunk]) -> bool:
        """Whether this step is one these buffers run: every chunk one token that wants
        its logits and no prompt scores, and a bucket big enough."""
        return (
            bool(chunks)
            and len(chunks) <= self.buckets[-1]
            and all(
                len(c.token_ids) == 1
                and c.need_logits
                and (c.scores is None or not c.scores.targets)
                for c in chunks
            )
        )

    def forward(self, chunks: Sequence[Chunk]) -> torch.Tensor:
        """Logits ``[len(chunks), vocab]`` of a decode step (see :meth:`takes`)."""
        n = len(chunks)
        size = bucket_for(n, self.buckets)
        if size is None:
            raise ValueError(f"{n} decode rows exceed the largest bucket {self.buckets[-1]}")
        bucket = self._bucket(size)
        self.load(bucket, chunks)
        self.stats.padding_rows += size - n
        if not self.capture:
            self.stats.eager_runs += 1
            return self.runner.run(bucket.plan)[:n]
        if bucket.graph is None:
            try:
                self._capture(bucket)
            except RuntimeError as e:  # run eagerly from here on, and say why
                self.capture = False
                self.stats.capture_failed = f"{type(e).__name__}: {e}"
                log.warning("CUDA graph capture of batch bucket %d failed (%s); decode steps "
                            "run eagerly from now on", size, e)  # fmt: skip
                bucket.graph = None
                self.stats.eager_runs += 1
                return self.runner.run(bucket.plan)[:n]
        else:
            bucket.graph.replay()
            self.stats.replays += 1
        assert bucket.logits is not None
        return bucket.logits[:n]

    def load(self, bucket: Bucket, chunks: Sequence[Chunk]) -> None:
        """Copy a step's rows into ``bucket``'s buffers (padded), and its block tables into
        the attention backend's static plan."""
        bs = self.runner.kv.block_size
        host = torch.tensor(
            padded_inputs(chunks, bucket.batch, bs, self._scratch), dtype=torch.long
        )
        bucket.inputs.copy_(host.view(3, bucket.batch), non_blocking=True)
        spans = [Span(i, i + 1, c.start, c.block_table) for i, c in enumerate(chunks)]
        self.attention.refill(bucket.plan.attention, spans)

    def _bucket(self, size: int) -> Bucket:
        bucket = self._buckets.get(size)
        if bucket is None:
            device = self.runner.device
            inputs = torch.zeros((3, size), dtype=torch.long, device=device)
            plan = StepPlan(
                input_ids=inputs[0],
                positions=inputs[1],
                slots=inputs[2],
                logit_rows=torch.arange(size, device=device),
                attention=self.attention.static_plan(size),
                scored=[],
            )
            bucket = self._buckets[size] = Bucket(size, inputs, plan)
            self.stats.buckets.append(size)
        return bucket

    def _capture(self, bucket: Bucket) -> None:
        """Warm ``bucket`` up, capture its forward, and replay it once (a capture records
        the work without doing it). Other threads (KV receivers) may use the GPU
        meanwhile: only this thread's calls are checked against the capture."""
        t0 = time.monotonic()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                self.runner.run(bucket.plan)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            bucket.logits = self.runner.run(bucket.plan)
        bucket.graph = graph
        graph.replay()
        self.stats.captures += 1
        log.info("captured the decode step of batch bucket %d in %.1f s", bucket.batch,
                 time.monotonic() - t0)  # fmt: skip

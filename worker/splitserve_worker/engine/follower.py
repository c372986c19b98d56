"""A tensor-parallel rank other than 0: its shard of the model, its heads' KV pool, and
a loop running whatever forward the leader rank sends (:mod:`splitserve_worker.parallel`).

It holds no requests and no scheduler: rank 0 decides every step and sends each forward's
chunks (positions and block tables) before running it itself, so the pools of all ranks
hold the same blocks for the same sequences, each with its own heads.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import torch

from splitserve_worker.engine.config import EngineConfig
from splitserve_worker.engine.forward_stack import build_forward
from splitserve_worker.engine.model_runner import ForwardStep, RankPush, StopRanks
from splitserve_worker.models import LoadedModel, torch_dtype
from splitserve_worker.parallel.collectives import ProbeAllReduce, RankGroup
from splitserve_worker.parallel.layout import TPLayout

log = logging.getLogger(__name__)


class PushSink(Protocol):
    """Where a rank's own heads of a handed-over prefill go (the server's rank senders)."""

    def layer(self, push: RankPush, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """This rank's K/V ``[n, its kv heads, head_dim]`` of ``layer``, positions from
        ``push.start_token`` (on the rank's loop: copy what is kept, return quickly)."""
        ...

    def chunk_done(self, push: RankPush) -> None:
        """Every layer of the chunk was handed over (``push.last``: the whole prompt)."""
        ...


class UnknownStep(RuntimeError):
    """The leader sent something this rank cannot run (ranks of different versions)."""


class Follower:
    def __init__(
        self, loaded: LoadedModel, config: EngineConfig, group: RankGroup, layout: TPLayout
    ) -> None:
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        dtype = loaded.dtype if config.dtype == "auto" else torch_dtype(config.dtype)
        device = torch.device(config.device or loaded.device)
        self.group = group
        self.stack = build_forward(loaded.model, config, dtype, device, group, layout)
        self.steps = 0

    @property
    def pool(self) -> torch.Tensor:
        """This rank's KV pool ``[layers, 2, blocks, block_size, its kv heads, head_dim]``."""
        return self.stack.kv.pool

    def serve(
        self, other: Callable[[object], bool] | None = None, pushes: PushSink | None = None
    ) -> None:
        """Run the leader's forwards until it says stop (or a rank is lost: raises
        :class:`~splitserve_worker.parallel.collectives.RankLost`). ``other(step)`` takes
        the steps that are not forwards (True: handled), such as a decode worker's KV
        reservations; ``pushes`` hands over this rank's heads of a prefill whose ranks
        each push their own."""
        runner = self.stack.runner
        while True:
            step = self.group.recv_step()
            if isinstance(step, StopRanks):
                return
            if isinstance(step, ProbeAllReduce):
                self.group.run_probe(step)
                continue
            if other is not None and other(step):
                continue
            if not isinstance(step, ForwardStep):
                sent = type(step).__name__
                raise UnknownStep(f"rank 0 sent {sent}; run one version on all ranks")
            push = step.push
            if push is None or pushes is None:
                runner.follow(step)
            else:
                runner.follow(step, _handing_over(pushes, push))
                pushes.chunk_done(push)
            self.steps += 1


def _handing_over(
    sink: PushSink, push: RankPush
) -> Callable[[int, torch.Tensor, torch.Tensor], None]:
    def hand_over(i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        sink.layer(push, i, k, v)

    return hand_over

"""Layer-wise prefill for the prefill role: compute a prompt, hand each layer's K/V over
as soon as that layer is done, and sample the first token."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import torch
from splitserve.sampling import SamplingParams

from splitserve_worker.engine.config import EngineConfig
from splitserve_worker.engine.errors import NoCapacity
from splitserve_worker.engine.metrics import EngineMetrics
from splitserve_worker.engine.model_runner import Chunk, ModelRunner, RankPush
from splitserve_worker.engine.requests import RequestTable
from splitserve_worker.engine.sampling import sample
from splitserve_worker.engine.scheduler import Scheduler, blocks_for
from splitserve_worker.engine.sequence import PrefillResult, SeqStatus, Sequence
from splitserve_worker.engine.stopping import StopChecker

LayerCallback = Callable[[int, torch.Tensor, torch.Tensor, int], None]
"""``on_layer(layer_idx, k, v, start_token)``: K/V ``[n, kv_heads, head_dim]`` of prompt
positions ``[start_token, start_token + n)`` of one layer."""


class LayerwisePrefill:
    """Runs one prompt outside the step loop, on the engine's thread, and hands its K/V
    over layer by layer. Its blocks come from the same pool as the batch's."""

    def __init__(
        self,
        requests: RequestTable,
        scheduler: Scheduler,
        runner: ModelRunner,
        stopper: StopChecker,
        config: EngineConfig,
        metrics: EngineMetrics | None = None,
    ) -> None:
        self.requests = requests
        self.scheduler = scheduler
        self.runner = runner
        self.stopper = stopper
        self.config = config
        self.metrics = metrics

    def run(
        self,
        request_id: str,
        prompt_token_ids: Iterable[int],
        sampling: SamplingParams | None,
        on_layer: LayerCallback,
        push: object = None,
    ) -> PrefillResult:
        """:meth:`Engine.prefill_export <splitserve_worker.engine.engine.Engine.prefill_export>`
        (see there)."""
        prompt = [int(t) for t in prompt_token_ids]
        sampling = sampling or SamplingParams()
        check = dataclasses.replace(sampling, max_tokens=1, min_tokens=0)
        self.requests.check(request_id, prompt, check)
        seq = self.requests.new_sequence(request_id, prompt, sampling)
        scheduler = self.scheduler
        bs = self.config.block_size
        blocks = scheduler.blocks
        hit = scheduler.cached_prefix(seq)
        need = blocks_for(len(prompt), bs) - len(hit)
        reclaimed = sum(1 for b in hit if blocks.refcount(b) == 0)
        if need + reclaimed > blocks.free_blocks:
            raise NoCapacity(
                f"prefill of {len(prompt)} tokens needs {need + reclaimed} free KV blocks, "
                f"{blocks.free_blocks} free",
                needed=need + reclaimed,
                free=blocks.free_blocks,
            )
        blocks.touch(hit)
        seq.block_table = [*hit, *blocks.allocate(need)]
        seq.num_computed = seq.num_registered = len(hit)
        seq.num_computed *= bs
        seq.num_cached_tokens = seq.num_computed
        seq.status = SeqStatus.RUNNING
        metrics = self.metrics
        if metrics is not None:
            metrics.prefix(len(prompt), seq.num_cached_tokens)
        try:
            logits = self._forward(seq, on_layer, push)
            scheduler.commit(seq, 0, cache=self.config.enable_prefix_cache)
            rows = [seq.sample_row(self.stopper.suppressed(seq))]
            picked = sample(logits, rows)
        finally:
            scheduler.free_blocks_of(seq)
            seq.status = SeqStatus.FINISHED
            self.requests.update_gauges()
        return PrefillResult(picked.tokens[0], picked.logprobs[0], seq.num_cached_tokens,
                             len(prompt), picked.top[0], seq.prompt_logprobs)  # fmt: skip

    def _forward(self, seq: Sequence, on_layer: LayerCallback, push: object) -> torch.Tensor:
        """Run a prompt's chunks, calling ``on_layer`` after each layer of each chunk
        (``push``: every rank hands its own heads over, to where it says)."""
        total = len(seq.tokens)
        step = self.config.max_batch_tokens
        metrics = self.metrics
        logits = torch.empty(0)
        first = True
        while seq.num_computed < total:
            start = seq.num_computed
            end = min(total, start + step)
            lo = 0 if first else start

            def hand_over(layer: int, k: torch.Tensor, v: torch.Tensor, lo: int = lo) -> None:
                on_layer(layer, k, v, lo)

            chunk = Chunk(seq.block_table, start, seq.tokens[start:end], need_logits=end == total,
                          scores=seq.scores_for(end - start))  # fmt: skip
            order = None if push is None else RankPush(push, lo, last=end == total)
            logits = self.runner.forward_export(chunk, lo, hand_over, order)
            seq.record_scores(start, chunk.scores)
            self.scheduler.commit(seq, end - start, cache=self.config.enable_prefix_cache)
            if metrics is not None:
                metrics.prefilled(end - start)
            first = False
        return logits

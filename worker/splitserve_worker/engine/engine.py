"""The synchronous engine: one thread calls ``add_request``/``step``/``abort`` and the
remote-KV calls; :mod:`.async_engine` wraps it for asyncio servers.

This module holds the step; the request table is :mod:`.requests`, the layer-wise
prefill export is :mod:`.layerwise` and remote KV admission is :mod:`.remote_kv`, each
given the table, the scheduler and the model runner it works on."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from splitserve import kv_compat
from splitserve.metric_registry import Metrics
from splitserve.prefix_hash import block_hashes
from splitserve.sampling import SamplingParams

from splitserve_worker.engine import identity
from splitserve_worker.engine.attention.base import StaticDecodeBackend
from splitserve_worker.engine.attention.buckets import batch_buckets
from splitserve_worker.engine.config import EngineConfig
from splitserve_worker.engine.decode_graphs import DecodeGraphs
from splitserve_worker.engine.forward_stack import build_forward
from splitserve_worker.engine.layerwise import LayerCallback, LayerwisePrefill
from splitserve_worker.engine.metrics import EngineMetrics
from splitserve_worker.engine.model_runner import Chunk, StopRanks, model_shape
from splitserve_worker.engine.prefix_cache import KVCacheEvent
from splitserve_worker.engine.remote_kv import RemoteAdmission
from splitserve_worker.engine.requests import RequestLimits, RequestTable
from splitserve_worker.engine.sampling import TopLogprobs, sample
from splitserve_worker.engine.scheduler import Scheduler, StepPlan
from splitserve_worker.engine.sequence import (
    FinishReason,
    PrefillResult,
    RequestOutput,
    Sequence,
    output_of,
)
from splitserve_worker.engine.stopping import StopChecker
from splitserve_worker.models import LoadedModel, torch_dtype
from splitserve_worker.parallel.collectives import RankGroup, RankLost
from splitserve_worker.parallel.layout import TPLayout

FORWARD_ERRORS = (RuntimeError, ValueError, IndexError)
"""Errors of a model forward that fail the requests in that batch, not the engine."""

log = logging.getLogger(__name__)


class Engine:
    """Paged-KV serving engine over a Llama-family transformers model."""

    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig | None = None,
        metrics: Metrics | None = None,
        *,
        group: RankGroup | None = None,
        layout: TPLayout | None = None,
    ) -> None:
        """With ``group`` and ``layout``, ``loaded`` is rank 0's shard of the model
        (:func:`~splitserve_worker.parallel.sharded_load.load_sharded`) and every forward
        runs on all ranks of the group (the others in :mod:`.follower`)."""
        self.config = config = config or EngineConfig()
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        model = loaded.model
        dtype = loaded.dtype if config.dtype == "auto" else torch_dtype(config.dtype)
        device = torch.device(config.device or loaded.device)
        if dtype != loaded.dtype or device != torch.device(loaded.device):
            model = model.to(device=device, dtype=dtype)
        model.eval()
        self.model = model
        self.loaded = loaded
        self.dtype = dtype
        self.device = device
        self.shape = shape = model_shape(model.config)
        self.block_size = config.block_size
        self.group = group
        self.layout = layout
        stack = build_forward(model, config, dtype, device, group, layout)
        self.kv = stack.kv
        self.runner = stack.runner
        self.attention = stack.runner.attention
        self.decode_graphs: DecodeGraphs | None = None
        """Decode steps from static buffers (CUDA graphs on CUDA), when they run here."""
        if stack.static and isinstance(self.attention, StaticDecodeBackend):
            capture = device.type == "cuda" and config.cuda_graphs
            buckets = batch_buckets(config.max_num_seqs)
            self.decode_graphs = DecodeGraphs(self.runner, buckets, capture=capture)
        why = stack.attention_why
        log.info("engine on %s (%s): %s", device, str(dtype).removeprefix("torch."),
                 self.describe(why))  # fmt: skip
        self.max_model_len = identity.max_model_len(model.config, config.max_model_len)
        self.stopper = StopChecker(identity.eos_ids(model), loaded.tokenizer, self.max_model_len)
        self.scheduler = Scheduler(config, self.kv.blocks)
        self.metrics = EngineMetrics(metrics, config.role) if metrics is not None else None
        limits = RequestLimits(shape.vocab_size, self.max_model_len, config.max_num_seqs)
        self.requests = RequestTable(
            self.scheduler, self.kv, limits, device=device, metrics=self.metrics
        )
        self.layerwise = LayerwisePrefill(
            self.requests, self.scheduler, self.runner, self.stopper, config, self.metrics
        )
        self.admission = RemoteAdmission(
            self.requests, self.scheduler, self.runner, self.stopper, config
        )
        self.requests.update_gauges()

    def describe(self, why: str = "") -> str:
        """What runs: the attention backend, how decode steps run, the matmuls."""
        graphs = self.decode_graphs
        if graphs is None:
            decode = "decode eager"
        else:
            sizes = ",".join(str(b) for b in graphs.buckets)
            kind = "CUDA graphs" if graphs.capture else "static buffers"
            decode = f"decode from {kind} per batch bucket ({sizes})"
        matmuls = "oneDNN prepacked" if self.runner.prepacked else "fused"
        reason = f" ({why})" if why else ""
        tp = ""
        if self.group is not None and self.layout is not None:
            tp = (f", tensor parallel over {self.layout.world} ranks "
                  f"({self.layout.describe()}, all-reduce {self.group.kind})")  # fmt: skip
        return (f"attention {self.attention.name}{reason}, {decode}, "
                f"q/k/v and gate/up {matmuls}{tp}")  # fmt: skip

    def close(self) -> None:
        """Tell the other tensor-parallel ranks to return (nothing to do without them)."""
        group = self.group
        if group is None:
            return
        self.group = None
        try:
            group.send_step(StopRanks())
        except RankLost:  # they are gone already
            pass
        finally:
            group.close()

    # ---- identity ----
    def compat_info(self) -> dict[str, Any]:
        return identity.compat_info(
            self.loaded.name, self.model, self.shape, self.dtype, self.block_size
        )

    def compat_hash(self) -> str:
        return kv_compat.compat_hash(self.compat_info())

    def block_hashes(self, token_ids: Iterable[int]) -> list[int]:
        """Chained hashes of the full blocks of a prompt, as this engine caches them."""
        return block_hashes(list(token_ids), self.block_size)

    def drain_events(self) -> list[KVCacheEvent]:
        return self.kv.blocks.drain_events()

    # ---- state ----
    @property
    def num_running(self) -> int:
        return self.requests.num_running

    @property
    def num_waiting(self) -> int:
        return self.requests.num_waiting

    @property
    def num_reserved(self) -> int:
        return self.requests.num_reserved

    def has_work(self) -> bool:
        return self.requests.has_work()

    def tokens_in_flight(self) -> int:
        return self.requests.tokens_in_flight()

    # ---- requests ----
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Iterable[int],
        sampling: SamplingParams | None = None,
        reuse_prefix: bool = True,
    ) -> None:
        """Queue a request to be prefilled and decoded here (``reuse_prefix`` False: its
        prompt is computed whole, whatever the prefix cache holds). Raises
        :class:`RequestError`."""
        prompt = [int(t) for t in prompt_token_ids]
        sampling = sampling or SamplingParams()
        self.requests.check(request_id, prompt, sampling)
        seq = self.requests.new_sequence(request_id, prompt, sampling)
        seq.reuse_prefix = reuse_prefix
        self.requests.add(seq)
        self.requests.update_gauges()

    def set_role(self, role: str) -> None:
        """Label this engine's series with ``role`` from now on (a switchable worker's new
        role); the old role's gauges are no longer exported."""
        old = self.metrics
        if old is None or old.role == role:
            return
        self.metrics = old.for_role(role)
        self.requests.metrics = self.metrics
        self.layerwise.metrics = self.metrics
        old.retire()
        self.requests.update_gauges()

    def abort(self, request_id: str) -> bool:
        """Stop a request and free everything it holds; False if it is not here."""
        found = self.requests.abort(request_id)
        self.requests.update_gauges()
        return found

    # ---- the step ----
    def step(self) -> list[RequestOutput]:
        """One scheduler iteration: at most one forward; returns what it produced."""
        outputs = self.requests.take_deferred()
        plan = self.scheduler.schedule()
        self._record_step(plan)
        if plan.scheduled:
            outputs.extend(self._run(plan))
        self.requests.update_gauges()
        return outputs

    def _run(self, plan: StepPlan) -> list[RequestOutput]:
        chunks = [
            Chunk(
                block_table=s.seq.block_table,
                start=s.seq.num_computed,
                token_ids=s.seq.tokens[s.seq.num_computed : s.seq.num_computed + s.num_tokens],
                need_logits=s.completes,
                scores=s.seq.scores_for(s.num_tokens),
            )
            for s in plan.scheduled
        ]
        try:
            graphs = self.decode_graphs
            if graphs is not None and graphs.takes(chunks):
                logits = graphs.forward(chunks)
            else:
                logits = self.runner.forward(chunks)
        except FORWARD_ERRORS as e:
            if self.group is not None:
                # the other ranks may be inside this forward still: out of step for good
                raise RankLost(f"a tensor-parallel forward failed on rank 0: {e}") from e
            out = []
            for s in plan.scheduled:
                out.append(
                    self.requests.finish(
                        s.seq, FinishReason.ERROR, error=f"model forward failed: {e}"
                    )
                )
            return out
        sampling_seqs = [s.seq for s in plan.scheduled if s.completes]
        for s, c in zip(plan.scheduled, chunks, strict=True):
            s.seq.record_scores(c.start, c.scores)
            self.scheduler.commit(s.seq, s.num_tokens, cache=self.config.enable_prefix_cache)
        if not sampling_seqs:
            return []
        rows = [q.sample_row(self.stopper.suppressed(q)) for q in sampling_seqs]
        try:
            picked = sample(logits, rows)
        except FORWARD_ERRORS as e:
            return [
                self.requests.finish(q, FinishReason.ERROR, error=f"sampling failed: {e}")
                for q in sampling_seqs
            ]
        outputs = []
        for seq, tok, lp, top in zip(sampling_seqs, picked.tokens, picked.logprobs, picked.top,
                                     strict=True):  # fmt: skip
            outputs.append(self._append(seq, tok, lp, top))
        return outputs

    def _append(
        self, seq: Sequence, token: int, logprob: float | None, top: TopLogprobs
    ) -> RequestOutput:
        seq.tokens.append(token)
        if self.metrics is not None:
            self.metrics.decoded(1)
        reason, stop_reason = self.stopper.check(seq)
        if reason is not None:
            out = self.requests.finish(seq, reason, stop_reason=stop_reason, emit=False)
            out.new_token_ids = [token]
            out.new_logprobs = [logprob]
        else:
            out = output_of(seq, [token], [logprob], finished=False)
        if seq.params.top_logprobs:
            out.new_top_logprobs = [top]
        if seq.num_output == 1:
            out.prompt_logprobs = seq.prompt_logprobs
        return out

    # ---- layer-wise prefill (prefill role) ----
    def prefill_export(
        self,
        request_id: str,
        prompt_token_ids: Iterable[int],
        sampling: SamplingParams | None,
        on_layer: LayerCallback,
        push: object = None,
    ) -> PrefillResult:
        """Compute a prompt here, handing each layer's K/V to ``on_layer`` as soon as that
        layer is done, and sample the first token. With ``push`` (tensor parallel: where
        the heads go), ``on_layer`` gets rank 0's heads only and every other rank hands
        over its own (:mod:`.follower`).

        ``on_layer`` is called for every prompt token of every layer, in layer order within
        each chunk of at most ``max_batch_tokens`` tokens (one chunk for most prompts); a
        cached prefix is handed over with the first chunk (``start_token`` 0). The blocks
        are freed afterwards; full prompt blocks stay in the prefix cache. Raises
        :class:`NoCapacity` when the pool cannot hold the prompt now, and
        :class:`RequestError` for a bad request. Runs on the engine's thread.
        """
        return self.layerwise.run(request_id, prompt_token_ids, sampling, on_layer, push)

    # ---- remote KV admission (decode role) ----
    def reserve(self, request_id: str, num_prompt_tokens: int) -> list[int]:
        """Hold blocks for a prompt whose K/V will be written from outside.

        Returns the block ids (in order: position ``p`` lives in block ``ids[p // block_size]``
        at offset ``p % block_size``). Raises :class:`NoCapacity` when blocks or batch slots
        are short, :class:`RequestError` for a bad size or a duplicate id.
        """
        ids = self.requests.reserve(request_id, num_prompt_tokens)
        self.requests.update_gauges()
        return ids

    def reserved_blocks(self, request_id: str) -> list[int]:
        return list(self.requests.reservation(request_id).blocks)

    def write_layer(
        self, request_id: str, layer: int, start_token: int, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Copy one layer's K/V ``[n, kv_heads, head_dim]`` for prompt positions
        ``[start_token, start_token + n)`` into a reservation's blocks."""
        self.requests.write(request_id, layer, start_token, k, v)

    def admit_prefilled(
        self,
        request_id: str,
        prompt_token_ids: Iterable[int],
        first_token: int,
        first_logprob: float | None,
        sampling: SamplingParams | None = None,
    ) -> None:
        """Start decoding a reserved request whose prompt K/V is in its blocks.

        ``first_token`` was already sent to the client by the prefill side; the next
        outputs of this request carry the tokens after it.
        """
        self.admission.admit(request_id, prompt_token_ids, first_token, first_logprob, sampling)

    def release(self, request_id: str) -> int:
        """Free what a request holds (reservation or sequence); returns blocks freed.

        Idempotent: 0 for an unknown or already released request.
        """
        n = self.requests.release(request_id)
        self.requests.update_gauges()
        return n

    # ---- metrics ----
    def _record_step(self, plan: StepPlan) -> None:
        if self.metrics is None:
            return
        self.metrics.prefix(plan.prefix_queried, plan.prefix_hit)
        self.metrics.prefilled(
            sum(s.num_tokens for s in plan.scheduled if s.num_tokens > 1 or s.seq.num_output == 0)
        )

    def stats(self) -> dict[str, int]:
        return {
            "free_blocks": self.kv.free_blocks,
            "total_blocks": self.kv.total_blocks,
            "running": self.num_running,
            "waiting": self.num_waiting,
            "reserved": self.num_reserved,
            "tokens_in_flight": self.tokens_in_flight(),
        }

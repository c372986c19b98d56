"""The table of an engine's requests: the sequences it holds (waiting or running, kept in
step with the scheduler), the blocks it holds for prompts whose K/V is written from
outside, and the final outputs due at the next step.

One request id names at most one entry, sequence or reservation, at a time. Every change
goes through a method here, so the counts the gauges show are the table's own."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from splitserve.sampling import SamplingParams

from splitserve_worker.engine.errors import NoCapacity, RequestError
from splitserve_worker.engine.kv_cache import KVCache
from splitserve_worker.engine.metrics import EngineMetrics
from splitserve_worker.engine.prompt_logprobs import PromptLogprobs
from splitserve_worker.engine.request_checks import check_request
from splitserve_worker.engine.reservations import Reservation, Reservations
from splitserve_worker.engine.sampling import make_generator
from splitserve_worker.engine.scheduler import Scheduler
from splitserve_worker.engine.sequence import (
    FinishReason,
    RequestOutput,
    SeqStatus,
    Sequence,
    output_of,
)


@dataclass(frozen=True)
class RequestLimits:
    """What every request is checked against: the model's and the batch's limits."""

    vocab_size: int
    max_model_len: int
    """Prompt plus output tokens, at most."""
    max_num_seqs: int
    """Sequences and reservations held at once, at most."""


class RequestTable:
    """Sequences, reservations and pending final outputs of one engine (one thread)."""

    def __init__(
        self,
        scheduler: Scheduler,
        kv: KVCache,
        limits: RequestLimits,
        *,
        device: torch.device,
        metrics: EngineMetrics | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.kv = kv
        self.limits = limits
        self.device = device
        """Where the sequences' generators live (the model's device)."""
        self.metrics = metrics
        self._seqs: dict[str, Sequence] = {}
        self._reserved = Reservations(kv)
        self._pending: list[RequestOutput] = []
        self._arrivals = 0

    # ---- membership ----
    def __contains__(self, request_id: object) -> bool:
        return request_id in self._seqs or request_id in self._reserved

    def get(self, request_id: str) -> Sequence | None:
        """The sequence of ``request_id``, or ``None`` (none, or only a reservation)."""
        return self._seqs.get(request_id)

    def check(self, request_id: str, prompt: list[int], sampling: SamplingParams) -> None:
        """Raise :class:`RequestError` if the id is in use or the request cannot be served."""
        if request_id in self:
            raise RequestError(f"request id {request_id!r} is already in use on this engine")
        check_request(prompt, sampling, vocab=self.limits.vocab_size,
                      max_model_len=self.limits.max_model_len, block_size=self.kv.block_size,
                      total_blocks=self.kv.total_blocks)  # fmt: skip

    def new_sequence(
        self, request_id: str, prompt: list[int], sampling: SamplingParams
    ) -> Sequence:
        """A sequence for a checked request, in arrival order; not held until :meth:`add`."""
        self._arrivals += 1
        return Sequence(
            request_id=request_id,
            prompt_len=len(prompt),
            tokens=list(prompt),
            params=sampling,
            generator=make_generator(sampling, self.device),
            arrival=self._arrivals,
            prompt_logprobs=(
                None if sampling.prompt_logprobs is None else PromptLogprobs.empty(len(prompt))
            ),
        )

    def add(self, seq: Sequence) -> None:
        """Hold ``seq`` and queue it to be prefilled here."""
        self._seqs[seq.request_id] = seq
        self.scheduler.add(seq)

    def add_running(self, seq: Sequence) -> None:
        """Hold ``seq``, whose blocks already hold its prompt, in the running batch."""
        self._seqs[seq.request_id] = seq
        self.scheduler.add_running(seq)

    def finish(
        self,
        seq: Sequence,
        reason: FinishReason,
        *,
        error: str | None = None,
        stop_reason: int | str | None = None,
        emit: bool = True,
    ) -> RequestOutput:
        """Drop a sequence and free its blocks; returns its final output. An abort's
        output (``emit``) also goes out with the next step."""
        if seq.status is not SeqStatus.FINISHED:
            self.scheduler.remove(seq)
        self._seqs.pop(seq.request_id, None)
        out = output_of(seq, [], [], finished=True, reason=reason, error=error,
                        stop_reason=stop_reason)  # fmt: skip
        if emit and reason is FinishReason.ABORT:
            self._pending.append(out)
        return out

    def abort(self, request_id: str) -> bool:
        """Stop a request and free everything it holds; False if it is not here."""
        if request_id in self._reserved:
            self._reserved.release(request_id)
            return True
        seq = self._seqs.get(request_id)
        if seq is None:
            return False
        self.finish(seq, FinishReason.ABORT)
        return True

    def release(self, request_id: str) -> int:
        """Free what a request holds (reservation or sequence); returns blocks freed, 0
        for an unknown or already released request."""
        if request_id in self._reserved:
            return self._reserved.release(request_id)
        seq = self._seqs.get(request_id)
        if seq is None:
            return 0
        n = len(seq.block_table)
        self.finish(seq, FinishReason.ABORT)
        return n

    # ---- reservations (prompts whose K/V is written from outside) ----
    def reserve(self, request_id: str, num_prompt_tokens: int) -> list[int]:
        """Hold blocks for ``num_prompt_tokens`` positions; returns their ids in order.

        Raises :class:`RequestError` for a bad size or an id in use, :class:`NoCapacity`
        when blocks or batch slots are short."""
        if request_id in self:
            raise RequestError(f"request id {request_id!r} is already in use on this engine")
        max_len = self.limits.max_model_len
        if not 0 < num_prompt_tokens < max_len:
            raise RequestError(
                f"num_prompt_tokens must be in [1, {max_len - 1}], got {num_prompt_tokens}"
            )
        max_seqs = self.limits.max_num_seqs
        if self.num_running + self.num_waiting + self.num_reserved >= max_seqs:
            raise NoCapacity(f"decode batch full ({max_seqs} sequences)", free=self.kv.free_blocks)
        return self._reserved.hold(request_id, num_prompt_tokens)

    def reservation(self, request_id: str) -> Reservation:
        """The blocks held for ``request_id`` (raises :class:`UnknownRequest`)."""
        return self._reserved.get(request_id)

    def take_reservation(self, request_id: str) -> Reservation:
        """Hand a reservation's blocks over to the caller: no longer held here."""
        return self._reserved.take(request_id)

    def write(
        self, request_id: str, layer: int, start: int, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Copy one layer's K/V for positions ``[start, start + n)`` into a reservation."""
        self._reserved.write(request_id, layer, start, k, v)

    # ---- outputs due at the next step ----
    def defer(self, out: RequestOutput) -> None:
        """Send ``out`` with the next step's outputs."""
        self._pending.append(out)

    def take_deferred(self) -> list[RequestOutput]:
        """The outputs due now, in the order they were deferred; none are kept."""
        out, self._pending = self._pending, []
        return out

    def has_work(self) -> bool:
        """Whether a step would do or send anything."""
        return bool(self._pending) or self.scheduler.has_work()

    # ---- counts ----
    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_reserved(self) -> int:
        return len(self._reserved)

    def tokens_in_flight(self) -> int:
        """Prompt and output tokens of every sequence held."""
        return sum(len(s.tokens) for s in self._seqs.values())

    def update_gauges(self) -> None:
        """Publish running, waiting and KV block counts (when the engine has metrics)."""
        if self.metrics is not None:
            self.metrics.gauges(
                running=self.num_running,
                waiting=self.num_waiting,
                used=self.kv.used_blocks,
                free=self.kv.free_blocks,
            )

"""Remote KV admission for the decode role: a reserved request whose prompt K/V was
written from outside joins the running batch."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from splitserve.sampling import SamplingParams

from splitserve_worker.engine.config import EngineConfig
from splitserve_worker.engine.errors import RequestError
from splitserve_worker.engine.model_runner import ModelRunner
from splitserve_worker.engine.requests import RequestTable
from splitserve_worker.engine.scheduler import Scheduler
from splitserve_worker.engine.stopping import StopChecker


class RemoteAdmission:
    """Turns a reservation into a running sequence (the reservation's blocks become the
    sequence's), or frees the blocks when the request turns out to be bad."""

    def __init__(
        self,
        requests: RequestTable,
        scheduler: Scheduler,
        runner: ModelRunner,
        stopper: StopChecker,
        config: EngineConfig,
    ) -> None:
        self.requests = requests
        self.scheduler = scheduler
        self.runner = runner
        self.stopper = stopper
        self.config = config

    def admit(
        self,
        request_id: str,
        prompt_token_ids: Iterable[int],
        first_token: int,
        first_logprob: float | None,
        sampling: SamplingParams | None = None,
    ) -> None:
        """:meth:`Engine.admit_prefilled <splitserve_worker.engine.engine.Engine.admit_prefilled>`
        (see there)."""
        requests = self.requests
        r = requests.reservation(request_id)
        prompt = [int(t) for t in prompt_token_ids]
        sampling = sampling or SamplingParams()
        if len(prompt) != r.num_tokens:
            raise RequestError(f"prompt has {len(prompt)} tokens but {r.num_tokens} were reserved")
        requests.take_reservation(request_id)
        try:
            requests.check(request_id, prompt, sampling)
        except RequestError:
            self.scheduler.blocks.free(reversed(r.blocks))
            requests.update_gauges()
            raise
        seq = requests.new_sequence(request_id, prompt, sampling)
        seq.prompt_logprobs = None  # the prefill side scored the prompt
        if seq.generator is not None:
            # the prefill side drew the first token from the same seed: skip that draw
            noise = torch.empty(self.runner.shape.vocab_size, device=self.runner.device)
            noise.exponential_(1.0, generator=seq.generator)
        seq.block_table = list(r.blocks)
        requests.add_running(seq)
        self.scheduler.commit(seq, len(prompt), cache=self.config.enable_prefix_cache)
        seq.tokens.append(int(first_token))
        reason, stop_reason = self.stopper.check(seq)
        if reason is not None:
            requests.defer(requests.finish(seq, reason, stop_reason=stop_reason, emit=False))
        requests.update_gauges()

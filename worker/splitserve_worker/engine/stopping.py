"""When a sequence is done: EOS, stop token ids, stop strings, length."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from splitserve_worker.engine.sequence import FinishReason, Sequence


class StopChecker:
    """Decides, after each new token, whether and why a sequence finishes.

    Stop strings are matched on the detokenized tail of the output: a match that appears
    with the newest token lies within its last ``max(len(stop)) + TAIL_SLACK`` tokens.
    """

    TAIL_SLACK = 8

    def __init__(self, eos_ids: Collection[int], tokenizer: Any, max_model_len: int) -> None:
        self.eos_ids = frozenset(eos_ids)
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def suppressed(self, seq: Sequence) -> list[int]:
        """Token ids that may not be chosen yet (before ``min_tokens``)."""
        p = seq.params
        if seq.num_output >= p.min_tokens:
            return []
        ids = set(p.stop_token_ids)
        if not p.ignore_eos:
            ids |= self.eos_ids
        return sorted(ids)

    def check(self, seq: Sequence) -> tuple[FinishReason | None, int | str | None]:
        """Reason to finish after the latest token, and the stop token or string."""
        p = seq.params
        token = seq.tokens[-1]
        if seq.num_output >= p.min_tokens:
            if token in p.stop_token_ids:
                return FinishReason.STOP, token
            if not p.ignore_eos and token in self.eos_ids:
                return FinishReason.STOP, None
            if p.stop and self.tokenizer is not None:
                window = max(len(s) for s in p.stop) + self.TAIL_SLACK
                text = self.tokenizer.decode(seq.output_ids[-window:], skip_special_tokens=True)
                for s in p.stop:
                    if s in text:
                        return FinishReason.STOP, s
        if seq.num_output >= p.max_tokens or len(seq.tokens) >= self.max_model_len:
            return FinishReason.LENGTH, None
        return None, None

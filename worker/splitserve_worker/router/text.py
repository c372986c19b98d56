"""Tokens to text, incrementally, with stop strings cut off as the OpenAI API does."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class Tokenizer(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class Detokenizer:
    """Turns a growing list of token ids into text deltas.

    It decodes the whole output each time and emits what is new; a trailing
    replacement character (half of a multi-byte character) is held back until
    the next token completes it. When a stop string appears, the text is cut
    before it and :attr:`stopped` is set.
    """

    def __init__(self, tokenizer: Tokenizer | Any, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.ids: list[int] = []
        self.text = ""
        self.stopped = False
        self._sent = 0

    def add(self, ids: Sequence[int], final: bool = False) -> str:
        """Adds tokens; returns the text that became final with them."""
        if self.stopped:
            return ""
        self.ids.extend(ids)
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        for s in self.stop:
            at = full.find(s)
            if at != -1:
                full = full[:at]
                self.stopped = True
        self.text = full
        end = len(full)
        if not final and not self.stopped:
            # hold back a half character and anything that may be the start of a stop string
            while end > self._sent and full[end - 1] == "\ufffd":
                end -= 1
            hold = max((_overlap(full[:end], s) for s in self.stop), default=0)
            end -= hold
        end = max(end, self._sent)
        delta = full[self._sent : end]
        self._sent = end
        return delta


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``stop``."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0

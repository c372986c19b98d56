"""Incremental detokenization and stop strings."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from splitserve_worker.router.text import Detokenizer

pytestmark = pytest.mark.unit


class ByteTok:
    """Token id = one byte, like a byte-level tokenizer."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def stream(det: Detokenizer, data: bytes) -> str:
    out = "".join(det.add([b]) for b in data)
    return out + det.add([], final=True)


def test_multibyte_characters_are_never_split() -> None:
    det = Detokenizer(ByteTok())
    parts = [det.add([b]) for b in "héllo ✓".encode()]
    assert "".join(parts) == "héllo ✓"
    assert all("\ufffd" not in p for p in parts)


def test_stop_string_is_cut_and_never_leaked() -> None:
    det = Detokenizer(ByteTok(), stop=["END"])
    parts = [det.add([b]) for b in b"abc ENDxyz"]
    assert "".join(parts) == "abc "
    assert det.stopped and det.text == "abc "


def test_partial_stop_prefix_is_released_when_it_does_not_complete() -> None:
    det = Detokenizer(ByteTok(), stop=["END"])
    assert stream(det, b"an ENtry") == "an ENtry"
    assert not det.stopped

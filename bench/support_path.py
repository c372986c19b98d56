"""The repository's test support (``tests/support``) for benches that build the tiny test
model: benches are scripts, so they put that folder on their own ``sys.path``."""

from __future__ import annotations

import sys
from pathlib import Path

TEST_SUPPORT = Path(__file__).resolve().parents[1] / "tests" / "support"


def use_test_support() -> None:
    """Make ``tests/support`` importable (``import tiny_models``)."""
    if str(TEST_SUPPORT) not in sys.path:
        sys.path.append(str(TEST_SUPPORT))

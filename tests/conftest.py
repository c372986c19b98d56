"""Fixtures shared by every tier: the tiny test model and the e2e gate; and the
Hypothesis profile (``ci`` when ``CI`` is set: a fixed search; see ``fuzz_profiles``)."""

from __future__ import annotations

import os
from pathlib import Path

import fuzz_profiles
import pytest

HYPOTHESIS_PROFILE = fuzz_profiles.load()


def pytest_report_header(config: pytest.Config) -> str:
    return f"hypothesis profile: {HYPOTHESIS_PROFILE}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("KUBECONFIG"):
        return
    skip = pytest.mark.skip(reason="e2e tests need a real cluster: set KUBECONFIG to run them")
    for item in items:
        if "e2e" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random Llama checkpoint (float32) saved with save_pretrained, for every test."""
    from tiny_models import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_model_path_kv1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same architecture with one KV head (fewer KV heads than tensor-parallel ranks:
    each rank holds a replica of it)."""
    from tiny_models import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-kv1"), num_key_value_heads=1)


@pytest.fixture(scope="session")
def tiny_model_path_bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same architecture saved in bfloat16, for dtype tests."""
    from tiny_models import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-bf16"), dtype="bfloat16")

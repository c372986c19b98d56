"""Fixtures shared by every tier: the tiny test model and the e2e gate."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


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
def tiny_model_path_bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same architecture saved in bfloat16, for dtype tests."""
    from tiny_models import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-bf16"), dtype="bfloat16")

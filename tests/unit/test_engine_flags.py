"""The engine's attention and CUDA-graph settings, from the worker's flags to the engine's
config, and a bad value named by its flag."""

from __future__ import annotations

import argparse

import pytest
from splitserve_worker.commands import worker as worker_cmd
from splitserve_worker.engine.config import EngineConfig
from splitserve_worker.server.auth import TOKEN_ENV
from splitserve_worker.server.config import ConfigError, WorkerConfig

pytestmark = pytest.mark.unit


def engine_config(monkeypatch: pytest.MonkeyPatch, *flags: str) -> EngineConfig:
    monkeypatch.setenv(TOKEN_ENV, "t")
    parser = argparse.ArgumentParser()
    worker_cmd.add_arguments(parser)
    args = parser.parse_args(["--role", "decode", "--model", "m", *flags])
    cfg = worker_cmd.config_from_args(args).engine_config()
    assert isinstance(cfg, EngineConfig)
    return cfg


def test_the_flags_reach_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    default = engine_config(monkeypatch)
    assert (default.attention_backend, default.cuda_graphs) == ("auto", True)
    set_ = engine_config(monkeypatch, "--attention-backend", "flex", "--no-cuda-graphs")
    assert (set_.attention_backend, set_.cuda_graphs) == ("flex", False)


def test_a_backend_that_is_not_one_is_named_by_its_flag() -> None:
    with pytest.raises(ConfigError, match="--attention-backend must be one of auto, sdpa"):
        WorkerConfig(role="both", model="m", token="t", attention_backend="paged")
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="paged")

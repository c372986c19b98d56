"""The router accepts what the workers serve: its ``max_model_len`` comes from the
model's own config (positions, sliding window) unless the flag or the config file says."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
from splitserve_worker.commands import router as router_cmd
from splitserve_worker.models import DEFAULT_POSITIONS, context_limit
from transformers import LlamaConfig, MistralConfig, Qwen2Config

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("config", "limit"),
    [
        (LlamaConfig(max_position_embeddings=1024), 1024),
        (MistralConfig(max_position_embeddings=8192, sliding_window=512), 512),
        # Qwen2 names a window but does not use it unless told to
        (
            Qwen2Config(max_position_embeddings=2048, sliding_window=256, use_sliding_window=False),
            2048,
        ),
        (argparse.Namespace(), DEFAULT_POSITIONS),  # a config that says nothing
    ],
)
def test_context_limit(config: Any, limit: int) -> None:
    assert context_limit(config) == limit


def _args(model: Path, **kw: Any) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    router_cmd.add_arguments(p)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in kw.items()]
    return p.parse_args(["--model", str(model), *flags])


def test_the_router_takes_the_models_limit_unless_told(tmp_path: Path) -> None:
    LlamaConfig(max_position_embeddings=1024).save_pretrained(tmp_path)
    assert router_cmd.load_config(_args(tmp_path)).max_model_len == 1024
    assert router_cmd.load_config(_args(tmp_path, max_model_len=512)).max_model_len == 512
    settings = tmp_path / "router.json"
    settings.write_text(json.dumps({"max_model_len": 300}))
    assert router_cmd.load_config(_args(tmp_path, config=settings)).max_model_len == 300


def test_router_settings_flags_reach_its_config(tmp_path: Path) -> None:
    """The flags the operator writes from ``spec.router.settings``."""
    LlamaConfig(max_position_embeddings=1024).save_pretrained(tmp_path)
    cfg = router_cmd.load_config(_args(tmp_path, disaggregation="never", default_max_tokens=64,
                                       max_request_bytes=4096, max_retries=0))  # fmt: skip
    assert (cfg.disaggregation, cfg.default_max_tokens) == ("never", 64)
    assert (cfg.max_request_bytes, cfg.max_retries) == (4096, 0)
    with pytest.raises(ValueError, match="max_request_bytes"):
        router_cmd.load_config(_args(tmp_path, max_request_bytes=0))

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


def test_set_reaches_any_setting_and_says_what_is_wrong(tmp_path: Path) -> None:
    """``--set`` (what the operator writes for ``spec.router.settings.queues`` /
    ``timeouts``) over the config file; ``--lease-seconds`` is ``timeouts.lease_s``."""
    LlamaConfig(max_position_embeddings=1024).save_pretrained(tmp_path)
    settings = tmp_path / "router.json"
    settings.write_text(json.dumps({"queues": {"max_wait_s": 9, "retry_after_s": 2}}))
    p = argparse.ArgumentParser()
    router_cmd.add_arguments(p)
    base = ["--model", str(tmp_path), "--config", str(settings)]
    args = p.parse_args([*base, "--set", "queues.max_wait_s=2.5", "--set",
                         "cost.max_decode_stall_s=0.2", "--lease-seconds", "45"])  # fmt: skip
    cfg = router_cmd.load_config(args)
    assert (cfg.queues.max_wait_s, cfg.queues.retry_after_s) == (2.5, 2)
    assert cfg.cost.max_decode_stall_s == 0.2
    assert cfg.timeouts.lease_s == 45
    assert router_cmd.load_config(p.parse_args(base)).timeouts.lease_s == 30

    def refused(*sets: str) -> str:
        args = p.parse_args([*base, *(x for s in sets for x in ("--set", s))])
        with pytest.raises(ValueError) as e:
            router_cmd.load_config(args)
        return str(e.value)

    assert "queues.max_wait_s must be > 0" in refused("queues.max_wait_s=0")
    assert "unknown setting(s) ['max_wait']" in refused("queues.max_wait=3")
    assert "SECTION.KEY=VALUE" in refused("queues.max_wait_s")
    assert "block_size is a value, not a section" in refused("block_size.x=1")
    assert "queues is a section: give its fields" in refused("queues=3")
    assert "bad value" in refused("queues.max_wait_s=soon")


def test_the_router_fetches_a_hub_model_without_its_weights(
    tmp_path: Path, tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A router given a hub id reads the config and the tokenizer: it must not pull the
    checkpoint's weights (gigabytes, into a pod sized for routing); a worker does."""
    import fnmatch
    import shutil

    import huggingface_hub
    from splitserve_worker.models import resolve_model

    fetched: list[list[str]] = []

    def snapshot_download(repo_id: str, allow_patterns: list[str]) -> str:
        # the hub's side: the tiny checkpoint's files, those matching a pattern copied
        assert repo_id == "org/tiny"
        fetched.append(list(allow_patterns))
        out = tmp_path / "snapshot"
        out.mkdir(exist_ok=True)
        for f in tiny_model_path.iterdir():
            if any(fnmatch.fnmatch(f.name, p) for p in allow_patterns):
                shutil.copy(f, out / f.name)
        return str(out)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    tokenizer = router_cmd.load_tokenizer("org/tiny")
    assert tokenizer("hello")["input_ids"]
    cfg = router_cmd.load_config(_args(Path("org/tiny")))
    assert cfg.max_model_len == context_limit(LlamaConfig.from_pretrained(tiny_model_path))
    snapshot = tmp_path / "snapshot"
    assert not list(snapshot.glob("*.safetensors")) and fetched
    assert all("*.safetensors" not in patterns for patterns in fetched)
    # a worker resolving the same id gets the weights
    assert list(resolve_model("org/tiny").glob("*.safetensors"))
    assert "*.safetensors" in fetched[-1]

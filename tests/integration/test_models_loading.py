"""The one loading path for the built-in model and any checkpoint folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from splitserve_worker.models import ModelError, load_model, resolve_model
from tiny_models import save_tiny_llama

pytestmark = pytest.mark.integration


def test_tiny_checkpoint_loads_in_its_own_dtype(tiny_model_path: Path) -> None:
    lm = load_model(str(tiny_model_path))
    assert lm.dtype == torch.float32
    assert lm.device == "cpu"
    assert lm.config.model_type == "llama"
    ids = lm.tokenizer("hello")["input_ids"]
    assert lm.tokenizer.decode(ids) == "hello"
    out = lm.model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, len(ids) + 4)


def test_bf16_checkpoint_stays_bf16_unless_asked(tiny_model_path_bf16: Path) -> None:
    assert load_model(str(tiny_model_path_bf16)).dtype == torch.bfloat16
    lm = load_model(str(tiny_model_path_bf16), dtype="float32")
    assert lm.dtype == torch.float32
    assert next(lm.model.parameters()).dtype == torch.float32


def test_weights_are_made_on_their_device_not_moved_there(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GPU worker must not hold the whole model in host memory on its way to the GPU:
    the loader builds each weight on the device asked for and never moves a built model.
    On the meta device (where nothing is read into memory) that shows without a GPU."""
    moved: list[str] = []
    to = torch.nn.Module.to

    def recorded(self: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
        moved.append(f"{type(self).__name__}.to{args}")
        return to(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to", recorded)
    lm = load_model(str(tiny_model_path), device="meta")
    assert {p.device.type for p in lm.model.parameters()} == {"meta"} and lm.device == "meta"
    lm = load_model(str(tiny_model_path), device="cpu")
    assert {p.device.type for p in lm.model.parameters()} == {"cpu"}
    assert moved == []


def test_bad_dtype_is_explained(tiny_model_path: Path) -> None:
    with pytest.raises(ModelError, match="not one of"):
        load_model(str(tiny_model_path), dtype="float8")


def test_missing_and_incomplete_folders_are_explained(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="neither the built-in name"):
        resolve_model(str(tmp_path / "absent"))
    with pytest.raises(ModelError, match=r"no config\.json"):
        resolve_model(str(tmp_path))


def test_tiny_model_is_deterministic_per_seed(tmp_path: Path) -> None:
    a = save_tiny_llama(tmp_path / "a", seed=3)
    b = save_tiny_llama(tmp_path / "b", seed=3)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


@pytest.mark.slow
def test_builtin_model_converts_once_then_loads_fast(tmp_path: Path) -> None:
    """First use converts the shipped GGUF (with progress), later uses reuse the checkpoint."""
    env = dict(os.environ, SPLITSERVE_CACHE=str(tmp_path))
    code = (
        "from splitserve_worker.models import load_model; import torch;"
        "lm = load_model('smollm2-135m');"
        "ids = lm.tokenizer('The capital of France is', return_tensors='pt')"
        "['input_ids'];"
        "out = lm.model.generate(ids, max_new_tokens=3, do_sample=False);"
        "text = lm.tokenizer.decode(out[0, ids.shape[1]:]);"
        "print(lm.config.num_hidden_layers, lm.dtype, repr(text))"
    )
    first = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert first.returncode == 0, first.stderr[-2000:]
    assert "converting the built-in model once" in first.stderr
    assert first.stdout.startswith("30 torch.float32 ")
    ckpt = tmp_path / "models" / "smollm2-135m"
    assert (ckpt / "model.safetensors").exists() and (ckpt / "tokenizer.json").exists()
    second = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert second.returncode == 0, second.stderr[-2000:]
    assert "converting" not in second.stderr
    assert second.stdout == first.stdout


def test_hub_ids_resolve_through_the_hub_cache(
    tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Hugging Face id is looked up in the standard hub cache (offline here)."""
    import shutil

    rev = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--acme--tiny-llama"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(rev)
    shutil.copytree(tiny_model_path, repo / "snapshots" / rev)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    assert resolve_model("acme/tiny-llama") == repo / "snapshots" / rev
    assert load_model("acme/tiny-llama").config.num_hidden_layers == 4
    with pytest.raises(ModelError, match="could not fetch 'acme/absent'"):
        resolve_model("acme/absent")

"""A checkpoint loaded as one tensor-parallel rank's shard.

The model is built on the meta device (no memory), then each of its weights is read from
the safetensors files with ``get_slice``: a rank reads only the rows or columns it owns
(:mod:`.layout`), straight into its device, so no rank ever holds the whole model. The
column-split projections (q/k/v, gate/up) take their rows; the row-split ones (o, down)
take their columns, and their bias only on rank 0 (the all-reduce adds it once).
Embeddings, norms and ``lm_head`` are read whole.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import torch

from splitserve_worker.models import (
    BUILTIN_MODEL,
    LoadedModel,
    ModelError,
    is_builtin,
    pick_device,
    resolve_model,
    torch_dtype,
)
from splitserve_worker.parallel.layout import TPLayout

COLUMN_SPLIT = {"q_proj": "heads", "k_proj": "kv", "v_proj": "kv", "gate_proj": "mlp",
                "up_proj": "mlp"}  # fmt: skip
ROW_SPLIT = {"o_proj": "heads", "down_proj": "mlp"}


def layout_of(config: Any, world: int, rank: int) -> TPLayout:
    heads = int(config.num_attention_heads)
    return TPLayout(
        world=world,
        rank=rank,
        num_heads=heads,
        num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        intermediate_size=int(config.intermediate_size),
    )


def head_dim_of(config: Any) -> int:
    heads = int(config.num_attention_heads)
    return int(getattr(config, "head_dim", None) or config.hidden_size // heads)


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{path} has no safetensors weights: tensor parallelism reads "
                         f"each rank's slices from safetensors files")  # fmt: skip
    return files


def _rows(layout: TPLayout, kind: str, hd: int, inter: int) -> range:
    if kind == "heads":
        r = layout.heads()
        return range(r.start * hd, r.stop * hd)
    if kind == "kv":
        r = layout.kv_heads()
        return range(r.start * hd, r.stop * hd)
    return layout.columns(inter)


def read_shard(sl: Any, name: str, layout: TPLayout, hd: int, inter: int) -> torch.Tensor:
    """This rank's part of checkpoint tensor ``name`` (``sl``: its safetensors slice)."""
    parts = name.split(".")
    proj = parts[-2] if len(parts) >= 2 else ""
    leaf = parts[-1]
    if proj in COLUMN_SPLIT:
        r = _rows(layout, COLUMN_SPLIT[proj], hd, inter)
        t: torch.Tensor = sl[r.start : r.stop]
        return t
    if proj in ROW_SPLIT:
        if leaf == "bias":
            full: torch.Tensor = sl[:]
            return full if layout.rank == 0 else torch.zeros_like(full)
        r = _rows(layout, ROW_SPLIT[proj], hd, inter)
        cols: torch.Tensor = sl[:, r.start : r.stop]
        return cols
    whole: torch.Tensor = sl[:]
    return whole


def load_sharded(
    name_or_path: str, layout_world: int, rank: int, dtype: str = "auto",
    device: str | None = None,
) -> LoadedModel:  # fmt: skip
    """Rank ``rank``'s shard of a model over ``layout_world`` ranks, with its tokenizer."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    path = resolve_model(name_or_path)
    config = AutoConfig.from_pretrained(str(path))
    layout = layout_of(config, layout_world, rank)
    ckpt_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    dt = torch_dtype(dtype, ckpt_dtype)
    dev = pick_device(device)
    with torch.device("meta"):
        model: Any = AutoModelForCausalLM.from_config(config, dtype=dt, attn_implementation="sdpa")
    params = dict(model.named_parameters())
    hd = head_dim_of(config)
    inter = int(config.intermediate_size)
    loaded: set[str] = set()
    for file in _weight_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                if name not in params:
                    continue
                t = read_shard(f.get_slice(name), name, layout, hd, inter)
                owner, _, leaf = name.rpartition(".")
                mod = model.get_submodule(owner)
                value = t.to(device=dev, dtype=dt)
                setattr(mod, leaf, torch.nn.Parameter(value, requires_grad=False))
                loaded.add(name)
    if getattr(config, "tie_word_embeddings", False) and "lm_head.weight" not in loaded:
        model.lm_head.weight = model.model.embed_tokens.weight
        loaded.add("lm_head.weight")
    missing = sorted(set(params) - loaded)
    if missing:
        raise ModelError(f"{path}'s safetensors lack {', '.join(missing[:5])}: not a complete "
                         f"checkpoint of {type(model).__name__}")  # fmt: skip
    rotary = model.model.rotary_emb
    with torch.device(dev):  # its frequencies are computed, not read: built anew here
        model.model.rotary_emb = type(rotary)(config=config)
    meta = [n for n, b in model.named_buffers() if b.is_meta]
    if meta:
        raise ModelError(
            f"{type(model).__name__} keeps buffers this loader cannot rebuild "
            f"({', '.join(meta[:3])}); serve it with --tensor-parallel-size 1"
        )
    with contextlib.suppress(OSError):  # no generation_config.json: the config's eos applies
        model.generation_config = GenerationConfig.from_pretrained(str(path))
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    name = BUILTIN_MODEL if is_builtin(name_or_path) else path.name
    return LoadedModel(model, tokenizer, model.config, path, name, dt, dev)

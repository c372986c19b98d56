"""Other Llama-family architectures (Qwen2, Qwen3 with q/k norms, Mistral) and bfloat16."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch
from splitserve.sampling import SamplingParams
from splitserve_worker.engine.config import EngineConfig
from splitserve_worker.engine.engine import Engine
from splitserve_worker.models import load_model
from transformers import (
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

pytestmark = pytest.mark.integration

COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    initializer_range=0.1,
)

ARCHS = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 256}),
}


def _save(kind: str, tok_from: Path, out: Path) -> Path:
    cfg_cls, model_cls, extra = ARCHS[kind]
    torch.manual_seed(0)
    vocab = 259
    cfg = cfg_cls(
        vocab_size=vocab, eos_token_id=257, bos_token_id=256, pad_token_id=258, **COMMON, **extra
    )
    model_cls(cfg).save_pretrained(str(out), safe_serialization=True)
    for f in tok_from.iterdir():
        if "token" in f.name or f.name == "chat_template.jinja":
            shutil.copy(f, out / f.name)
    return out


@pytest.mark.parametrize("kind", sorted(ARCHS))
def test_greedy_matches_generate(kind: str, tiny_model_path: Path, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    lm = load_model(str(_save(kind, tiny_model_path, tmp_path / kind)))
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (3, 17, 40, 70)]
    engine = Engine(lm, EngineConfig(num_blocks=64, max_batch_tokens=64, prefill_chunk_tokens=24))
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=8))
    got: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_work():
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
    for i, p in enumerate(prompts):
        ids = torch.tensor([p])
        with torch.inference_mode():
            ref = lm.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=8,
                do_sample=False,
                pad_token_id=258,
            )
        assert got[str(i)] == ref[0, len(p) :].tolist(), (kind, i)
    if kind == "mistral":
        assert engine.max_model_len == 256


def test_bfloat16_pool_and_run(tiny_model_path_bf16: Path) -> None:
    torch.set_num_threads(1)
    lm = load_model(str(tiny_model_path_bf16))
    engine = Engine(lm, EngineConfig(num_blocks=16))
    assert engine.kv.pool.dtype == torch.bfloat16 and engine.compat_info()["dtype"] == "bfloat16"
    prompt = list(range(3, 30))
    engine.add_request("a", prompt, SamplingParams(max_tokens=5, ignore_eos=True))
    toks: list[int] = []
    while engine.has_work():
        for o in engine.step():
            toks += o.new_token_ids
    assert len(toks) == 5
    # the first token comes from a one-shot prefill, the same computation as generate's
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        logits = lm.model(ids).logits[0, -1]
    assert toks[0] == int(logits.argmax())
    assert engine.kv.free_blocks == 16


def test_dtype_override_casts_the_model(tiny_model_path: Path) -> None:
    lm = load_model(str(tiny_model_path))
    engine = Engine(lm, EngineConfig(num_blocks=8, dtype="bfloat16"))
    assert engine.kv.pool.dtype == torch.bfloat16
    assert next(engine.model.parameters()).dtype == torch.bfloat16

"""The tiny test model: a small random Llama checkpoint saved with ``save_pretrained``,
loaded by the product's own loading code like any checkpoint (``tests/conftest.py``'s
``tiny_model_path`` fixture, the GPU tests and the benches that need a model)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from splitserve_worker.models import torch_dtype


def save_tiny_llama(
    path: str | Path, *, seed: int = 0, dtype: str = "float32", **overrides: Any
) -> Path:
    """Save a small randomly initialised Llama checkpoint with a byte-level tokenizer
    built in place (so tests need nothing downloaded), loadable as any checkpoint is."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = tiny_tokenizer()
    cfg: dict[str, Any] = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
        initializer_range=0.1,  # large enough that greedy outputs vary token to token
    )
    cfg.update(overrides)
    torch.manual_seed(seed)
    model: Any = LlamaForCausalLM(LlamaConfig(**cfg))
    model = model.to(torch_dtype(dtype))
    model.save_pretrained(str(path), safe_serialization=True)
    tok.save_pretrained(str(path))
    return path


def tiny_tokenizer() -> Any:
    """A byte-level tokenizer (256 byte tokens plus bos/eos/pad) with a chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for special in ("<s>", "</s>", "<pad>"):
        vocab[special] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            pre_tokenizers.Split(Regex("."), behavior="isolated"),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    tok.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant: {% endif %}"
    )
    return tok

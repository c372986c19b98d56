"""The matmuls of one decoder layer, plainly through the model's modules or prepacked.

On the CPU in float32, oneDNN runs a linear layer much faster from weights reordered once
into its own blocked layout than from the row-major ``nn.Linear`` weight, above all for
the few-row inputs of decode steps. :class:`PackedLayer` keeps such a copy, with the q/k/v
projections fused into one matmul and the MLP's gate/up into another; the model's own
modules are left untouched (they still serve anything else that uses the model).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class LayerMatmuls(Protocol):
    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...
    def o(self, x: torch.Tensor) -> torch.Tensor: ...
    def mlp(self, x: torch.Tensor) -> torch.Tensor: ...


class ModuleLayer:
    """Calls the layer's own ``nn.Linear`` modules and MLP."""

    def __init__(self, layer: Any) -> None:
        self.attn = layer.self_attn
        self._mlp = layer.mlp

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.attn.q_proj(x), self.attn.k_proj(x), self.attn.v_proj(x)

    def o(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn.o_proj(x)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self._mlp(x)


def prepack_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


MIN_ROWS = 4
"""Inputs with fewer rows are padded with zero rows up to this many. oneDNN runs one or
two rows on a slower path than three or more (in a profile of a two-sequence step every
matmul took about a third longer than with three): a decode step of SmolLM2-135M on one
core took 54 ms with one sequence, 60 with two and 49 with three, and 45-48 with each
padded to four. Decode is bound by reading the weights, so the padded rows' arithmetic
costs nothing measurable."""


class PackedLinear:
    """``y = x @ W.T + b`` through oneDNN with ``W`` reordered once."""

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor | None], hint: int):
        w = torch.cat([t.detach() for t in weights]) if len(weights) > 1 else weights[0].detach()
        self.weight = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), hint)
        if any(b is not None for b in biases):
            parts = [
                b.detach() if b is not None else torch.zeros(wt.shape[0], dtype=wt.dtype)
                for wt, b in zip(weights, biases, strict=True)
            ]
            self.bias: torch.Tensor | None = torch.cat(parts)
        else:
            self.bias = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if x.dim() != 2 or rows >= MIN_ROWS:
            return self._linear(x)
        padded = x.new_zeros(MIN_ROWS, x.shape[1])
        padded[:rows] = x
        return self._linear(padded)[:rows]

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    @staticmethod
    def of(linear: Any, hint: int) -> PackedLinear:
        return PackedLinear([linear.weight], [linear.bias], hint)


class PackedLayer:
    """Fused, prepacked q/k/v, o, gate/up and down projections of one layer."""

    def __init__(self, layer: Any, hint: int) -> None:
        a = layer.self_attn
        projs = (a.q_proj, a.k_proj, a.v_proj)
        self._split = [int(p.weight.shape[0]) for p in projs]
        self._qkv = PackedLinear([p.weight for p in projs], [p.bias for p in projs], hint)
        self._o = PackedLinear.of(a.o_proj, hint)
        m = layer.mlp
        self._plain_mlp = m
        self._gate_up: PackedLinear | None = None
        if all(hasattr(m, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            self._inter = int(m.gate_proj.weight.shape[0])
            self._gate_up = PackedLinear(
                [m.gate_proj.weight, m.up_proj.weight], [m.gate_proj.bias, m.up_proj.bias], hint
            )
            self._down = PackedLinear.of(m.down_proj, hint)
            self._act = m.act_fn

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self._qkv(x).split(self._split, dim=-1)
        return q, k, v

    def o(self, x: torch.Tensor) -> torch.Tensor:
        return self._o(x)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        if self._gate_up is None:
            return self._plain_mlp(x)
        gate, up = self._gate_up(x).split([self._inter, self._inter], dim=-1)
        return self._down(self._act(gate) * up)


def packed_head(lm_head: Any, hint: int) -> Any:
    """The LM head prepacked (it is the single largest matmul of a decode step)."""
    return PackedLinear.of(lm_head, hint)

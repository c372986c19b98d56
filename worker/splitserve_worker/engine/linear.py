"""The matmuls of one decoder layer: q/k/v fused into one matmul and the MLP's gate/up
into another, on every device.

:class:`FusedLayer` (CUDA, and the CPU outside float32) concatenates those weights once
and points the model's own ``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj``
weights at slices of the result: no second copy of the weights, and the model's modules
still compute what they did (they still serve anything else that uses the model).

On the CPU in float32, oneDNN runs a linear layer much faster from weights reordered once
into its own blocked layout than from the row-major ``nn.Linear`` weight, above all for
the few-row inputs of decode steps. :class:`PackedLayer` keeps such a copy, fused the same
way; the model's own modules are left untouched.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F


class LayerMatmuls(Protocol):
    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...
    def o(self, x: torch.Tensor) -> torch.Tensor: ...
    def mlp(self, x: torch.Tensor) -> torch.Tensor: ...


def fuse_linears(linears: list[Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) holding ``linears``' rows in order; each module's own weight
    (and bias) becomes a view of it, so the model holds one copy of them."""
    with torch.no_grad():
        weight = torch.cat([m.weight.detach() for m in linears])
        bias = None
        if any(m.bias is not None for m in linears):
            bias = torch.cat([
                m.bias.detach() if m.bias is not None
                else torch.zeros(int(m.weight.shape[0]), dtype=weight.dtype, device=weight.device)
                for m in linears
            ])  # fmt: skip
        lo = 0
        for m in linears:
            n = int(m.weight.shape[0])
            m.weight = torch.nn.Parameter(weight[lo : lo + n], requires_grad=False)
            if m.bias is not None and bias is not None:
                m.bias = torch.nn.Parameter(bias[lo : lo + n], requires_grad=False)
            lo += n
    return weight, bias


class FusedLayer:
    """q/k/v and gate/up each one matmul, from weights shared with the model."""

    def __init__(self, layer: Any) -> None:
        a = layer.self_attn
        projs = [a.q_proj, a.k_proj, a.v_proj]
        self._split = [int(p.weight.shape[0]) for p in projs]
        self._qkv_w, self._qkv_b = fuse_linears(projs)
        self._o = a.o_proj
        m = layer.mlp
        self._plain_mlp = m
        self._gate_up: tuple[torch.Tensor, torch.Tensor | None] | None = None
        if all(hasattr(m, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            self._inter = int(m.gate_proj.weight.shape[0])
            self._gate_up = fuse_linears([m.gate_proj, m.up_proj])
            self._down = m.down_proj
            self._act = m.act_fn

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = F.linear(x, self._qkv_w, self._qkv_b).split(self._split, dim=-1)
        return q, k, v

    def o(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self._o(x)
        return out

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        if self._gate_up is None:
            plain: torch.Tensor = self._plain_mlp(x)
            return plain
        gate, up = F.linear(x, *self._gate_up).split([self._inter, self._inter], dim=-1)
        out: torch.Tensor = self._down(self._act(gate) * up)
        return out


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

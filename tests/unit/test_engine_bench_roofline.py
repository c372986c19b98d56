"""``bench/engine.py``'s roofline: the bytes and FLOPs of a decode step, and the bound
the hardware sets, by worked arithmetic."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_modules import load_bench
from splitserve_worker.models import load_model

pytestmark = pytest.mark.unit

bench = load_bench("engine")


def test_a_step_reads_the_weights_once_and_every_sequences_kv() -> None:
    cost = bench.ModelCost(weight_bytes=1000, linear_params=250, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=8, elem_bytes=4)  # fmt: skip
    # KV: 3 sequences x 10 positions x 2 layers x (K and V) x 2 heads x 8 dims x 4 bytes
    assert cost.step_bytes(3, 10) == 1000 + 3 * 10 * 2 * 2 * 2 * 8 * 4
    # 2 FLOPs per weight per row, and 4 per position per query head dim per layer
    assert cost.step_flops(3, 10) == 2 * 3 * 250 + 4 * 3 * 10 * 2 * 4 * 8
    memory_bound = bench.Hardware(copy_bytes_per_s=1e3, matmul_flops_per_s=1e12)
    assert bench.roofline_step_s(cost, memory_bound, 3, 10) == pytest.approx(
        cost.step_bytes(3, 10) / 1e3
    )
    compute_bound = bench.Hardware(copy_bytes_per_s=1e12, matmul_flops_per_s=1e3)
    assert bench.roofline_step_s(cost, compute_bound, 3, 10) == pytest.approx(
        cost.step_flops(3, 10) / 1e3
    )


def test_the_model_cost_counts_every_matmul_weight_once(tiny_model_path: Path) -> None:
    lm = load_model(str(tiny_model_path))
    cost = bench.model_cost(lm.model)
    cfg = lm.config  # hidden 64, intermediate 128, 4 layers, 4 heads, 2 KV heads, untied head
    per_layer = 64 * 64 + 2 * (64 * 32) + 64 * 64 + 3 * 64 * 128
    assert cost.linear_params == 4 * per_layer + cfg.vocab_size * 64
    assert cost.weight_bytes == 4 * cost.linear_params
    assert (cost.num_layers, cost.num_heads, cost.num_kv_heads, cost.head_dim) == (4, 4, 2, 16)

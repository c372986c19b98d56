"""The cost model's arithmetic against numbers worked out by hand here."""

from __future__ import annotations

import json

import pytest
from fuzz_profiles import scaled
from hypothesis import given, settings
from hypothesis import strategies as st
from splitserve_operator.sim.config import kv_capacity_tokens, pick_tp
from splitserve_operator.sim.cost import (
    MeasuredCost,
    RooflineCost,
    exposed_transfer_s,
    sum_max_of_lines,
    transfer_end,
)
from splitserve_operator.sim.hardware import GpuSpec, HardwareError, get_gpu, get_link
from splitserve_operator.sim.model_spec import (
    ModelSpec,
    ModelSpecError,
    known_models,
    load_model_spec,
)

pytestmark = pytest.mark.unit


# ---- the seed article's KV numbers ----


def test_llama2_70b_kv_bytes_per_token_is_the_articles_328_kb() -> None:
    m = load_model_spec("llama-2-70b")
    # K and V, 80 layers, 8 KV heads (GQA), head dim 8192 / 64 = 128, fp16
    assert m.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2 == 327_680


@pytest.mark.parametrize(
    ("link", "gbps", "article_ms"),
    [("pcie4", 32, 41), ("pcie5", 64, 20), ("roce400", 50, 26), ("nvlink", 450, 2.9)],
)
def test_raw_transfer_of_a_4000_token_prompt_matches_the_article(
    link: str, gbps: float, article_ms: float
) -> None:
    kv = 4000 * 327_680  # 1,310,720,000 bytes: "roughly 1.3 GB"
    assert kv == 1_310_720_000
    t = get_link(link).transfer_time(kv)
    assert t == pytest.approx(kv / (gbps * 1e9))
    assert t * 1000 == pytest.approx(article_ms, rel=0.03)  # the article rounds


def test_llama31_8b_counts() -> None:
    m = load_model_spec("llama-3.1-8b")
    assert m.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131_072
    attn = 4096 * 4096 * 2 + 4096 * 1024 * 2  # q, o + k, v
    mlp = 3 * 4096 * 14336
    assert attn == 41_943_040 and mlp == 176_160_768
    assert m.layer_matmul_params == 32 * (attn + mlp) == 6_979_321_856
    emb = 128_256 * 4096
    norms = 32 * 2 * 4096 + 4096
    assert m.total_params == 6_979_321_856 + 2 * emb + norms == 8_030_261_248  # "8.03 B"
    assert m.weight_bytes == 2 * 8_030_261_248
    assert m.streamed_weight_bytes == 2 * (6_979_321_856 + emb)


def test_prefill_flops_by_hand() -> None:
    m = load_model_spec("llama-3.1-8b")
    n = 1000
    linear = 2 * 6_979_321_856 * n  # 2 FLOPs per weight per token
    head = 2 * 128_256 * 4096  # logits of the last token only
    pairs = n * (n + 1) // 2  # causal: token i attends to i positions
    attention = pairs * 4 * 32 * 32 * 128  # QK^T and AV: 4 * heads * head_dim per pair per layer
    assert linear + head + attention == 14_222_100_529_152
    assert m.prefill_flops(n) == pytest.approx(14_222_100_529_152, rel=1e-12)
    # with 500 tokens cached, 1000 new ones attend to 500 + i positions each
    pairs_cached = n * 500 + pairs
    assert m.prefill_flops(n, 500) == pytest.approx(
        linear + head + pairs_cached * 4 * 32 * 32 * 128, rel=1e-12
    )


def test_tensor_parallel_shards_kv_heads_and_replicates_past_them() -> None:
    m = load_model_spec("llama-3.1-70b")
    assert m.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2 == 327_680
    assert m.kv_bytes_per_token_per_gpu(4) == 2 * 80 * 2 * 128 * 2 == 81_920
    assert m.kv_bytes_per_token_per_gpu(16) == 2 * 80 * 1 * 128 * 2  # one head each, replicated


def test_pick_tp_and_kv_capacity() -> None:
    m70 = load_model_spec("llama-3.1-70b")  # 141 GB of bf16 weights
    assert pick_tp(m70, get_gpu("h100")) == 4  # 35 GB per 80 GB GPU; tp 2 would be 71 GB
    assert pick_tp(m70, get_gpu("h200")) == 2  # 71 GB per 141 GB GPU
    m8 = load_model_spec("llama-3.1-8b")
    assert pick_tp(m8, get_gpu("l40s")) == 1
    # H100, tp 1: 0.9 * 80e9 - 16.06e9 bytes of weights, 131,072 bytes per token
    free = 0.9 * 80e9 - 2 * 8_030_261_248
    assert kv_capacity_tokens(m8, get_gpu("h100"), 1) == int(free // 131_072) == 426_784


# ---- roofline step times ----


def _ideal(m: ModelSpec, gpu: GpuSpec) -> RooflineCost:
    """No efficiency losses, no overheads: the bare roofline."""
    return RooflineCost(
        m, gpu, 1, compute_efficiency=1.0, memory_efficiency=1.0, gemm_half_tokens=0,
        step_overhead_s=0.0,
    )  # fmt: skip


def test_prefill_step_time_by_hand() -> None:
    m = load_model_spec("llama-3.1-8b")
    cost = _ideal(m, get_gpu("h100"))
    n = 1000
    gemm_flops = 2 * 6_979_321_856 * n + 2 * 128_256 * 4096  # one row of logits
    gemm_bytes = 2 * (6_979_321_856 + 128_256 * 4096) + n * 131_072  # weights + KV written
    gemm = max(gemm_flops / 989e12, gemm_bytes / 3.35e12)
    assert gemm == pytest.approx(14.1149e-3, rel=1e-4)  # compute-bound
    attn = n * (n + 1) / 2 * 524_288 / 989e12
    assert attn == pytest.approx(0.26532e-3, rel=1e-4)
    t = cost.step_time(n, n * (n + 1) / 2, 1, 0, 0)
    assert t == pytest.approx(gemm + attn, rel=1e-9)
    assert t == pytest.approx(14.380e-3, rel=1e-3)


def test_decode_step_time_by_hand() -> None:
    m = load_model_spec("llama-3.1-8b")
    cost = _ideal(m, get_gpu("h100"))
    b, ctx = 8, 8 * 1000
    weights = 2 * (6_979_321_856 + 128_256 * 4096)
    gemm = max(b * 2 * (6_979_321_856 + 128_256 * 4096) / 989e12, (weights + b * 131_072) / 3.35e12)
    assert gemm == pytest.approx(4.4806e-3, rel=1e-4)  # memory-bound: weights streamed once
    attn = ctx * max(524_288 / 989e12, 131_072 / 3.35e12)  # reading the KV dominates
    assert attn == pytest.approx(0.31301e-3, rel=1e-4)
    assert cost.step_time(0, 0, 0, b, ctx) == pytest.approx(gemm + attn, rel=1e-9)


def test_efficiencies_overhead_and_small_gemms() -> None:
    m = load_model_spec("llama-3.1-8b")
    h100 = get_gpu("h100")
    real = RooflineCost(
        m, h100, 1, compute_efficiency=0.5, memory_efficiency=0.8, gemm_half_tokens=1000,
        step_overhead_s=1e-3,
    )  # fmt: skip
    n = 1000  # gemm efficiency 1000 / (1000 + 1000) = 0.5, on top of the 0.5 compute efficiency
    flops = 2 * 6_979_321_856 * n + 2 * 128_256 * 4096
    nbytes = 2 * (6_979_321_856 + 128_256 * 4096) + n * 131_072
    gemm = max(flops / (989e12 * 0.5 * 0.5), nbytes / (3.35e12 * 0.8))
    assert gemm == flops / (989e12 * 0.25)  # compute-bound
    assert real.step_time(n, 0, 1, 0, 0) == pytest.approx(1e-3 + gemm, rel=1e-9)
    # a 100-token step is memory-bound: streaming the weights, efficiency does not matter
    small = 2 * (6_979_321_856 + 128_256 * 4096) + 100 * 131_072
    ideal = _ideal(m, h100)
    assert ideal.gemm_time(100, 1) == pytest.approx(small / 3.35e12, rel=1e-9)


def test_tensor_parallel_adds_allreduces() -> None:
    m = load_model_spec("llama-3.1-70b")
    h100 = get_gpu("h100")
    tp4 = RooflineCost(m, h100, 4, allreduce_latency_s=10e-6)
    tokens = 1000
    msg = tokens * 8192 * 2
    ring = 2 * 3 / 4 * msg / 450e9
    assert tp4.comm_time(tokens) == pytest.approx(2 * 80 * (10e-6 + ring), rel=1e-12)
    assert RooflineCost(m, h100, 1).comm_time(tokens) == 0.0


@settings(max_examples=scaled(60), deadline=None)
@given(
    b=st.integers(1, 64),
    ctx=st.integers(1, 200_000),
    k=st.integers(1, 300),
    model=st.sampled_from(["llama-3.1-8b", "llama-2-7b", "smollm2-135m", "llama-3.1-70b"]),
    tp=st.sampled_from([1, 2, 4]),
)
def test_decode_span_equals_the_sum_of_its_steps(
    b: int, ctx: int, k: int, model: str, tp: int
) -> None:
    m = load_model_spec(model)
    for cost in (
        RooflineCost(m, get_gpu("a100"), tp),
        MeasuredCost(0.01, 1e-4, 0.02, 3e-4, 1e-9, 2e-7),
    ):
        steps = sum(cost.step_time(0, 0, 0, b, ctx + j * b) for j in range(k))
        assert cost.decode_span(b, ctx, k) == pytest.approx(steps, rel=1e-9)


@settings(max_examples=scaled(200), deadline=None)
@given(
    a1=st.floats(-10, 10), b1=st.floats(-3, 3), a2=st.floats(-10, 10), b2=st.floats(-3, 3),
    k=st.integers(0, 50),
)  # fmt: skip
def test_sum_max_of_lines(a1: float, b1: float, a2: float, b2: float, k: int) -> None:
    brute = sum(max(a1 + b1 * j, a2 + b2 * j) for j in range(k))
    assert sum_max_of_lines(a1, b1, a2, b2, k) == pytest.approx(brute, rel=1e-9, abs=1e-9)


def test_measured_cost_fit_recovers_its_coefficients() -> None:
    truth = MeasuredCost(
        prefill_base_s=0.004, prefill_per_token_s=2e-4, decode_base_s=0.01, decode_per_seq_s=5e-4,
        prefill_per_pair_s=1e-8, decode_per_ctx_s=1e-6,
    )  # fmt: skip
    pre = [(n, truth.step_time(n, n * (n + 1) / 2, 1, 0, 0)) for n in (16, 64, 128, 256, 512)]
    dec = [
        (b, c, truth.step_time(0, 0, 0, b, c))
        for b, c in ((1, 100), (4, 900), (8, 400), (16, 5000))
    ]
    fit = MeasuredCost.fit(pre, dec)
    for field in ("prefill_base_s", "prefill_per_token_s", "prefill_per_pair_s",
                  "decode_base_s", "decode_per_seq_s", "decode_per_ctx_s"):  # fmt: skip
        assert getattr(fit, field) == pytest.approx(getattr(truth, field), rel=1e-6, abs=1e-12)


# ---- KV transfer timing ----


def test_transfer_without_overlap_waits_for_prefill() -> None:
    # 41 ms on PCIe Gen4 after a 100 ms prefill on an idle link
    assert exposed_transfer_s(0.04096, 0.100, 80, layerwise=False) == pytest.approx(0.04096)
    # a busy link delays the start: free at 0.15, prefill over at 0.10
    assert transfer_end(0.15, 0.0, 0.10, 0.04, 80, False) == pytest.approx(0.19)


def test_layerwise_transfer_hides_behind_prefill() -> None:
    t, L = 0.04096, 80
    # shorter than prefill: only the last layer's share is left after it
    assert exposed_transfer_s(t, 0.100, L, layerwise=True) == pytest.approx(t / L)
    # longer than prefill: everything but what overlapped the other 79 layers' compute
    assert exposed_transfer_s(t, 0.020, L, layerwise=True) == pytest.approx(t - 0.020 * 79 / 80)


# ---- configs ----


def test_known_models_and_config_files(tmp_path) -> None:  # type: ignore[no-untyped-def]
    names = known_models()
    for n in ("smollm2-135m", "llama-3.1-8b", "llama-3.1-70b", "qwen2.5-7b"):
        assert n in names
    smol = load_model_spec("smollm2-135m")
    assert (smol.layers, smol.heads, smol.kv_heads, smol.head_dim, smol.vocab) == (
        30,
        9,
        3,
        64,
        49152,
    )
    assert load_model_spec("builtin") == smol
    cfg = {
        "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 259,
        "torch_dtype": "float32",
    }  # fmt: skip
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    m = load_model_spec(folder)
    assert m.head_dim == 16 and m.dtype_bytes == 4 and m.name == "ckpt"
    assert m.kv_bytes_per_token == 2 * 4 * 2 * 16 * 4
    assert load_model_spec(folder / "config.json") == m
    assert load_model_spec(folder, dtype_bytes=2).dtype_bytes == 2
    del cfg["intermediate_size"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelSpecError, match="intermediate_size"):
        load_model_spec(folder)
    with pytest.raises(ModelSpecError, match="known names"):
        load_model_spec("no-such-model")
    with pytest.raises(HardwareError, match="h100"):
        get_gpu("v100")

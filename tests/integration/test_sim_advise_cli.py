"""``splitserve advise`` as a user runs it: the installed entry point, in its own process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def advise(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "splitserve.cli", "advise", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )


def test_json_answer_for_a_poisson_workload() -> None:
    p = advise(
        "--model", "llama-3.1-8b", "--gpu", "h100", "--link", "pcie4",
        "--slo-ttft", "0.5", "--slo-tpot", "0.05",
        "--rate", "2", "--prompt-len", "512", "--output-len", "128",
        "--gpus", "2", "--requests", "300", "--chunk-size", "512", "--json",
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["kv_bytes_per_token"] == 131_072
    assert out["typical_prompt_tokens"] == 512
    assert out["typical_kv_bytes"] == 512 * 131_072
    assert out["raw_transfer_s"] == pytest.approx(512 * 131_072 / 32e9)
    assert out["recommendation"] in ("colocated", "disaggregated")
    for mode in ("colocated", "disaggregated"):
        assert out[mode]["goodput_rps_per_gpu"] > 0
        assert out[mode]["gpus"] == 2
    assert out["reason"]


def test_the_rate_decides_and_the_inference_service_is_printed() -> None:
    """The example that used to say DISAGGREGATE 5:3 (the split's goodput per GPU on 8
    GPUs) though one colocated GPU serves 20 req/s: the rate decides now, the figures at
    scale stand beside it, and the InferenceService printed is one the CRD accepts."""
    import yaml
    from crd_validation import problems

    args = (
        "--model", "llama-3.1-8b", "--gpu", "h100", "--link", "pcie4",
        "--slo-ttft", "2", "--slo-tpot", "0.1",
        "--rate", "20", "--prompt-len", "200", "--output-len", "200",
    )  # fmt: skip
    p = advise(*args)
    assert p.returncode == 0, p.stderr
    text, _, snippet = p.stdout.partition("\nInferenceService")
    assert "recommendation: COLOCATE on 1 GPU (1 worker of tensor parallelism 1" in text
    assert "DISAGGREGATE" not in text
    lines = text.splitlines()
    at_rate = lines.index(next(ln for ln in lines if ln.startswith("at 20 req/s")))
    assert lines[at_rate + 1].split()[:3] == ["colocated", "1", "GPU"]
    assert lines[at_rate + 2].split()[:3] == ["disaggregated", "2", "GPUs"]
    assert any("req/s/GPU" in ln for ln in lines[at_rate + 3 :])  # at scale, beside it
    service = yaml.safe_load(snippet.split("\n", 1)[1])
    assert service["spec"]["decode"] == {"replicas": 1, "gpus": 1, "tensorParallelSize": 1}
    assert problems(service) == []
    out = json.loads(advise(*args, "--json").stdout)
    assert out["recommendation"] == "colocated" and out["recommended_gpus"] == 1
    assert out["colocated"]["at_rate"]["gpus"] == 1
    assert out["disaggregated"]["at_rate"]["gpus"] == 2
    assert out["disaggregated"]["goodput_rps_per_gpu"] > out["colocated"]["goodput_rps_per_gpu"]
    assert out["tensor_parallel"] == {"prefill": 1, "decode": 1}
    assert out["inference_service"] == service


def test_text_answer_for_a_trace_with_mixed_gpus_and_a_config_file(tmp_path: Path) -> None:
    cfg = {
        "num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
        "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536,
        "vocab_size": 49152, "tie_word_embeddings": True, "torch_dtype": "float32",
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    p = advise(
        "--model", str(tmp_path / "config.json"), "--prefill-gpu", "h100", "--decode-gpu", "a100",
        "--link", "roce400", "--slo-ttft", "1", "--slo-tpot", "0.02",
        "--trace", str(ROOT / "bench" / "traces" / "azure_code_sample.csv"),
        "--gpus", "3", "--requests", "300", "--chunk-size", "1024",
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    # served in bf16 whatever the checkpoint's dtype: 2 * 30 * 3 * 64 * 2 bytes
    assert "23,040 bytes per token" in p.stdout
    assert "recommendation:" in p.stdout and "why:" in p.stdout
    assert "A100" in p.stdout


def test_errors_are_one_clear_line() -> None:
    p = advise(
        "--model", "gpt-5", "--gpu", "h100", "--link", "pcie4", "--slo-ttft", "1",
        "--slo-tpot", "0.05", "--rate", "1", "--prompt-len", "10", "--output-len", "10",
    )  # fmt: skip
    assert p.returncode == 2
    assert "known names" in p.stderr and "llama-3.1-8b" in p.stderr
    p = advise(
        "--model", "llama-3.1-8b", "--gpu", "tpu", "--link", "pcie4", "--slo-ttft", "1",
        "--slo-tpot", "0.05", "--rate", "1", "--prompt-len", "10", "--output-len", "10",
    )  # fmt: skip
    assert p.returncode == 2 and "h100" in p.stderr
    # a model that needs 4 H100s per worker: every pool runs over 4 ranks, decode too
    p = advise(
        "--model", "llama-3.1-70b", "--gpu", "h100", "--link", "nvlink", "--slo-ttft", "2",
        "--slo-tpot", "0.1", "--rate", "1", "--prompt-len", "100", "--output-len", "10",
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "decode:\n    replicas: 1\n    gpus: 4\n    tensorParallelSize: 4" in p.stdout
    # and a budget below one worker is refused, saying what to give
    p = advise(
        "--model", "llama-3.1-70b", "--gpu", "h100", "--link", "nvlink", "--slo-ttft", "2",
        "--slo-tpot", "0.1", "--rate", "1", "--prompt-len", "100", "--output-len", "10",
        "--gpus", "2",
    )  # fmt: skip
    assert p.returncode == 2 and p.stdout == "", p.stdout
    assert "needs 4 x h100 per worker: give --gpus 4 or more" in p.stderr


def test_advise_never_imports_torch() -> None:
    code = (
        "import sys\n"
        "from splitserve_operator.commands import advise\n"
        "import argparse\n"
        "p = argparse.ArgumentParser(); advise.add_arguments(p)\n"
        "a = p.parse_args(['--model', 'smollm2-135m', '--gpu', 'l40s', '--link', 'pcie4',"
        " '--slo-ttft', '1', '--slo-tpot', '0.05', '--rate', '1', '--prompt-len', '100',"
        " '--output-len', '20', '--gpus', '2', '--requests', '100', '--chunk-size', '256'])\n"
        "assert advise.run(a) == 0\n"
        "bad = [m for m in ('torch', 'transformers', 'kopf', 'kubernetes') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr

"""The contract's sampling parameters: every bound is checked, naming the field, and the
module stays importable without torch (the router and the operator use it)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
from splitserve.sampling import MAX_TOP_LOGPROBS, SamplingError, SamplingParams

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (SamplingParams(temperature=-1), "temperature"),
        (SamplingParams(temperature=math.nan), "temperature"),
        (SamplingParams(top_p=0), "top_p"),
        (SamplingParams(top_p=1.5), "top_p"),
        (SamplingParams(top_k=-1), "top_k"),
        (SamplingParams(max_tokens=0), "max_tokens"),
        (SamplingParams(max_tokens=2, min_tokens=3), "min_tokens"),
        (SamplingParams(seed=2**64), "seed"),
        (SamplingParams(stop=("",)), "stop strings"),
        (SamplingParams(stop_token_ids=(-1,)), "stop_token_ids"),
        (SamplingParams(min_p=1.5), "min_p"),
        (SamplingParams(presence_penalty=2.5), "presence_penalty"),
        (SamplingParams(frequency_penalty=-3), "frequency_penalty"),
        (SamplingParams(repetition_penalty=0), "repetition_penalty"),
        (SamplingParams(repetition_penalty=math.inf), "repetition_penalty"),
        (SamplingParams(resumed_tokens=-1), "resumed_tokens"),
        (SamplingParams(top_logprobs=MAX_TOP_LOGPROBS + 1), "top_logprobs"),
        (SamplingParams(prompt_logprobs=MAX_TOP_LOGPROBS + 1), "prompt_logprobs"),
        (SamplingParams(logit_bias=((-1, 1.0),)), "logit_bias"),
        (SamplingParams(logit_bias=((4, 100.5),)), "logit_bias"),
        (SamplingParams(logit_bias=((4, math.nan),)), "logit_bias"),
    ],
)
def test_bad_parameters_name_the_field(params: SamplingParams, message: str) -> None:
    with pytest.raises(SamplingError, match=message):
        params.validate()


def test_good_parameters_pass() -> None:
    SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=3, max_tokens=5).validate()
    SamplingParams(top_logprobs=MAX_TOP_LOGPROBS, prompt_logprobs=0).validate()


def test_greedy_and_penalized() -> None:
    assert SamplingParams().greedy and SamplingParams(temperature=1.0, top_k=1).greedy
    assert not SamplingParams(temperature=0.5).greedy
    assert not SamplingParams().penalized
    assert SamplingParams(repetition_penalty=1.1).penalized
    assert SamplingParams(presence_penalty=0.1).penalized


def test_the_contract_loads_neither_torch_nor_a_worker_module() -> None:
    code = (
        "import sys, splitserve.sampling, splitserve.prefix_hash, splitserve.grpc_options; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'transformers', 'splitserve_worker', 'splitserve_operator')); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr

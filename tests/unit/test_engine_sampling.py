"""Sampling parameters are checked; the sampler honours greedy, top-k, top-p and seeds."""

from __future__ import annotations

import math

import pytest
import torch
from splitserve_worker.engine.config import EngineConfig
from splitserve_worker.engine.errors import RequestError
from splitserve_worker.engine.sampling import SampleRow, SamplingParams, sample

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
        (SamplingParams(stop=("",)), "stop strings"),
        (SamplingParams(stop_token_ids=(-1,)), "stop_token_ids"),
    ],
)
def test_bad_parameters_name_the_field(params: SamplingParams, message: str) -> None:
    with pytest.raises(RequestError, match=message):
        params.validate()


def test_good_parameters_pass() -> None:
    SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=3, max_tokens=5).validate()


def test_greedy_picks_argmax_and_logprob_is_the_models() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 0.0]])
    p = SamplingParams(logprobs=True)
    toks, lps = sample(logits, [SampleRow(p, None), SampleRow(p, None)])
    assert toks == [1, 0]
    assert lps[0] == pytest.approx(float(torch.log_softmax(logits[0], -1)[1]))


def test_suppressed_tokens_are_never_chosen() -> None:
    logits = torch.tensor([[0.0, 9.0, 1.0]])
    toks, _ = sample(logits, [SampleRow(SamplingParams(), None, suppress=(1,))])
    assert toks == [2]


def _draws(p: SamplingParams, n: int = 300) -> set[int]:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]])
    g = p.make_generator("cpu")
    return {sample(logits, [SampleRow(p, g)])[0][0] for _ in range(n)}


def test_top_k_and_top_p_restrict_the_support() -> None:
    assert _draws(SamplingParams(temperature=1.0, top_k=2, seed=1)) == {0, 1}
    # probabilities ~ .64 .23 .09 ...: top_p .8 keeps the first two
    assert _draws(SamplingParams(temperature=1.0, top_p=0.8, seed=2)) == {0, 1}
    assert len(_draws(SamplingParams(temperature=5.0, seed=3))) == 6


def test_seeded_rows_do_not_depend_on_their_neighbours() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    p = SamplingParams(temperature=1.0, seed=11)
    alone = [sample(logits[2:3], [SampleRow(p, p.make_generator("cpu"))])[0][0]]
    others = [SampleRow(SamplingParams(temperature=1.0), None) for _ in range(2)]
    batched = sample(logits[1:4], [others[0], SampleRow(p, p.make_generator("cpu")), others[1]])
    assert batched[0][1] == alone[0]


def test_config_is_checked() -> None:
    with pytest.raises(ValueError, match="max_batch_tokens"):
        EngineConfig(max_num_seqs=64, max_batch_tokens=8, prefill_chunk_tokens=8)
    with pytest.raises(ValueError, match="role"):
        EngineConfig(role="router")
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(block_size=0)
    assert EngineConfig().block_size == 16

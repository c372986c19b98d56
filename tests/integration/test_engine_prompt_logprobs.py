"""Prompt logprobs (``echo`` with ``logprobs``): each prompt token's log-probability given
the ones before it, equal to transformers' own forward, chunked or not, colocated or
prefilled layer by layer, whatever the prefix cache holds."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from splitserve.sampling import SamplingParams
from splitserve_worker.engine.config import EngineConfig
from splitserve_worker.engine.engine import Engine
from splitserve_worker.engine.model_runner import Chunk
from splitserve_worker.engine.prompt_logprobs import PromptLogprobs
from splitserve_worker.engine.sequence import RequestOutput
from splitserve_worker.models import LoadedModel, load_model

pytestmark = pytest.mark.integration

PROMPT = [random.Random(11).randrange(3, 256) for _ in range(45)]
SP = SamplingParams(max_tokens=3, ignore_eos=True, logprobs=True, top_logprobs=2,
                    prompt_logprobs=2)  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tiny_model_path: Path) -> LoadedModel:
    torch.set_num_threads(1)
    return load_model(str(tiny_model_path))


@pytest.fixture(scope="module")
def reference(tiny: LoadedModel) -> torch.Tensor:
    """transformers' log-probabilities at every prompt position ``[len - 1, vocab]``."""
    with torch.inference_mode():
        logits = tiny.model(torch.tensor([PROMPT])).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1)


def _run(engine: Engine, reqs: dict[str, SamplingParams]) -> dict[str, list[RequestOutput]]:
    for rid, sp in reqs.items():
        engine.add_request(rid, PROMPT, sp)
    outs: dict[str, list[RequestOutput]] = {rid: [] for rid in reqs}
    while engine.has_work():
        for o in engine.step():
            outs[o.request_id].append(o)
    return outs


def _scores(outs: list[RequestOutput]) -> PromptLogprobs:
    """The prompt logprobs, which come with the first token and only with it."""
    assert outs[0].new_token_ids and outs[0].prompt_logprobs is not None
    assert all(o.prompt_logprobs is None for o in outs[1:])
    return outs[0].prompt_logprobs


def _assert_matches(got: PromptLogprobs, ref: torch.Tensor) -> None:
    want = ref.gather(1, torch.tensor(PROMPT[1:])[:, None])[:, 0]
    assert got.complete and len(got.logprobs) == len(PROMPT) - 1
    assert got.logprobs == pytest.approx(want.tolist(), abs=1e-4)
    assert got.ranks == ((ref > want[:, None]).sum(dim=1) + 1).tolist()
    values, ids = torch.topk(ref, 2, dim=-1)
    assert [[t for t, _ in top] for top in got.tops] == ids.tolist()
    for top, vals in zip(got.tops, values.tolist(), strict=True):
        assert [v for _, v in top] == pytest.approx(vals, abs=1e-4)


@pytest.mark.parametrize("max_batch_tokens", [2048, 16])
def test_prompt_logprobs_equal_transformers(
    tiny: LoadedModel, reference: torch.Tensor, max_batch_tokens: int
) -> None:
    config = EngineConfig(num_blocks=128, max_num_seqs=2, max_batch_tokens=max_batch_tokens)
    engine = Engine(tiny, config)
    scored: list[int] = []
    forward = engine.runner.forward

    def counting(chunks: list[Chunk], *args: object, **kw: object) -> torch.Tensor:
        scored.extend(len(c.scores.targets) for c in chunks if c.scores is not None)
        return forward(chunks, *args, **kw)  # type: ignore[arg-type]

    engine.runner.forward = counting  # type: ignore[method-assign]
    outs = _run(engine, {"a": SP, "plain": SamplingParams(max_tokens=3, ignore_eos=True)})
    # 16: the 45-token prompt runs as chunks, each scored on its own
    assert sum(scored) == len(PROMPT) - 1
    assert len(scored) == (1 if max_batch_tokens > len(PROMPT) else 3)
    _assert_matches(_scores(outs["a"]), reference)
    # a request that did not ask gets none, and its tokens are the same greedy ones
    assert all(o.prompt_logprobs is None for o in outs["plain"])
    toks = [t for o in outs["a"] for t in o.new_token_ids]
    assert toks == [t for o in outs["plain"] for t in o.new_token_ids]


def test_a_cached_prefix_is_scored_anyway(tiny: LoadedModel, reference: torch.Tensor) -> None:
    engine = Engine(tiny, EngineConfig(num_blocks=128))
    _run(engine, {"warm": SamplingParams(max_tokens=1)})  # caches the prompt's full blocks
    outs = _run(engine, {"a": SP})["a"]
    assert outs[-1].num_cached_tokens == 0
    _assert_matches(_scores(outs), reference)
    # a request without prompt logprobs still reuses the cache
    assert _run(engine, {"b": SamplingParams(max_tokens=1)})["b"][-1].num_cached_tokens > 0


def test_layerwise_prefill_scores_the_same(tiny: LoadedModel, reference: torch.Tensor) -> None:
    # chunks of 16 tokens, as the prefill role runs a prompt longer than max_batch_tokens
    config = EngineConfig(num_blocks=128, max_num_seqs=4, max_batch_tokens=16, role="prefill")
    pre = Engine(tiny, config)
    _run(pre, {"warm": SamplingParams(max_tokens=1)})
    res = pre.prefill_export("a", PROMPT, SP, lambda *_: None)
    assert res.num_cached_tokens == 0 and res.prompt_logprobs is not None
    _assert_matches(res.prompt_logprobs, reference)
    assert pre.kv.free_blocks == pre.kv.total_blocks
    plain = pre.prefill_export("b", PROMPT, SamplingParams(max_tokens=1), lambda *_: None)
    assert plain.prompt_logprobs is None and plain.num_cached_tokens > 0


def test_prompt_of_one_token_has_no_scores(tiny: LoadedModel) -> None:
    engine = Engine(tiny, EngineConfig(num_blocks=32))
    engine.add_request("one", PROMPT[:1], SP)
    first = engine.step()[0]
    assert first.prompt_logprobs is not None
    assert first.prompt_logprobs.logprobs == [] and first.prompt_logprobs.complete

"""Stop conditions, logprobs, seeded batch invariance, request errors, metrics, events."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from splitserve import metric_names as names
from splitserve.metric_registry import Metrics
from splitserve.sampling import SamplingParams
from splitserve_worker.engine.config import EngineConfig
from splitserve_worker.engine.engine import Engine
from splitserve_worker.engine.errors import RequestError
from splitserve_worker.engine.prefix_cache import EventKind
from splitserve_worker.engine.sequence import RequestOutput
from splitserve_worker.models import LoadedModel, load_model

pytestmark = pytest.mark.integration

PROMPT = [random.Random(7).randrange(3, 256) for _ in range(23)]


@pytest.fixture(scope="module")
def tiny(tiny_model_path: Path) -> LoadedModel:
    torch.set_num_threads(1)
    return load_model(str(tiny_model_path))


@pytest.fixture
def engine(tiny: LoadedModel) -> Engine:
    return Engine(tiny, EngineConfig(num_blocks=128))


def _run(engine: Engine, reqs: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list]:
    for rid, (p, sp) in reqs.items():
        engine.add_request(rid, p, sp)
    outs: dict[str, list[RequestOutput]] = {rid: [] for rid in reqs}
    while engine.has_work():
        for o in engine.step():
            outs[o.request_id].append(o)
    return outs


def _tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def _greedy(engine: Engine, n: int = 12) -> list[int]:
    sp = SamplingParams(max_tokens=n, ignore_eos=True)
    return _tokens(_run(engine, {"g": (PROMPT, sp)})["g"])


def test_max_tokens_gives_length(engine: Engine) -> None:
    outs = _run(engine, {"a": (PROMPT, SamplingParams(max_tokens=5, ignore_eos=True))})["a"]
    assert len(_tokens(outs)) == 5
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert all(not o.finished for o in outs[:-1])
    assert outs[-1].num_prompt_tokens == len(PROMPT)


def test_stop_token_ids_and_min_tokens(engine: Engine) -> None:
    greedy = _greedy(engine)
    stop = greedy[2]
    first = greedy.index(stop)
    outs = _run(engine, {"a": (PROMPT, SamplingParams(max_tokens=12, stop_token_ids=(stop,)))})
    toks = _tokens(outs["a"])
    assert toks == greedy[: first + 1]
    assert outs["a"][-1].finish_reason == "stop" and outs["a"][-1].stop_reason == stop
    # min_tokens keeps the stop token from being chosen before it
    sp = SamplingParams(max_tokens=12, min_tokens=first + 2, stop_token_ids=(stop,))
    toks = _tokens(_run(engine, {"b": (PROMPT, sp)})["b"])
    assert len(toks) >= first + 2 and stop not in toks[: first + 2]


def test_eos_and_ignore_eos(engine: Engine) -> None:
    greedy = _greedy(engine)
    engine.stopper.eos_ids = frozenset({greedy[3]})
    stops_at = greedy.index(greedy[3])
    toks = _tokens(_run(engine, {"a": (PROMPT, SamplingParams(max_tokens=12))})["a"])
    assert toks == greedy[: stops_at + 1]
    toks = _tokens(
        _run(engine, {"b": (PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))})["b"]
    )
    assert toks == greedy


def test_stop_strings(engine: Engine, tiny: LoadedModel) -> None:
    greedy = _greedy(engine)
    tok = tiny.tokenizer
    # a stop string made of the text of two tokens from the fifth on: the first such pair
    # that is not blank, so no seed or model change can turn the test into a skip
    pairs = [tok.decode(greedy[i : i + 2]) for i in range(4, len(greedy) - 1)]
    target = next((t for t in pairs if t.strip()), None)
    assert target is not None, f"every pair of greedy tokens decodes to blanks: {pairs}"
    text_upto = [tok.decode(greedy[: i + 1]) for i in range(len(greedy))]
    expect = next(i for i, t in enumerate(text_upto) if target in t)
    outs = _run(engine, {"a": (PROMPT, SamplingParams(max_tokens=12, stop=(target,)))})["a"]
    assert _tokens(outs) == greedy[: expect + 1]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == target


def test_logprobs_match_transformers(engine: Engine, tiny: LoadedModel) -> None:
    sp = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=3)
    outs = _run(engine, {"a": (PROMPT, sp)})["a"]
    lps = [lp for o in outs for lp in o.new_logprobs]
    tops = [top for o in outs for top in o.new_top_logprobs]
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        ref = tiny.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=6,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=tiny.tokenizer.pad_token_id,
        )
    toks = ref.sequences[0, len(PROMPT) :].tolist()
    assert _tokens(outs) == toks
    want = [
        float(torch.log_softmax(lg[0].float(), -1)[t])
        for lg, t in zip(ref.logits, toks, strict=True)
    ]
    assert lps == pytest.approx(want, abs=1e-4)
    # the three most likely tokens at each position, best first: the greedy one leads
    assert len(tops) == len(toks)
    for top, lg, t, lp in zip(tops, ref.logits, toks, lps, strict=True):
        values, ids = torch.topk(torch.log_softmax(lg[0].float(), -1), 3)
        assert [i for i, _ in top] == ids.tolist() and top[0] == (t, pytest.approx(lp))
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-4)


def test_seeded_sampling_is_batch_invariant(tiny: LoadedModel) -> None:
    sp = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=1234, max_tokens=16)
    alone = _tokens(_run(Engine(tiny, EngineConfig(num_blocks=128)), {"x": (PROMPT, sp)})["x"])
    rng = random.Random(3)
    crowd: dict[str, tuple[list[int], SamplingParams]] = {
        f"o{i}": (
            [rng.randrange(3, 256) for _ in range(rng.randrange(1, 70))],
            SamplingParams(temperature=rng.choice([0.0, 1.0]), max_tokens=rng.randrange(1, 20)),
        )
        for i in range(7)
    }
    crowd["x"] = (PROMPT, sp)
    cfg = EngineConfig(num_blocks=128, max_num_seqs=8, max_batch_tokens=40, prefill_chunk_tokens=9)
    together = _tokens(_run(Engine(tiny, cfg), crowd)["x"])
    assert together == alone
    other_seed = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=99, max_tokens=16)
    differs = _tokens(
        _run(Engine(tiny, EngineConfig(num_blocks=128)), {"y": (PROMPT, other_seed)})["y"]
    )
    assert differs != alone


@pytest.mark.parametrize(
    ("prompt", "sp", "message"),
    [
        ([], SamplingParams(), "empty"),
        ([1] * 100, SamplingParams(max_tokens=100), "over this model's limit"),
        ([5], SamplingParams(top_p=2.0), "top_p"),
        ([-1], SamplingParams(), "outside the vocabulary"),
        ([5], SamplingParams(logit_bias=((10**6, 1.0),)), "logit_bias token ids"),
    ],
)
def test_request_errors_leave_the_engine_serving(
    tiny: LoadedModel, prompt: list[int], sp: SamplingParams, message: str
) -> None:
    engine = Engine(tiny, EngineConfig(num_blocks=64, max_model_len=150))
    engine.add_request("ok", PROMPT, SamplingParams(max_tokens=3, ignore_eos=True))
    with pytest.raises(RequestError, match=message):
        engine.add_request("bad", prompt, sp)
    outs: list[RequestOutput] = []
    while engine.has_work():
        outs += engine.step()
    assert sum(len(o.new_token_ids) for o in outs) == 3
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request("dup", PROMPT, SamplingParams())
        engine.add_request("dup", PROMPT, SamplingParams())


def test_too_long_for_the_cache(tiny: LoadedModel) -> None:
    engine = Engine(tiny, EngineConfig(num_blocks=2))
    with pytest.raises(RequestError, match="more than this worker's whole cache"):
        engine.add_request("a", list(range(3, 40)), SamplingParams(max_tokens=1))


def test_metrics_and_events(tiny: LoadedModel) -> None:
    m = Metrics()
    engine = Engine(tiny, EngineConfig(num_blocks=64, role="both"), m)

    def value(spec: names.MetricSpec) -> float:
        return m.get(spec).labels(role="both")._value.get()  # type: ignore[attr-defined]

    assert value(names.KV_BLOCKS_FREE) == 64 and value(names.KV_BLOCKS_USED) == 0
    prompt = list(range(3, 3 + 40))
    engine.add_request("a", prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    assert value(names.RUNNING) == 1 and value(names.KV_BLOCKS_USED) == 3
    assert value(names.KV_BLOCKS_FREE) == engine.kv.free_blocks == 61
    while engine.has_work():
        engine.step()
    assert value(names.WORKER_PREFILL_TOKENS) == 40
    assert value(names.WORKER_DECODE_TOKENS) == 4
    events = engine.drain_events()
    stored = [h for e in events if e.kind is EventKind.STORED for h in e.block_hashes]
    assert stored[:2] == engine.block_hashes(prompt)
    _run(engine, {"b": (prompt, SamplingParams(max_tokens=1))})
    assert value(names.PREFIX_HITS) == 32 and value(names.PREFIX_QUERIES) == 80
    assert value(names.KV_BLOCKS_FREE) == 64


def test_compat_identity(engine: Engine) -> None:
    info = engine.compat_info()
    assert info["kv_layout"] == "LKBTHD-v1" and info["block_size"] == 16
    assert info["num_layers"] == 4 and info["kv_heads"] == 2 and info["head_dim"] == 16
    assert info["dtype"] == "float32"
    assert len(engine.compat_hash()) == 64
    assert engine.kv.pool.shape == (4, 2, 128, 16, 2, 16) and engine.kv.pool.is_contiguous()

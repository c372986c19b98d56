"""Prompt logprobs, the pure parts: which rows a chunk scores, scores kept by position,
the LM head run in slices, the wire both ways, and the completions' logprobs object."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from splitserve.sampling import SamplingParams
from splitserve.v1 import worker_pb2 as pb
from splitserve_worker.engine.prompt_logprobs import (
    ChunkScores,
    PromptLogprobs,
    chunk_targets,
    score_rows,
)
from splitserve_worker.router.responses import Job, final_choice, logprobs_of
from splitserve_worker.router.text import Detokenizer
from splitserve_worker.router.worker_conn import PromptScores
from splitserve_worker.server.convert import prompt_logprobs_to_proto

pytestmark = pytest.mark.unit

TOKENS = [10, 11, 12, 13, 14, 15]  # a 5-token prompt, then one generated token


def test_each_row_scores_the_next_prompt_token_and_never_an_output_token() -> None:
    assert chunk_targets(TOKENS, 5, 0, 5) == [11, 12, 13, 14]  # the last row predicts output
    assert chunk_targets(TOKENS, 5, 0, 2) == [11, 12]  # a first chunk: every row scored
    assert chunk_targets(TOKENS, 5, 2, 5) == [13, 14]
    assert chunk_targets(TOKENS, 5, 4, 5) == []
    assert chunk_targets(TOKENS, 1, 0, 1) == []


def test_scores_are_kept_by_position_and_a_recomputed_chunk_overwrites() -> None:
    p = PromptLogprobs.empty(5)
    assert len(p.logprobs) == 4 and not p.complete
    p.record(2, ChunkScores([13, 14], logprobs=[-3.0, -4.0], tops=[[(1, -0.5)], [(2, -0.25)]]))
    p.record(0, ChunkScores([11, 12], logprobs=[-1.0, -2.0]))
    assert p.complete and p.logprobs == [-1.0, -2.0, -3.0, -4.0]
    p.record(0, ChunkScores([11], logprobs=[-1.5]))  # computed again after a preemption
    assert p.logprobs[0] == -1.5 and p.tops[2:] == [[(1, -0.5)], [(2, -0.25)]]
    assert PromptLogprobs.empty(1).complete and PromptLogprobs.empty(1).logprobs == []


def test_the_head_in_slices_gives_what_one_pass_gives() -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=False)
    hidden = torch.randn(7, 8)
    targets = [3, 1, 4, 1, 5, 9, 2]
    whole, sliced = ChunkScores(targets, top=3), ChunkScores(targets, top=3)
    with torch.inference_mode():
        score_rows(hidden, head, whole)
        score_rows(hidden, head, sliced, rows_per_pass=3)
        lp = torch.log_softmax(head(hidden), dim=-1)
    want = [float(lp[i, t]) for i, t in enumerate(targets)]
    assert whole.logprobs == pytest.approx(want, abs=1e-6)
    assert whole.ranks == [int((lp[i] > lp[i, t]).sum()) + 1 for i, t in enumerate(targets)]
    assert sliced.ranks == whole.ranks
    assert sliced.logprobs == pytest.approx(whole.logprobs, abs=1e-6)
    assert [[t for t, _ in top] for top in sliced.tops] == torch.topk(lp, 3).indices.tolist()
    for a, b in zip(sliced.tops, whole.tops, strict=True):  # matmuls of other shapes
        assert [t for t, _ in a] == [t for t, _ in b]
        assert [v for _, v in a] == pytest.approx([v for _, v in b], abs=1e-6)


def test_prompt_logprobs_cross_the_wire() -> None:
    p = PromptLogprobs([-1.0, -2.5], [[(4, -0.5), (6, -1.0)], [(7, -0.25), (4, -2.0)]], [3, 9])
    chunk = pb.TokenChunk(token_ids=[9])
    assert PromptScores.from_chunk(chunk) is None  # not asked for
    chunk.prompt_logprobs.CopyFrom(prompt_logprobs_to_proto(p))
    got = PromptScores.from_chunk(pb.TokenChunk.FromString(chunk.SerializeToString()))
    assert got == PromptScores(
        (-1.0, -2.5), ([(4, -0.5), (6, -1.0)], [(7, -0.25), (4, -2.0)]), (3, 9)
    )
    # without alternatives asked for, none go on the wire
    bare = prompt_logprobs_to_proto(PromptLogprobs([-1.0], [[]], [1]))
    assert list(bare.logprobs) == [-1.0] and not bare.top_logprobs
    # a one-token prompt has no scores, but they were asked for: the field is there
    chunk = pb.TokenChunk(token_ids=[9])
    chunk.prompt_logprobs.CopyFrom(prompt_logprobs_to_proto(PromptLogprobs.empty(1)))
    assert PromptScores.from_chunk(chunk) == PromptScores(())


class _Tok:
    def decode(self, ids: list[int], **_: Any) -> str:
        return "".join(f"<{i}>" for i in ids)


def _job(top: int, prompt_logprobs: int | None = None) -> Job:
    return Job(id="cmpl-1", kind="text_completion", model="m", prompt=(1, 2, 3),
               sampling=SamplingParams(top_logprobs=top), detok=Detokenizer(_Tok(), ()),
               want_logprobs=True, return_token_ids=False, stream=False, echo_logprobs=True,
               prompt_logprobs=prompt_logprobs)  # fmt: skip


def test_echo_puts_the_prompts_logprobs_first_the_first_token_without_one() -> None:
    scores = PromptScores((-1.0, -2.0), ([(2, -1.0)], [(5, -0.5)]))
    lp = logprobs_of(_job(1), [7], [-0.75], [[(7, -0.75)]], scores)
    assert lp["tokens"] == ["<1>", "<2>", "<3>", "<7>"]
    assert lp["token_logprobs"] == [None, -1.0, -2.0, -0.75]
    assert lp["top_logprobs"] == [None, {"<2>": -1.0}, {"<5>": -0.5}, {"<7>": -0.75}]
    assert lp["text_offset"] == [0, 3, 6, 9]
    lp = logprobs_of(_job(0), [7], [-0.75], [], PromptScores((-1.0, -2.0)))
    assert lp["token_logprobs"] == [None, -1.0, -2.0, -0.75] and lp["top_logprobs"] is None
    # a stream: the prompt's logprobs come with the first piece only, and text_offset
    # runs on across the pieces
    job = _job(0)
    first = logprobs_of(job, [7], [-0.75], [], PromptScores((-1.0, -2.0)))
    later = logprobs_of(job, [12, 8], [-0.5, -0.25], [])
    assert first["text_offset"] == [0, 3, 6, 9]
    assert later["tokens"] == ["<12>", "<8>"] and later["text_offset"] == [12, 16]


def test_vllm_prompt_logprobs_hold_each_prompt_token_and_the_most_likely_ones() -> None:
    # the scores hold two alternatives (prompt_logprobs 2); echo's logprobs ask for one
    scores = PromptScores((-1.0, -2.0), ([(2, -1.0), (4, -1.5)], [(5, -0.5), (6, -0.75)]), (1, 3))
    job = _job(1, prompt_logprobs=2)
    job.prompt_scores, job.tokens, job.logprobs = scores, [7], [-0.75]
    job.top_logprobs = [[(7, -0.75)]]
    c = final_choice(job)
    assert c["logprobs"]["top_logprobs"] == [None, {"<2>": -1.0}, {"<5>": -0.5}, {"<7>": -0.75}]
    assert c["prompt_logprobs"] == [
        None,
        {"2": {"logprob": -1.0, "rank": 1, "decoded_token": "<2>"},  # the prompt's, 1st
         "4": {"logprob": -1.5, "rank": 2, "decoded_token": "<4>"}},
        {"3": {"logprob": -2.0, "rank": 3, "decoded_token": "<3>"},
         "5": {"logprob": -0.5, "rank": 1, "decoded_token": "<5>"},
         "6": {"logprob": -0.75, "rank": 2, "decoded_token": "<6>"}},
    ]  # fmt: skip
    # not asked for: no such field
    job = _job(1)
    job.prompt_scores, job.tokens, job.logprobs = scores, [7], [-0.75]
    assert "prompt_logprobs" not in final_choice(job)

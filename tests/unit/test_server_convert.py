"""Sampling parameters cross the wire whole: every field of the contract's SamplingParams
survives the client's proto and the server's reading of it, so a field added to the
type but not to the wire (or to one direction only) fails here."""

from __future__ import annotations

import dataclasses

import pytest
from splitserve.sampling import SamplingError, SamplingParams
from splitserve.v1 import worker_pb2 as pb
from splitserve_worker.client import sampling_to_proto
from splitserve_worker.server.convert import sampling_from_proto

pytestmark = pytest.mark.unit

ALL_SET = SamplingParams(
    temperature=0.5,
    top_p=0.75,
    top_k=7,
    seed=2**40 + 3,
    max_tokens=33,
    min_tokens=2,
    ignore_eos=True,
    stop_token_ids=(5, 9),
    stop=("end", "\n\n"),
    logprobs=True,
    top_logprobs=4,
    min_p=0.125,
    presence_penalty=0.5,
    frequency_penalty=-0.25,
    repetition_penalty=1.5,
    resumed_tokens=6,
    logit_bias=((3, -100.0), (17, 2.5)),
    prompt_logprobs=3,
)


def test_every_field_is_set_to_something_other_than_its_default() -> None:
    default = SamplingParams()
    same = [f.name for f in dataclasses.fields(SamplingParams)
            if getattr(ALL_SET, f.name) == getattr(default, f.name)]  # fmt: skip
    assert not same, f"give these a non-default value here: {same}"


def test_sampling_params_survive_the_proto() -> None:
    assert sampling_from_proto(sampling_to_proto(ALL_SET)) == ALL_SET


def test_a_proto_is_sent_as_it_is() -> None:
    msg = pb.SamplingParams(top_k=-3)  # out of bounds: the worker, not the client, says so
    assert sampling_to_proto(msg) is msg


def test_the_server_checks_what_it_reads() -> None:
    with pytest.raises(SamplingError, match="top_k"):
        sampling_from_proto(pb.SamplingParams(top_k=-3))


def test_an_empty_proto_means_the_defaults() -> None:
    assert sampling_from_proto(pb.SamplingParams()) == SamplingParams()

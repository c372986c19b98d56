"""Sampling parameters cross the wire whole: every field of the engine's SamplingParams
survives the proto both ways, so a field added on one side only fails here."""

from __future__ import annotations

import dataclasses

import pytest
from splitserve_worker.engine.sampling import SamplingParams
from splitserve_worker.router.worker_client import Sampling
from splitserve_worker.server.convert import sampling_from_proto, sampling_to_proto

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


def test_engine_sampling_params_survive_the_proto() -> None:
    assert sampling_from_proto(sampling_to_proto(ALL_SET)) == ALL_SET


def test_the_routers_sampling_has_every_engine_field_and_survives_too() -> None:
    engine_fields = {f.name for f in dataclasses.fields(SamplingParams)}
    assert {f.name for f in dataclasses.fields(Sampling)} == engine_fields
    router_side = Sampling(**dataclasses.asdict(ALL_SET))
    assert sampling_from_proto(sampling_to_proto(router_side)) == ALL_SET


def test_an_empty_proto_means_the_defaults() -> None:
    from splitserve.v1 import worker_pb2 as pb

    assert sampling_from_proto(pb.SamplingParams()) == SamplingParams()

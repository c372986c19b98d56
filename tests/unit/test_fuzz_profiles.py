"""The Hypothesis profile CI runs is a fixed search, and the long one searches more."""

from __future__ import annotations

import os

import fuzz_profiles
import pytest
from hypothesis import settings
from hypothesis.errors import InvalidArgument

pytestmark = pytest.mark.unit


def test_ci_picks_the_fixed_search_and_the_named_profile_wins() -> None:
    assert fuzz_profiles.profile_name({}) == "default"
    assert fuzz_profiles.profile_name({"CI": "true"}) == "ci"
    assert fuzz_profiles.profile_name({"CI": "1", "HYPOTHESIS_PROFILE": "long"}) == "long"


def test_the_ci_profile_is_derandomized_without_a_database() -> None:
    ci = settings.get_profile("ci")
    assert ci.derandomize is True
    assert ci.database is None


def test_this_run_loaded_the_profile_its_environment_asks_for() -> None:
    want = fuzz_profiles.profile_name(os.environ)
    assert settings.get_current_profile_name() == want
    if want == "ci":
        assert settings().derandomize and settings().database is None


def test_scaled_examples_follow_the_profile() -> None:
    base = settings().max_examples
    try:
        settings.load_profile("long")
        assert fuzz_profiles.scaled(60) == 60 * fuzz_profiles.LONG_FACTOR
        settings.load_profile("ci")
        assert fuzz_profiles.scaled(60) == 60
    finally:
        settings.load_profile(fuzz_profiles.profile_name(os.environ))
    assert settings().max_examples == base


def test_an_unknown_profile_name_fails_loudly() -> None:
    with pytest.raises(InvalidArgument, match="nonesuch"):
        fuzz_profiles.load({"HYPOTHESIS_PROFILE": "nonesuch"})
    settings.load_profile(fuzz_profiles.profile_name(os.environ))

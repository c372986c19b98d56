"""The chi-square helper the sampling tests rely on gives the textbook values."""

from __future__ import annotations

import math

import pytest
from chi_square import chi2_sf, goodness_of_fit

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("statistic", "df", "p"),
    [
        (3.841459, 1, 0.05),  # the familiar 5 % critical values
        (5.991465, 2, 0.05),
        (18.307038, 10, 0.05),
        (6.634897, 1, 0.01),
        (37.566235, 20, 0.01),
        (10.0, 4, 0.040428),
        (1.0, 3, 0.801252),
        (0.5, 7, 0.999521),
    ],
)
def test_survival_function_matches_tables(statistic: float, df: int, p: float) -> None:
    assert chi2_sf(statistic, df) == pytest.approx(p, rel=1e-4)


def test_survival_function_edges() -> None:
    assert chi2_sf(0.0, 3) == 1.0
    assert chi2_sf(math.inf, 3) == 0.0
    assert chi2_sf(100.0, 2) == pytest.approx(math.exp(-50.0), rel=1e-9)  # df 2: e^(-x/2)
    with pytest.raises(ValueError, match="degrees of freedom"):
        chi2_sf(1.0, 0)


def test_goodness_of_fit_accepts_the_truth_and_rejects_a_drawn_impossibility() -> None:
    fit = goodness_of_fit([250, 250, 500], [0.25, 0.25, 0.5])
    assert fit.statistic == 0.0 and fit.df == 2 and fit.p_value == 1.0
    assert goodness_of_fit([10, 0, 990], [0.0, 0.5, 0.5]).impossible == (0,)
    skewed = goodness_of_fit([400, 100, 500], [0.25, 0.25, 0.5])
    assert skewed.p_value < 1e-20


def test_rare_outcomes_are_pooled() -> None:
    # expected 1 and 1 (pooled into one bin of 2) beside 998: one degree of freedom
    fit = goodness_of_fit([1, 1, 998], [0.001, 0.001, 0.998])
    assert fit.df == 1

"""Cost-quality curve, APGR and call-performance thresholds on hand-computed examples."""

import numpy as np
import pytest

from cascade.metrics import routing_curve

# Four requests: small right on 0 and 3, large right on 0, 1, 2.
SMALL = [True, False, False, True]
LARGE = [True, True, True, False]


def test_curve_follows_the_score_order() -> None:
    curve = routing_curve([0.1, 0.9, 0.8, 0.2], SMALL, LARGE)
    # k=0: 2/4; k=1 (req 1): 3/4; k=2 (+req 2): 4/4; k=3 (+req 3, large wrong): 3/4; k=4: 3/4
    assert curve.quality.tolist() == [0.5, 0.75, 1.0, 0.75, 0.75]
    assert curve.small_quality == 0.5 and curve.large_quality == 0.75
    assert curve.pgr.tolist() == [0.0, 1.0, 2.0, 1.0, 1.0]
    # trapezoids over 0, .25, ..., 1: .25 * (0/2 + 1 + 2 + 1 + 1/2)
    assert curve.apgr() == pytest.approx(1.125)
    assert curve.cpt(0.5) == pytest.approx(0.125)
    assert curve.cpt(2.0) == pytest.approx(0.5)
    assert curve.cpt(2.5) is None


def test_constant_scores_give_the_random_line() -> None:
    curve = routing_curve([0.3] * 4, SMALL, LARGE)
    assert curve.quality.tolist() == pytest.approx([0.5, 0.5625, 0.625, 0.6875, 0.75])
    assert curve.apgr() == pytest.approx(0.5)
    assert curve.cpt(0.5) == pytest.approx(0.5)
    assert curve.cpt(0.8) == pytest.approx(0.8)


def test_random_scores_average_near_half_and_oracle_is_best() -> None:
    rng = np.random.default_rng(0)
    small = rng.random(400) < 0.6
    large = small | (rng.random(400) < 0.5)
    oracle = routing_curve(large.astype(float) - small.astype(float), small, large)
    randoms = [routing_curve(rng.random(400), small, large).apgr() for _ in range(30)]
    assert abs(np.mean(randoms) - 0.5) < 0.03
    # large is never worse here, so the oracle reaches the full gap at the gain rate
    gain_rate = np.mean(large & ~small)
    assert oracle.cpt(1.0) == pytest.approx(gain_rate)
    assert oracle.apgr() == pytest.approx(1 - gain_rate / 2, abs=1e-9)
    assert oracle.apgr() > max(randoms)


def test_ties_inside_a_block_are_averaged() -> None:
    # req 1 alone on top, then 0/2/3 tied: the tied block is interpolated linearly
    curve = routing_curve([0.5, 0.9, 0.5, 0.5], SMALL, LARGE)
    assert curve.quality[1] == 0.75
    assert curve.quality[4] == 0.75
    assert curve.quality[2] == pytest.approx(0.75)  # block gain 0 (+1 from req 2, -1 from req 3)

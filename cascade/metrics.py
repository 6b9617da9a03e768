"""Cost-quality arithmetic of a router: the curve, APGR and call-performance thresholds.

A router with scores sends the `k` highest-scoring of `n` requests to the large model
(fraction `k / n`); a request's quality is 1 when the model that served it answered
correctly. Ties in score are broken at random, so inside a block of equal scores the
curve is the expected value: a straight line between the block's ends. A constant
score is therefore the random router, whose curve is the straight line from
always-small to always-large.

PGR (performance gap recovered) at a fraction is
`(quality - always_small) / (always_large - always_small)`; it can exceed 1 (the
oracle beats always-large, because the small model is right on some questions the
large one gets wrong). APGR is the area under PGR over fractions 0..1 (random: 0.5).
The call-performance threshold CPT(x) is the least fraction of large calls at which
PGR reaches `x` (random: `x`); None when the curve never reaches it.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RoutingCurve:
    fractions: np.ndarray  # k / n for k = 0..n: fraction of requests sent large
    quality: np.ndarray  # mean correctness at each fraction, 0..1
    small_quality: float  # always-small (fraction 0)
    large_quality: float  # always-large (fraction 1)

    @property
    def pgr(self) -> np.ndarray:
        """PGR at each fraction; NaN everywhere when both models score the same."""
        gap = self.large_quality - self.small_quality
        if gap == 0:
            return np.full_like(self.quality, np.nan)
        return (self.quality - self.small_quality) / gap

    def apgr(self) -> float:
        """Area under PGR over fractions 0..1 (trapezoids over the n + 1 points)."""
        return float(np.trapezoid(self.pgr, self.fractions))

    def cpt(self, target_pgr: float) -> float | None:
        """Least fraction of large calls reaching `target_pgr` (linear between points)."""
        pgr = self.pgr
        hits = np.flatnonzero(pgr >= target_pgr - 1e-12)
        if hits.size == 0:
            return None
        k = int(hits[0])
        if k == 0:
            return 0.0
        lo, hi = pgr[k - 1], pgr[k]
        t = (target_pgr - lo) / (hi - lo)
        return float(self.fractions[k - 1] + t * (self.fractions[k] - self.fractions[k - 1]))

    def quality_at(self, fraction: float) -> float:
        return float(np.interp(fraction, self.fractions, self.quality))


def routing_curve(
    scores: Sequence[float] | np.ndarray,
    small_ok: Sequence[bool] | np.ndarray,
    large_ok: Sequence[bool] | np.ndarray,
) -> RoutingCurve:
    """The expected cost-quality curve of routing the highest `scores` to the large model."""
    s = np.asarray(scores, dtype=np.float64)
    small = np.asarray(small_ok, dtype=np.float64)
    large = np.asarray(large_ok, dtype=np.float64)
    n = s.size
    if n == 0 or small.size != n or large.size != n:
        raise ValueError("scores, small_ok and large_ok must be equally long and not empty")
    order = np.argsort(-s, kind="stable")
    gain = np.concatenate([[0.0], np.cumsum((large - small)[order])])
    # Ends of each block of tied scores; between ends the expected gain is linear.
    sorted_s = s[order]
    ends = np.flatnonzero(np.diff(sorted_s) != 0) + 1
    knots = np.concatenate([[0], ends, [n]])
    k = np.arange(n + 1)
    expected_gain = np.interp(k, knots, gain[knots])
    small_q = float(small.mean())
    return RoutingCurve(
        fractions=k / n,
        quality=small_q + expected_gain / n,
        small_quality=small_q,
        large_quality=float(large.mean()),
    )


def curve_summary(curve: RoutingCurve) -> dict[str, float | None]:
    """APGR and CPT(50%), CPT(80%) of one curve, as plain floats for a report."""
    return {
        "apgr": curve.apgr(),
        "cpt50": curve.cpt(0.5),
        "cpt80": curve.cpt(0.8),
        "small_quality": curve.small_quality,
        "large_quality": curve.large_quality,
        "max_quality": float(curve.quality.max()),
    }

"""Coordinate-wise median (Yin et al. 2018): each coordinate is the median of the updates' values.

Unweighted: a site's ``num_samples`` does not count (a hostile site could claim any number). With
an even number of updates, the mean of the two middle values. Tolerates up to half the updates
being arbitrary, per coordinate.
"""

from __future__ import annotations

import numpy as np

from flare_airflow.core.aggregation.strategies.base import RuleKind


class Median:
    name = "median"
    kind = RuleKind.CHUNKED
    observes = False

    def quorum_problem(self, n: int) -> str | None:
        return None if n >= 1 else "the median needs at least 1 valid update"

    def observe(self, stack: np.ndarray) -> np.ndarray:
        raise NotImplementedError("the median has no first pass")

    def selected(self, observed: np.ndarray | None, weights: np.ndarray) -> list[int]:
        return list(range(len(weights)))

    def combine(self, stack: np.ndarray, weights: np.ndarray) -> np.ndarray:
        return np.asarray(np.median(stack, axis=0))

"""Coordinate-wise trimmed mean (Yin et al. 2018): per coordinate, drop the ``k = ceil(beta * n)``
largest and ``k`` smallest values of the ``n`` updates and average the rest.

Unweighted, like the median. Needs ``2k < n``: something must be left to average.
"""

from __future__ import annotations

import math

import numpy as np

from flare_airflow.core.aggregation.strategies.base import RuleKind


def trimmed(n: int, beta: float) -> int:
    """How many values are cut at each end: ``ceil(beta * n)`` (a tiny tolerance so that 0.2 x 5 is 1)."""
    return math.ceil(beta * n - 1e-9)


class TrimmedMean:
    name = "trimmed_mean"
    kind = RuleKind.CHUNKED
    observes = False

    def __init__(self, beta: float) -> None:
        self.beta = beta

    def quorum_problem(self, n: int) -> str | None:
        k = trimmed(n, self.beta)
        if 2 * k < n:
            return None
        return (
            f"trimmed_mean with beta={self.beta} cuts ceil(beta x {n}) = {k} value(s) at each end of {n} "
            f"update(s), leaving nothing to average (it needs 2 x ceil(beta x n) < n)"
        )

    def observe(self, stack: np.ndarray) -> np.ndarray:
        raise NotImplementedError("the trimmed mean has no first pass")

    def selected(self, observed: np.ndarray | None, weights: np.ndarray) -> list[int]:
        return list(range(len(weights)))

    def combine(self, stack: np.ndarray, weights: np.ndarray) -> np.ndarray:
        n = stack.shape[0]
        k = trimmed(n, self.beta)
        return np.asarray(np.sort(stack, axis=0)[k : n - k].mean(axis=0))

"""Krum and Multi-Krum (Blanchard et al. 2017).

Each update is scored by the sum of its squared L2 distances to its ``n - f - 2`` nearest other
updates; the ``m`` updates with the lowest scores are averaged (weighted by ``num_samples`` x site
weight, as Flower's Multi-Krum). ``m = 1`` is Krum: the best update itself. Tolerates ``f``
arbitrary updates when ``n >= 2f + 3``.

The distances need every coordinate of every update: a first pass over the store's chunks adds up
each chunk's pairwise squared distances (a Gram matrix of the chunk's deviations from its mean,
float64, so no site x model array ever exists); the second pass reads only the chosen updates.
"""

from __future__ import annotations

import numpy as np

from flare_airflow.core.aggregation.strategies.base import RuleKind
from flare_airflow.core.aggregation.strategies.fedavg import weighted_mean


def krum_scores(distances: np.ndarray, f: int) -> np.ndarray:
    """Each update's score: the sum of its ``n - f - 2`` smallest squared distances to the others."""
    n = distances.shape[0]
    closest = max(1, n - f - 2)
    scores = np.empty(n, dtype=np.float64)
    for i in range(n):
        others = np.delete(distances[i], i)
        scores[i] = np.sort(others)[:closest].sum()
    return scores


def krum_select(distances: np.ndarray, f: int, m: int) -> list[int]:
    """The ``m`` lowest-scoring updates, in increasing index order (ties: the lower index wins)."""
    order = np.argsort(krum_scores(distances, f), kind="stable")
    return sorted(int(i) for i in order[:m])


class Krum:
    name = "krum"
    kind = RuleKind.CHUNKED
    observes = True

    def __init__(self, f: int, m: int = 1) -> None:
        self.f = f
        self.m = m

    def quorum_problem(self, n: int) -> str | None:
        if n < 2 * self.f + 3:
            return f"krum with f={self.f} needs n >= 2f + 3 = {2 * self.f + 3} valid updates, got {n}"
        if self.m > n - self.f:
            return f"krum with f={self.f} selects m={self.m} update(s), at most n - f = {n - self.f} of {n}"
        return None

    def observe(self, stack: np.ndarray) -> np.ndarray:
        """This chunk's pairwise squared distances (the engine adds them up over the chunks)."""
        # ||x_i - x_j||^2 = g_ii + g_jj - 2 g_ij over the rows' deviations from their mean (distances
        # do not change when every row moves by the same vector; centring keeps the Gram terms small).
        centred = stack - stack.mean(axis=0)
        gram = centred @ centred.T
        diag = np.diag(gram)
        return np.maximum(diag[:, None] + diag[None, :] - 2.0 * gram, 0.0)

    def selected(self, observed: np.ndarray | None, weights: np.ndarray) -> list[int]:
        if observed is None:
            raise ValueError("krum chooses its updates from their distances: observe() every chunk first")
        return krum_select(observed, self.f, self.m)

    def combine(self, stack: np.ndarray, weights: np.ndarray) -> np.ndarray:
        if stack.shape[0] == 1:
            return stack[0].copy()
        return weighted_mean(stack, weights)

"""FedAvg as a strategy rule: streaming (today's FedAvg, bitwise unchanged), and its chunked form.

The chunked form, a weighted mean of a float64 stack, is what the store engine uses when the job
bounds update norms: each update's norm must be known before it counts.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from flare_airflow.core.aggregation.strategies.base import RuleKind
from flare_airflow.core.aggregation.streaming import FedAvg
from flare_airflow.core.model import Params


def weighted_mean(stack: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """``sum(w_i * x_i) / sum(w_i)`` over the rows, added in row order (float64)."""
    acc = np.zeros(stack.shape[1:], dtype=np.float64)
    for row, w in zip(stack, weights, strict=True):
        acc += row * w
    return acc / float(sum(float(w) for w in weights))


class FedAvgRule:
    """Federated averaging weighted by ``num_samples`` x site weight."""

    name = "fedavg"
    kind = RuleKind.STREAMING
    observes = False

    def quorum_problem(self, n: int) -> str | None:
        return None if n >= 1 else "FedAvg needs at least 1 valid update"

    def start(self, global_params: Params, *, min_clients: int, site_weights: Mapping[str, float]) -> FedAvg:
        return FedAvg(global_params, min_clients=min_clients, site_weights=site_weights)

    # The chunked form (norm bounding).
    def observe(self, stack: np.ndarray) -> np.ndarray:
        raise NotImplementedError("FedAvg has no first pass")

    def selected(self, observed: np.ndarray | None, weights: np.ndarray) -> list[int]:
        return list(range(len(weights)))

    def combine(self, stack: np.ndarray, weights: np.ndarray) -> np.ndarray:
        return weighted_mean(stack, weights)

"""Norm bounding (Sun et al. 2019, "Can you really backdoor federated learning?"): before any rule,
each update's distance to the global model is capped at ``C`` in L2 norm.

An update ``u`` (as a full model) with ``||u - g|| > C`` counts as ``g + (u - g) * C / ||u - g||``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from flare_airflow.core.aggregation.accumulate import ACC_CHUNK


def update_norm(params: Mapping[str, np.ndarray], global_params: Mapping[str, np.ndarray], is_diff: bool) -> float:
    """``||u - g||`` in float64 (for a DIFF update, ``||u||``), a cache-sized piece at a time."""
    total = 0.0
    for name, arr in params.items():
        flat, glob = arr.reshape(-1), global_params[name].reshape(-1)
        for s in range(0, flat.size, ACC_CHUNK):
            delta = flat[s : s + ACC_CHUNK].astype(np.float64)
            if not is_diff:
                delta -= glob[s : s + ACC_CHUNK]
            total += float(np.dot(delta, delta))
    return math.sqrt(total)


def clip_factor(norm: float, bound: float) -> float:
    """What the update's deviation is multiplied by: 1 within the bound, ``bound / norm`` beyond it."""
    return 1.0 if norm <= bound else bound / norm

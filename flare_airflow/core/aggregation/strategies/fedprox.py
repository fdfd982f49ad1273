"""FedProx (Li et al. 2020) at the site: a proximal term keeps local training near the global model.

The trainer adds ``mu / 2 * ||w - w_global||^2`` to its loss; its gradient is ``mu * (w - w_global)``.
The server side is FedAvg. ``mu`` comes from the job (``aggregator: {name: fedprox, mu: ...}``)
through the Client API: ``flare.get_fedprox_mu()``. Pure numpy, no Airflow: usable in a site image.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

FEDPROX_MU_HPARAM = "fedprox_mu"
"""The hyper-parameter that carries ``mu`` to the trainers (a field of the trigger form, like any other)."""


def proximal_term(params: Mapping[str, np.ndarray], global_params: Mapping[str, np.ndarray], mu: float) -> float:
    """``mu / 2 * sum ||w - w_global||^2`` over the tensors (float64): add it to the local loss."""
    total = 0.0
    for name, w in params.items():
        diff = np.asarray(w, dtype=np.float64) - np.asarray(global_params[name], dtype=np.float64)
        total += float(np.dot(diff.reshape(-1), diff.reshape(-1)))
    return 0.5 * mu * total


def proximal_gradient(w: np.ndarray, global_w: np.ndarray, mu: float) -> np.ndarray:
    """The proximal term's gradient for one tensor, ``mu * (w - w_global)`` in ``w``'s dtype: add it
    to the loss gradient."""
    return (mu * (np.asarray(w, dtype=np.float64) - np.asarray(global_w, dtype=np.float64))).astype(w.dtype)

"""Server optimizers (Reddi et al. 2021, "Adaptive Federated Optimization"): a step after aggregation.

The rule's aggregate ``a`` and the previous global model ``x`` give the pseudo-gradient
``d = a - x``; the optimizer moves ``x`` along it with its own state:

- FedAvgM:    ``m = momentum * m + d``;                         ``x += eta * m``
- FedAdam:    ``m = b1 m + (1 - b1) d``, ``v = b2 v + (1 - b2) d^2``; ``x += eta * m / (sqrt(v) + tau)``
- FedYogi:    as FedAdam, with ``v = v - (1 - b2) d^2 sign(v - d^2)``
- FedAdagrad: ``m = b1 m + (1 - b1) d`` (``b1 = 0`` by default), ``v = v + d^2``; as FedAdam

No bias correction (the paper's Algorithm 2). Arithmetic in float64, a cache-sized piece at a time;
the moments are kept in the tensor's own dtype (float32 moments for a float32 model: half the store
traffic of float64). Tensors whose names match ``exclude`` (batch-norm statistics and the like),
and non-floating tensors, take the plain aggregate and keep no state.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

import numpy as np

from flare_airflow.core.accumulate import ACC_CHUNK
from flare_airflow.core.model import Params
from flare_airflow.core.strategies.base import StepContext, cast_back


class ServerOptimizer:
    """Base of the four: moment bookkeeping, exclusion, chunked float64 arithmetic."""

    name = ""
    slots: tuple[str, ...] = ()  # the state arrays per tensor

    def __init__(self, *, eta: float, exclude: Sequence[str] = ()) -> None:
        self.eta = eta
        self.exclude = tuple(exclude)

    def optimises(self, name: str, arr: np.ndarray) -> bool:
        return arr.dtype.kind == "f" and not any(fnmatch.fnmatchcase(name, pattern) for pattern in self.exclude)

    def update(self, d: np.ndarray, moments: list[np.ndarray]) -> np.ndarray:
        """The step for one piece: updates ``moments`` (float64) in place, returns the increment to ``x``."""
        raise NotImplementedError

    def apply(self, previous: Params, aggregate: Params, state: Params, context: StepContext) -> tuple[Params, Params]:
        out: Params = {}
        new_state: Params = {}
        for name, agg in aggregate.items():
            prev = previous[name]
            if not self.optimises(name, prev):
                out[name] = agg
                continue
            flat_prev, flat_agg = prev.reshape(-1), agg.reshape(-1)
            olds = [state.get(f"{slot}/{name}") for slot in self.slots]
            news = [np.empty(prev.shape, dtype=prev.dtype) for _ in self.slots]
            result = np.empty(prev.size, dtype=np.float64)
            for s in range(0, prev.size, ACC_CHUNK):
                e = min(s + ACC_CHUNK, prev.size)
                x = flat_prev[s:e].astype(np.float64)
                d = flat_agg[s:e].astype(np.float64) - x
                moments = [np.zeros(e - s) if old is None else old.reshape(-1)[s:e].astype(np.float64) for old in olds]
                result[s:e] = x + self.update(d, moments)
                for new, moment in zip(news, moments, strict=True):
                    new.reshape(-1)[s:e] = moment
            out[name] = cast_back(result, prev.dtype, name, ()).reshape(prev.shape)
            for slot, new in zip(self.slots, news, strict=True):
                new_state[f"{slot}/{name}"] = new
        return out, new_state


class FedAvgM(ServerOptimizer):
    name = "fedavgm"
    slots = ("momentum",)

    def __init__(self, *, eta: float = 1.0, momentum: float = 0.9, exclude: Sequence[str] = ()) -> None:
        super().__init__(eta=eta, exclude=exclude)
        self.momentum = momentum

    def update(self, d: np.ndarray, moments: list[np.ndarray]) -> np.ndarray:
        (m,) = moments
        m *= self.momentum
        m += d
        return self.eta * m


class _Adaptive(ServerOptimizer):
    slots = ("m", "v")

    def __init__(
        self,
        *,
        eta: float = 0.1,
        beta_1: float = 0.9,
        beta_2: float = 0.99,
        tau: float = 1e-3,
        exclude: Sequence[str] = (),
    ) -> None:
        super().__init__(eta=eta, exclude=exclude)
        self.beta_1, self.beta_2, self.tau = beta_1, beta_2, tau

    def second_moment(self, v: np.ndarray, d2: np.ndarray) -> None:
        raise NotImplementedError

    def update(self, d: np.ndarray, moments: list[np.ndarray]) -> np.ndarray:
        m, v = moments
        m *= self.beta_1
        m += (1.0 - self.beta_1) * d
        self.second_moment(v, d * d)
        return self.eta * m / (np.sqrt(v) + self.tau)


class FedAdam(_Adaptive):
    name = "fedadam"

    def second_moment(self, v: np.ndarray, d2: np.ndarray) -> None:
        v *= self.beta_2
        v += (1.0 - self.beta_2) * d2


class FedYogi(_Adaptive):
    name = "fedyogi"

    def second_moment(self, v: np.ndarray, d2: np.ndarray) -> None:
        v -= (1.0 - self.beta_2) * d2 * np.sign(v - d2)


class FedAdagrad(_Adaptive):
    name = "fedadagrad"

    def __init__(
        self, *, eta: float = 0.1, beta_1: float = 0.0, tau: float = 1e-3, exclude: Sequence[str] = ()
    ) -> None:
        super().__init__(eta=eta, beta_1=beta_1, beta_2=0.0, tau=tau, exclude=exclude)

    def second_moment(self, v: np.ndarray, d2: np.ndarray) -> None:
        v += d2

"""Server optimizers (Reddi et al. 2021, "Adaptive Federated Optimization"): a step after aggregation.

The rule's aggregate ``a`` and the previous global model ``x`` give the pseudo-gradient
``d = a - x``; the optimizer moves ``x`` along it with its own state:

- FedAvgM:    ``m = momentum * m + d``;                         ``x += eta * m``
- FedAdam:    ``m = b1 m + (1 - b1) d``, ``v = b2 v + (1 - b2) d^2``; ``x += eta * m / (sqrt(v) + tau)``
- FedYogi:    as FedAdam, with ``v = v - (1 - b2) d^2 sign(v - d^2)``
- FedAdagrad: ``m = b1 m + (1 - b1) d`` (``b1 = 0`` by default), ``v = v + d^2``; as FedAdam

No bias correction (the paper's Algorithm 2). Arithmetic in float64, a cache-sized piece at a time,
in place in a few reused scratch buffers (numpy ``out=``): no temporary of the model's size; the
moments are kept in the tensor's own dtype (float32 moments for a float32 model: half the store
traffic of float64). Tensors whose names match ``exclude`` (batch-norm statistics and the like),
and non-floating tensors, take the plain aggregate and keep no state.

The step has two drivers with one arithmetic (:meth:`ServerOptimizer.pieces`): :meth:`apply` (a
pure function of whole arrays, after any rule) and FedAvg's result pass, which hands each piece of
its aggregate to the step while it is still in the CPU cache (the store engine fuses the two when
the rule is FedAvg) -- bitwise the same model and state either way.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

import numpy as np

from flare_airflow.core.aggregation.accumulate import ACC_CHUNK
from flare_airflow.core.aggregation.strategies.base import StepContext, cast_back
from flare_airflow.core.errors import FlareAirflowError
from flare_airflow.core.model import Params
from flare_airflow.core.tensors import is_float


class ServerOptimizer:
    """Base of the four: moment bookkeeping, exclusion, chunked float64 arithmetic."""

    name = ""
    slots: tuple[str, ...] = ()  # the state arrays per tensor

    def __init__(self, *, eta: float, exclude: Sequence[str] = ()) -> None:
        self.eta = eta
        self.exclude = tuple(exclude)

    def optimises(self, name: str, arr: np.ndarray) -> bool:
        return is_float(arr.dtype) and not any(fnmatch.fnmatchcase(name, pattern) for pattern in self.exclude)

    def update(self, d: np.ndarray, moments: list[np.ndarray], t: np.ndarray) -> None:
        """The step for one piece, in place: ``d`` (float64) holds the pseudo-gradient on entry and the
        increment to ``x`` on return; ``moments`` (float64) are updated; ``t`` is scratch."""
        raise NotImplementedError

    def pieces(self, previous: Params, state: Params, *, in_place: bool) -> StepPieces:
        """The step, a piece at a time, for a pass that produces the aggregate piece by piece.

        ``in_place``: the new moments are written over ``state``'s arrays (where writable): the
        caller hands them over and must not use them again. Otherwise ``state`` is left untouched.
        """
        return StepPieces(self, previous, state, in_place=in_place)

    def apply(self, previous: Params, aggregate: Params, state: Params, context: StepContext) -> tuple[Params, Params]:
        step = self.pieces(previous, state, in_place=False)
        out: Params = {}
        for name, agg in aggregate.items():
            prev = previous[name]
            if not step.touches(name):
                out[name] = agg
                continue
            result = np.empty(prev.shape, dtype=prev.dtype)
            flat_agg, flat = agg.reshape(-1), result.reshape(-1)
            for s in range(0, prev.size, ACC_CHUNK):
                e = min(s + ACC_CHUNK, prev.size)
                flat[s:e] = cast_back(step.piece(name, s, e, flat_agg[s:e]), prev.dtype, name, ())
            out[name] = result
        return out, step.state()


class StepPieces:
    """One round of a server optimizer's step, fed a piece of the aggregate at a time (any order)."""

    def __init__(self, optimizer: ServerOptimizer, previous: Params, state: Params, *, in_place: bool) -> None:
        self.optimizer = optimizer
        self.previous = previous
        self._old: dict[str, list[np.ndarray | None]] = {}
        self._new: dict[str, list[np.ndarray]] = {}
        for name, prev in previous.items():
            if not optimizer.optimises(name, prev):
                continue
            olds = [state.get(f"{slot}/{name}") for slot in optimizer.slots]
            for slot, old in zip(optimizer.slots, olds, strict=True):
                if old is not None and old.shape != prev.shape:
                    raise FlareAirflowError(
                        f"the server state's {optimizer.name} {slot!r} of tensor {name!r} has shape {old.shape}, "
                        f"the global model's tensor has {prev.shape}: the state belongs to another model; resume "
                        "the run from the round whose state matches (or from round 1)"
                    )
            self._old[name] = olds
            self._new[name] = [
                old
                if in_place and old is not None and old.flags.writeable and old.dtype == prev.dtype
                else np.empty(prev.shape, dtype=prev.dtype)
                for old in olds
            ]
        n = ACC_CHUNK
        self._d, self._t = np.empty(n), np.empty(n)
        self._moments = [np.empty(n) for _ in optimizer.slots]

    def touches(self, name: str) -> bool:
        return name in self._new

    def piece(self, name: str, s: int, e: int, aggregate: np.ndarray) -> np.ndarray:
        """The new global model's elements [s, e) of tensor ``name`` (float64, a scratch buffer valid
        until the next call) from the same elements of the aggregate (in the tensor's dtype); the
        moments' elements [s, e) are updated. ``e - s`` is at most ``ACC_CHUNK``."""
        n = e - s
        x = self.previous[name].reshape(-1)[s:e]
        d, t = self._d[:n], self._t[:n]
        np.subtract(aggregate, x, out=d, dtype=np.float64)  # float64(a) - float64(x)
        moments = [m[:n] for m in self._moments]
        for moment, old in zip(moments, self._old[name], strict=True):
            if old is None:
                moment.fill(0.0)
            else:
                np.copyto(moment, old.reshape(-1)[s:e])
        self.optimizer.update(d, moments, t)
        np.add(x, d, out=d)  # x + increment, in float64
        for moment, new in zip(moments, self._new[name], strict=True):
            np.copyto(new.reshape(-1)[s:e], moment, casting="same_kind")
        return d

    def state(self) -> Params:
        """The whole next state, once every piece went through :meth:`piece`."""
        return {
            f"{slot}/{name}": new
            for name, news in self._new.items()
            for slot, new in zip(self.optimizer.slots, news, strict=True)
        }


class FedAvgM(ServerOptimizer):
    name = "fedavgm"
    slots = ("momentum",)

    def __init__(self, *, eta: float = 1.0, momentum: float = 0.9, exclude: Sequence[str] = ()) -> None:
        super().__init__(eta=eta, exclude=exclude)
        self.momentum = momentum

    def update(self, d: np.ndarray, moments: list[np.ndarray], t: np.ndarray) -> None:
        (m,) = moments
        m *= self.momentum
        m += d
        np.multiply(m, self.eta, out=d)


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

    def second_moment(self, v: np.ndarray, d2: np.ndarray, t: np.ndarray) -> None:
        """Update ``v`` from ``d2`` (the squared pseudo-gradient, which it may overwrite); ``t`` is scratch."""
        raise NotImplementedError

    def update(self, d: np.ndarray, moments: list[np.ndarray], t: np.ndarray) -> None:
        m, v = moments
        np.multiply(d, 1.0 - self.beta_1, out=t)
        m *= self.beta_1
        m += t
        np.multiply(d, d, out=d)
        self.second_moment(v, d, t)
        np.sqrt(v, out=t)
        t += self.tau
        np.multiply(m, self.eta, out=d)
        d /= t  # eta * m / (sqrt(v) + tau)


class FedAdam(_Adaptive):
    name = "fedadam"

    def second_moment(self, v: np.ndarray, d2: np.ndarray, t: np.ndarray) -> None:
        v *= self.beta_2
        np.multiply(d2, 1.0 - self.beta_2, out=t)
        v += t


class FedYogi(_Adaptive):
    name = "fedyogi"

    def second_moment(self, v: np.ndarray, d2: np.ndarray, t: np.ndarray) -> None:
        np.subtract(v, d2, out=t)
        np.sign(t, out=t)
        d2 *= 1.0 - self.beta_2
        d2 *= t
        v -= d2  # v - (1 - b2) d^2 sign(v - d^2)


class FedAdagrad(_Adaptive):
    name = "fedadagrad"

    def __init__(
        self, *, eta: float = 0.1, beta_1: float = 0.0, tau: float = 1e-3, exclude: Sequence[str] = ()
    ) -> None:
        super().__init__(eta=eta, beta_1=beta_1, beta_2=0.0, tau=tau, exclude=exclude)

    def second_moment(self, v: np.ndarray, d2: np.ndarray, t: np.ndarray) -> None:
        v += d2

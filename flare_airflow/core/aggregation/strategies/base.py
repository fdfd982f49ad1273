"""The strategy seam: an aggregation rule, then post-aggregation steps, behind small protocols.

A round's new global model is ``steps(rule(updates))``:

- the **rule** combines the round's valid updates. It either *streams* them (:class:`StreamingRule`:
  one update at a time into an accumulator -- FedAvg) or *needs every update per coordinate chunk*
  (:class:`ChunkRule`: median, trimmed mean, Krum). The store engine
  (:mod:`flare_airflow.core.aggregation.engine`) feeds either kind with verified reads; a chunk rule
  sees a float64 ``(updates, chunk)`` stack at a time, so memory stays about sites x chunk.
- each **step** (:class:`PostStep`) turns the previous global model and the rule's aggregate into
  the next global model, with server state carried from round to round (a server optimizer's
  moments; later, a privacy accountant). The engine keeps that state in the model store per round,
  verified like a model, so a retried or resumed aggregation starts from exactly that round's state.

Pure numpy: no Airflow, no I/O here.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from flare_airflow.core.errors import AggregateNotFinite
from flare_airflow.core.model import Params
from flare_airflow.core.tensors import is_inexact

if TYPE_CHECKING:
    from flare_airflow.core.aggregation.tally import RoundOutcome
    from flare_airflow.core.errors import UpdateRejected
    from flare_airflow.core.model import ArtifactRecord


class RuleKind(enum.StrEnum):
    """How a rule consumes the round's updates."""

    STREAMING = "streaming"  # one update at a time (FedAvg): memory independent of the number of sites
    CHUNKED = "chunked"  # all updates, one coordinate chunk at a time (median, trimmed mean, Krum)


class Accumulator(Protocol):
    """What a streaming rule's round object does (:class:`flare_airflow.core.aggregation.streaming.FedAvg` is one)."""

    def reject(self, site: str, reason: str) -> None: ...

    def add_verified(
        self, group: Sequence[tuple[str, Params, ArtifactRecord, UpdateRejected | None]], run: object = ...
    ) -> None: ...

    def result(self) -> RoundOutcome: ...


@runtime_checkable
class StreamingRule(Protocol):
    """A rule that folds updates in one at a time."""

    name: str
    kind: RuleKind  # RuleKind.STREAMING

    def quorum_problem(self, n: int) -> str | None:
        """Why ``n`` valid updates are too few for this rule, or ``None`` when they are enough."""
        ...

    def start(self, global_params: Params, *, min_clients: int, site_weights: Mapping[str, float]) -> Accumulator:
        """A fresh accumulator for one round."""
        ...


@runtime_checkable
class ChunkRule(Protocol):
    """A rule that needs every update of the round, a coordinate chunk at a time.

    The engine hands it ``stack``: float64, shape ``(updates, chunk)``, one row per valid update in
    site order, each row the update as a full model (a DIFF added to the global model; clipped when
    the job bounds update norms). ``weights`` are the updates' ``num_samples`` x site weight.
    """

    name: str
    kind: RuleKind  # RuleKind.CHUNKED
    observes: bool  # True: a first pass over every chunk (observe) before the rows are chosen (Krum)

    def quorum_problem(self, n: int) -> str | None: ...

    def observe(self, stack: np.ndarray) -> np.ndarray:
        """First pass (only when ``observes``): what one chunk of every update says; the engine sums
        the answers over the chunks (Krum: pairwise squared distances)."""
        ...

    def selected(self, observed: np.ndarray | None, weights: np.ndarray) -> list[int]:
        """The rows (in increasing order) the combination uses, from the first pass's sum; all rows
        for a rule without one."""
        ...

    def combine(self, stack: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """The aggregate of one chunk (float64, shape ``(chunk,)``) from the selected rows."""
        ...


Rule = StreamingRule | ChunkRule


@dataclass(frozen=True)
class StepContext:
    """Where a post-aggregation step runs: keys for anything that must be the same on a retry
    (e.g. noise keyed to the run and round)."""

    job: str
    run_id: str
    round: int


@runtime_checkable
class PostStep(Protocol):
    """A step after the rule: ``(previous global, aggregate, state) -> (next global, next state)``.

    A server optimizer is one (NVFlare's shape: the optimizer runs on the aggregate, it is not
    another aggregator); central differential privacy can be another. ``state`` holds this step's
    arrays from the previous round (empty in round 1); the step returns the whole next state. It
    must be a pure function of its inputs: a retry recomputes the same bytes.
    """

    name: str

    def apply(
        self, previous: Params, aggregate: Params, state: Params, context: StepContext
    ) -> tuple[Params, Params]: ...


@dataclass(frozen=True)
class Strategy:
    """A job's aggregation: a rule, optional norm bounding before it, post-aggregation steps after it."""

    rule: Rule
    steps: tuple[PostStep, ...] = ()
    norm_bound: float | None = None  # cap on each update's L2 distance to the global model, before the rule
    fedprox_mu: float | None = None  # FedProx: handed to the trainers; the server side is the rule

    @property
    def name(self) -> str:
        return self.steps[0].name if self.steps else self.rule.name

    @property
    def stateful(self) -> bool:
        return bool(self.steps)

    def quorum_problem(self, n: int) -> str | None:
        return self.rule.quorum_problem(n)

    def streams(self) -> bool:
        """Whether the store engine may stream (norm bounding needs each update's norm first)."""
        return self.rule.kind is RuleKind.STREAMING and self.norm_bound is None


def cast_back(values: np.ndarray, dtype: np.dtype, name: str, sites: Sequence[str]) -> np.ndarray:
    """``values`` (float64) in the global model's dtype: integers rounded and range-checked, floats
    checked to stay finite -- as FedAvg casts its mean."""
    if dtype.kind in "iu":
        values = np.rint(values)
        info = np.iinfo(dtype)
        if values.size and (values.min() < info.min or values.max() > info.max):
            raise _not_finite(name, sites, f"its aggregate leaves the range of {dtype}")
    with np.errstate(over="ignore", invalid="ignore"):  # checked just below
        out = values.astype(dtype)
    if is_inexact(dtype) and not np.isfinite(out).all():
        raise _not_finite(name, sites, f"its aggregate is not finite in {dtype} (overflow)")
    return out


def _not_finite(name: str, sites: Sequence[str], why: str) -> AggregateNotFinite:
    return AggregateNotFinite(
        f"the aggregate of sites {sorted(sites)} is unusable: tensor {name!r}: {why}. "
        "The global model was not updated; check the sites' updates and weights (num_samples, weight)."
    )

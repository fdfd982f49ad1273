"""The job's ``aggregator``: which strategy combines the round's updates, and its parameters.

One flat mapping: ``name`` picks the strategy, the other keys are its parameters (each strategy
takes only its own; a parameter of another strategy is refused by name). ``norm_bound`` applies to
every strategy. The quorum a strategy needs is checked against ``min_clients`` when the job is
loaded (:meth:`AggregatorSpec.quorum_problem`) and again at aggregation.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from flare_airflow.core.config.describe import short_repr
from flare_airflow.core.config.validators import Strict, no_nul
from flare_airflow.core.strategies import (
    FedAdagrad,
    FedAdam,
    FedAvgM,
    FedAvgRule,
    FedYogi,
    Krum,
    Median,
    PostStep,
    Strategy,
    TrimmedMean,
)

StrategyName = Literal[
    "fedavg", "fedprox", "fedavgm", "fedadam", "fedyogi", "fedadagrad", "median", "trimmed_mean", "krum"
]

# Each strategy's own parameters (norm_bound is everyone's).
PARAMETERS: dict[str, tuple[str, ...]] = {
    "fedavg": (),
    "fedprox": ("mu",),
    "fedavgm": ("eta", "momentum", "exclude"),
    "fedadam": ("eta", "beta_1", "beta_2", "tau", "exclude"),
    "fedyogi": ("eta", "beta_1", "beta_2", "tau", "exclude"),
    "fedadagrad": ("eta", "beta_1", "tau", "exclude"),
    "median": (),
    "trimmed_mean": ("beta",),
    "krum": ("f", "m"),
}
REQUIRED: dict[str, tuple[str, ...]] = {"trimmed_mean": ("beta",), "krum": ("f",)}
_HINT = {
    "beta": "the share of values cut at each end, 0 <= beta < 0.5",
    "f": "the number of hostile updates to tolerate, an integer >= 0",
}


class AggregatorSpec(Strict):
    """``aggregator:`` in the job file."""

    name: StrategyName = Field("fedavg", description="the strategy (see docs/strategies.md)")
    norm_bound: float | None = Field(
        None, gt=0, le=1e12, description="cap on each update's L2 distance to the global model, before the rule"
    )
    mu: float | None = Field(None, ge=0, le=1e6, description="fedprox: the proximal term's weight (default 0.01)")
    eta: float | None = Field(None, gt=0, le=1e6, description="server optimizers: the server learning rate")
    momentum: float | None = Field(None, ge=0, lt=1, description="fedavgm: momentum (default 0.9)")
    beta_1: float | None = Field(None, ge=0, lt=1, description="fedadam/fedyogi/fedadagrad: first-moment decay")
    beta_2: float | None = Field(None, ge=0, lt=1, description="fedadam/fedyogi: second-moment decay (default 0.99)")
    tau: float | None = Field(None, gt=0, le=1e6, description="adaptive optimizers: the adaptivity (default 1e-3)")
    exclude: list[str] | None = Field(
        None, description="server optimizers: tensor names (glob patterns) that take the plain aggregate"
    )
    beta: float | None = Field(None, ge=0, lt=0.5, description="trimmed_mean: the share cut at each end")
    f: int | None = Field(None, ge=0, le=10_000, description="krum: hostile updates tolerated (n >= 2f + 3)")
    m: int | None = Field(None, ge=1, le=10_000, description="krum: updates averaged (1: Krum; more: Multi-Krum)")

    @field_validator("exclude")
    @classmethod
    def _exclude(cls, value: list[str] | None) -> list[str] | None:
        for pattern in value or ():
            if not pattern.strip():
                raise ValueError("patterns must not be empty (e.g. '*running_mean', 'bn.*')")
            no_nul(pattern, "aggregator.exclude")
        return value

    @model_validator(mode="after")
    def _own_parameters(self) -> AggregatorSpec:
        own = PARAMETERS[self.name]
        given = [k for k in PARAMETERS_ALL if getattr(self, k) is not None]
        foreign = [k for k in given if k not in own]
        if foreign:
            users = sorted({n for n, ps in PARAMETERS.items() if foreign[0] in ps})
            takes = ", ".join((*own, "norm_bound"))
            raise ValueError(
                f"aggregator: {foreign[0]!r} is not a parameter of {self.name!r} (it belongs to "
                f"{', '.join(users)}); {self.name} takes {takes}"
            )
        for key in REQUIRED.get(self.name, ()):
            if getattr(self, key) is None:
                raise ValueError(f"aggregator: {self.name} needs {key!r} ({_HINT[key]})")
        return self

    def strategy(self) -> Strategy:
        """The strategy object the store engine runs."""
        exclude = tuple(self.exclude or ())
        steps: tuple[PostStep, ...] = ()
        rule: Any = FedAvgRule()
        adaptive = {k: v for k, v in (("eta", self.eta), ("beta_1", self.beta_1), ("tau", self.tau)) if v is not None}
        if self.name == "fedavgm":
            opts = {k: v for k, v in (("eta", self.eta), ("momentum", self.momentum)) if v is not None}
            steps = (FedAvgM(exclude=exclude, **opts),)
        elif self.name in ("fedadam", "fedyogi"):
            cls = FedAdam if self.name == "fedadam" else FedYogi
            extra = {"beta_2": self.beta_2} if self.beta_2 is not None else {}
            steps = (cls(exclude=exclude, **adaptive, **extra),)
        elif self.name == "fedadagrad":
            steps = (FedAdagrad(exclude=exclude, **adaptive),)
        elif self.name == "median":
            rule = Median()
        elif self.name == "trimmed_mean":
            rule = TrimmedMean(beta=float(self.beta or 0.0))
        elif self.name == "krum":
            rule = Krum(f=int(self.f or 0), m=self.m or 1)
        mu = (0.01 if self.mu is None else self.mu) if self.name == "fedprox" else None
        return Strategy(rule=rule, steps=steps, norm_bound=self.norm_bound, fedprox_mu=mu)

    def quorum_problem(self, min_clients: int, sites: int) -> str | None:
        """Why a round counting from ``min_clients`` up to ``sites`` updates could not run this rule."""
        strategy = self.strategy()
        for n in range(min_clients, sites + 1):
            problem = strategy.quorum_problem(n)
            if problem is not None:
                fewest = "" if n == min_clients else f" (a round may count any number from {min_clients} to {sites})"
                return (
                    f"aggregator: {problem}{fewest}; raise min_clients, add sites or change the aggregator's parameters"
                )
        return None


PARAMETERS_ALL = ("mu", "eta", "momentum", "beta_1", "beta_2", "tau", "exclude", "beta", "f", "m")


def check_hparams_free(hparams: dict[str, Any], key: str) -> None:
    """FedProx's ``mu`` travels as hyper-parameter ``key``: the trainer's own hparams must not set it."""
    if key in hparams:
        raise ValueError(
            f"trainer.hparams.{key} is {short_repr(hparams[key])}, but with aggregator fedprox it comes from "
            "aggregator.mu: set mu there and remove the hyper-parameter"
        )

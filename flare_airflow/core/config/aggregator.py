"""The job's ``aggregator``: which strategy combines the round's updates, and its parameters.

One class per strategy, told apart by ``name`` (a discriminated union, as the privacy filters are):
each class holds only its own parameters and builds its own :class:`Strategy`, so adding a strategy
is its module in ``core/aggregation/strategies/``, its class here (added to :data:`AggregatorSpec`), its docs
and its tests -- nothing chooses a strategy by comparing names. ``norm_bound`` applies to every
strategy. The quorum a strategy needs is checked against ``min_clients`` when the job is loaded
(:meth:`StrategySpec.quorum_problem`) and again at aggregation.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, Field, TypeAdapter, field_validator, model_validator

from flare_airflow.core.aggregation.strategies import (
    FEDPROX_MU_HPARAM,
    FedAdagrad,
    FedAdam,
    FedAvgM,
    FedAvgRule,
    FedYogi,
    FfaLoraRule,
    Krum,
    Median,
    PostStep,
    Rule,
    Strategy,
    TrimmedMean,
)
from flare_airflow.core.config.describe import short_repr
from flare_airflow.core.config.validators import Strict, no_nul


class StrategySpec(Strict):
    """What every strategy's block has: its ``name`` and ``norm_bound``."""

    label: ClassVar[str]  # how pages and summaries name the strategy
    name: str
    norm_bound: float | None = Field(
        None, gt=0, le=1e12, description="cap on each update's L2 distance to the global model, before the rule"
    )

    def rule(self) -> Rule:
        return FedAvgRule()

    def steps(self) -> tuple[PostStep, ...]:
        return ()

    def fedprox_mu(self) -> float | None:
        return None

    @classmethod
    def trainer_hparams(cls, block: Mapping[str, Any]) -> dict[str, tuple[str, float]]:
        """Hyper-parameters the strategy hands the trainers -- ``{hparam: (its field here, value)}`` --
        read from its raw ``aggregator`` block (before validation, so that they are fields of the
        trigger form like any other)."""
        return {}

    def excluded(self) -> tuple[str, ...]:
        """Tensor names (glob patterns) a server optimizer leaves to the plain aggregate."""
        return ()

    def frozen(self) -> tuple[str, ...]:
        """Tensor names (glob patterns) the trainers must leave as received (FFA-LoRA's A matrices)."""
        return ()

    def strategy(self) -> Strategy:
        """The strategy object the store engine runs."""
        return Strategy(rule=self.rule(), steps=self.steps(), norm_bound=self.norm_bound, fedprox_mu=self.fedprox_mu())

    def parameters(self) -> dict[str, Any]:
        """The parameters the job set (not the defaults), for summaries and pages."""
        return {k: v for k, v in self.model_dump(exclude={"name"}).items() if v is not None}

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


def _given(spec: StrategySpec, *keys: str) -> dict[str, Any]:
    """The keyword arguments the job set: a strategy's own defaults apply to the rest."""
    return {k: getattr(spec, k) for k in keys if getattr(spec, k) is not None}


class FedAvgSpec(StrategySpec):
    """FedAvg: the mean of the updates weighted by their samples (x site weights)."""

    label = "FedAvg"
    name: Literal["fedavg"] = "fedavg"


class FedProxSpec(StrategySpec):
    """FedProx: FedAvg at the server; ``mu`` reaches the trainers as their proximal term's weight."""

    label = "FedProx"
    name: Literal["fedprox"]
    mu: float | None = Field(None, ge=0, le=1e6, description="the proximal term's weight (default 0.01)")

    def fedprox_mu(self) -> float | None:
        return 0.01 if self.mu is None else self.mu

    @classmethod
    def trainer_hparams(cls, block: Mapping[str, Any]) -> dict[str, tuple[str, float]]:
        # the Client API's get_fedprox_mu(); a malformed mu is left to the field's own validation
        mu = block.get("mu", 0.01)
        valid = isinstance(mu, int | float) and not isinstance(mu, bool)
        return {FEDPROX_MU_HPARAM: ("mu", float(mu))} if valid else {}


class _ServerOptimizerSpec(StrategySpec):
    eta: float | None = Field(None, gt=0, le=1e6, description="the server learning rate")
    exclude: list[str] | None = Field(None, description="tensor names (glob patterns) that take the plain aggregate")

    @field_validator("exclude")
    @classmethod
    def _exclude(cls, value: list[str] | None) -> list[str] | None:
        for pattern in value or ():
            if not pattern.strip():
                raise ValueError("patterns must not be empty (e.g. '*running_mean', 'bn.*')")
            no_nul(pattern, "aggregator.exclude")
        return value

    def excluded(self) -> tuple[str, ...]:
        return tuple(self.exclude or ())


class FedAvgMSpec(_ServerOptimizerSpec):
    """FedAvgM: server momentum after FedAvg."""

    label = "FedAvgM"
    name: Literal["fedavgm"]
    momentum: float | None = Field(None, ge=0, lt=1, description="momentum (default 0.9)")

    def steps(self) -> tuple[PostStep, ...]:
        return (FedAvgM(exclude=self.excluded(), **_given(self, "eta", "momentum")),)


class _AdaptiveSpec(_ServerOptimizerSpec):
    beta_1: float | None = Field(None, ge=0, lt=1, description="first-moment decay")
    tau: float | None = Field(None, gt=0, le=1e6, description="the adaptivity (default 1e-3)")


class FedAdamSpec(_AdaptiveSpec):
    """FedAdam (Reddi et al. 2021) after FedAvg."""

    label = "FedAdam"
    name: Literal["fedadam"]
    beta_2: float | None = Field(None, ge=0, lt=1, description="second-moment decay (default 0.99)")

    def steps(self) -> tuple[PostStep, ...]:
        return (FedAdam(exclude=self.excluded(), **_given(self, "eta", "beta_1", "beta_2", "tau")),)


class FedYogiSpec(_AdaptiveSpec):
    """FedYogi (Reddi et al. 2021) after FedAvg."""

    label = "FedYogi"
    name: Literal["fedyogi"]
    beta_2: float | None = Field(None, ge=0, lt=1, description="second-moment decay (default 0.99)")

    def steps(self) -> tuple[PostStep, ...]:
        return (FedYogi(exclude=self.excluded(), **_given(self, "eta", "beta_1", "beta_2", "tau")),)


class FedAdagradSpec(_AdaptiveSpec):
    """FedAdagrad (Reddi et al. 2021) after FedAvg: sums squared steps, no second-moment decay."""

    label = "FedAdagrad"
    name: Literal["fedadagrad"]

    def steps(self) -> tuple[PostStep, ...]:
        return (FedAdagrad(exclude=self.excluded(), **_given(self, "eta", "beta_1", "tau")),)


class MedianSpec(StrategySpec):
    """The coordinate-wise median of the updates."""

    label = "median"
    name: Literal["median"]

    def rule(self) -> Rule:
        return Median()


class TrimmedMeanSpec(StrategySpec):
    """The coordinate-wise mean after cutting ``beta`` of the values at each end."""

    label = "trimmed mean"
    name: Literal["trimmed_mean"]
    beta: float = Field(ge=0, lt=0.5, description="the share of values cut at each end, 0 <= beta < 0.5")

    def rule(self) -> Rule:
        return TrimmedMean(beta=self.beta)


class KrumSpec(StrategySpec):
    """(Multi-)Krum: the ``m`` updates closest to their neighbours, averaged."""

    label = "Krum"
    name: Literal["krum"]
    f: int = Field(ge=0, le=10_000, description="the number of hostile updates to tolerate, an integer >= 0")
    m: int = Field(1, ge=1, le=10_000, description="updates averaged (1: Krum; more: Multi-Krum)")

    def rule(self) -> Rule:
        return Krum(f=self.f, m=self.m)


class FfaLoraSpec(StrategySpec):
    """FFA-LoRA (Sun et al., ICLR 2024): LoRA's A matrices frozen at the shared initialisation, only B
    trained and averaged -- the exact aggregate of the sites' weight changes (docs/llm.md)."""

    label = "FFA-LoRA"
    name: Literal["ffa_lora"]
    freeze: list[str] | None = Field(
        None, description="tensor names (glob patterns) kept frozen (default ['*lora_A*'], PEFT's A matrices)"
    )

    @field_validator("freeze")
    @classmethod
    def _freeze(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and not value:
            raise ValueError("name at least one pattern (default ['*lora_A*'])")
        for pattern in value or ():
            if not pattern.strip():
                raise ValueError("patterns must not be empty (e.g. '*lora_A*')")
            no_nul(pattern, "aggregator.freeze")
        return value

    @model_validator(mode="after")
    def _no_norm_bound(self) -> FfaLoraSpec:
        if self.norm_bound is not None:
            raise ValueError(
                "norm_bound is not available with ffa_lora (its chunked form would average the frozen tensors "
                "too); bound updates at the sites instead (privacy filters: clip)"
            )
        return self

    def frozen(self) -> tuple[str, ...]:
        return tuple(self.freeze) if self.freeze else FfaLoraRule().frozen

    def rule(self) -> Rule:
        return FfaLoraRule(self.frozen())


def _foreign_parameters(data: Any) -> Any:
    """Before the union picks a class: a parameter of *another* strategy, or a missing required one,
    is named with the strategies it belongs to (pydantic alone would say only "unknown key")."""
    if not isinstance(data, Mapping):
        return data
    spec = STRATEGIES.get(data.get("name", "fedavg")) if isinstance(data.get("name", "fedavg"), str) else None
    if spec is None:
        return data  # the union's own message lists the strategies
    name = spec.model_fields["name"].default if "name" not in data else data["name"]
    own = _own_parameters(spec)
    for key in data:
        users = sorted(n for n, s in STRATEGIES.items() if key in _own_parameters(s))
        if key not in own and key != "name" and users:
            takes = ", ".join(own)
            raise ValueError(
                f"{key!r} is not a parameter of {name!r} (it belongs to {', '.join(users)}); {name} takes {takes}"
            )
    for key, field in spec.model_fields.items():
        if field.is_required() and key not in data and key != "name":
            raise ValueError(f"{name} needs {key!r} ({field.description})")
    return {"name": name, **data}


def _own_parameters(spec: type[StrategySpec]) -> list[str]:
    """A strategy's parameters, its own first, ``norm_bound`` (everyone's) last."""
    return [k for k in spec.model_fields if k not in ("name", "norm_bound")] + ["norm_bound"]


AggregatorSpec = Annotated[
    FedAvgSpec
    | FedProxSpec
    | FedAvgMSpec
    | FedAdamSpec
    | FedYogiSpec
    | FedAdagradSpec
    | MedianSpec
    | TrimmedMeanSpec
    | KrumSpec
    | FfaLoraSpec,
    Field(discriminator="name"),
    BeforeValidator(_foreign_parameters),
]

# The registry: every strategy by its name, read off the union (one place to add a strategy).
STRATEGIES: dict[str, type[StrategySpec]] = {
    typing.get_args(member.model_fields["name"].annotation)[0]: member
    for member in typing.get_args(typing.get_args(AggregatorSpec)[0])
}

_ADAPTER: TypeAdapter[StrategySpec] = TypeAdapter(AggregatorSpec)


def aggregator_spec(data: Mapping[str, Any] | None = None) -> StrategySpec:
    """The aggregator block ``data`` (``{}``/``None``: FedAvg), validated."""
    return _ADAPTER.validate_python(dict(data or {}))


def strategy_hparams_to_trainer(data: dict[str, Any]) -> None:
    """The hyper-parameters the job's strategy hands its trainers (FedProx's ``mu`` as
    ``fedprox_mu``) join ``trainer.hparams`` of the raw job ``data``; the trainer's own may not set them."""
    agg, trainer = data.get("aggregator"), data.get("trainer")
    name = agg.get("name") if isinstance(agg, Mapping) else None
    spec = STRATEGIES.get(name) if isinstance(name, str) else None
    if spec is None or not isinstance(agg, Mapping) or not isinstance(trainer, Mapping):
        return
    given = spec.trainer_hparams(agg)
    hparams = trainer.get("hparams", {})
    if not given or not isinstance(hparams, Mapping):
        return  # the fields' own validation names what is wrong
    for key, (field, _) in given.items():
        if key in hparams:
            raise ValueError(
                f"trainer.hparams.{key} is {short_repr(hparams[key])}, but with aggregator {name} it comes from "
                f"aggregator.{field}: set {field} there and remove the hyper-parameter"
            )
    ranges = trainer.get("hparam_ranges") or {}
    if not isinstance(ranges, Mapping):
        return
    # Each one keeps its field's bounds as the form's range (narrowed by the job's own range for it):
    # prepare refuses a run's value outside them before any site trains (never mu = 1e300 or -5).
    bounds = {key: field_range(spec, field, ranges.get(key)) for key, (field, _) in given.items()}
    data["trainer"] = {
        **trainer,
        "hparams": {**hparams, **{k: v for k, (_, v) in given.items()}},
        "hparam_ranges": {**ranges, **bounds},
    }


def field_range(spec: type[StrategySpec], field: str, job_range: Any) -> dict[str, float]:
    """The bounds of ``spec``'s numeric ``field`` (its ``ge``/``gt``/``le``/``lt``) as a hyper-parameter
    range ``{min, max}`` (inclusive, as the form's: a ``gt`` bound becomes the minimum), narrowed by the
    job's own ``trainer.hparam_ranges`` entry ``job_range``."""
    bounds: dict[str, float] = {}
    for item in spec.model_fields[field].metadata:
        for attr, key in (("ge", "min"), ("gt", "min"), ("le", "max"), ("lt", "max")):
            value = getattr(item, attr, None)
            if isinstance(value, int | float):
                bounds[key] = float(value)
    given = job_range if isinstance(job_range, Mapping) else {}
    for key, pick in (("min", max), ("max", min)):
        value = given.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            bounds[key] = pick(bounds[key], float(value)) if key in bounds else float(value)
    return bounds

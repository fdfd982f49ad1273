"""Privacy settings: the site's (site policy, or the job file's per-site block without one) and the job's.

A site's ``privacy`` block is the site admin's: its filters run at the site on every update
before it leaves, and what it declares public is all that leaves besides the filtered float
tensors. With a site policy on the worker, the policy's block is the site's and the job file's
per-site ``privacy`` is not used (like ``launcher_spec``). The job's top-level ``privacy`` may add
filters at every site -- of the types the site allows -- but never remove one, and may not make
public what the site keeps home. :func:`site_privacy_plan` turns both into the plan the site task
applies (:class:`~flare_airflow.core.privacy.plan.PrivacyPlan`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field, field_validator, model_validator

from flare_airflow.core.config.filters import FilterSpec, FilterType, all_filter_types
from flare_airflow.core.config.validators import Strict, is_real_number, positive_number
from flare_airflow.core.errors import ConfigError
from flare_airflow.core.privacy.accountant import epsilon_after, noise_multiplier_for, rounds_within_budget
from flare_airflow.core.privacy.plan import PrivacyPlan

# The Airflow variable holding a site's noise secret, resolved on the site's worker.
NOISE_SECRET_VARIABLE = "flare_noise_secret"  # noqa: S105 - the variable's name, not its value
# The Airflow variable holding the run's central-DP noise secret, resolved on the aggregation's
# worker. Another name than the sites': a server holding a site's secret could regenerate and
# subtract that site's local noise.
CENTRAL_NOISE_SECRET_VARIABLE = "flare_central_noise_secret"  # noqa: S105 - the variable's name, not its value


def _check_delta(value: Any) -> float | None:
    if value is not None and not (is_real_number(value) and 0 < value < 1):
        raise ValueError(f"delta must be a number in (0, 1), e.g. 1.0e-5, got {value!r}")
    return None if value is None else float(value)


class SiteBudget(Strict):
    """A site's privacy budget over every run and job (the odometer): ε at δ, composed over every
    distinct release the site's ledger holds (docs/privacy.md, "The site's budget")."""

    max_epsilon: float = Field(description="the most ε the site spends, over all its releases")
    delta: float = Field(description="the δ of the site's (ε, δ) account, e.g. 1.0e-5")
    ledger: str | None = Field(
        None,
        description="the ledger's SQLite file on the site's worker (default $AIRFLOW_HOME/flare/privacy-ledger.sqlite)",
    )

    @field_validator("max_epsilon", mode="before")
    @classmethod
    def _max_epsilon(cls, value: Any) -> float:
        return positive_number(value, "privacy.budget.max_epsilon", "the site's ε over all its runs, e.g. 8")

    @field_validator("delta", mode="before")
    @classmethod
    def _delta(cls, value: Any) -> float:
        checked = _check_delta(value)
        if checked is None:
            raise ValueError("privacy.budget.delta is required, e.g. 1.0e-5")
        return checked


def needed_z(max_epsilon: float, delta: float, rounds: int) -> str:
    """What to say of the z a target ε needs."""
    return f"a noise_multiplier of at least {noise_multiplier_for(max_epsilon, delta, rounds):.3f}"


class SitePrivacy(Strict):
    """A site's own privacy: what its admin enforces on every update that leaves it."""

    filters: list[FilterSpec] = Field(default_factory=list, description="applied in order to every update")
    public_metrics: list[str] = Field(default_factory=list, description="metrics that may leave the site")
    public_tensors: list[str] = Field(default_factory=list, description="non-float tensors that may leave")
    public_meta: list[str] = Field(default_factory=list, description="meta keys (besides num_samples) that may leave")
    allow_job_filters: list[FilterType] = Field(
        default_factory=all_filter_types,
        description="filter types a job may add",
    )
    delta: float | None = Field(None, description="δ at which the site's ε is reported (needed with gaussian)")
    noise_secret_variable: str = Field(
        NOISE_SECRET_VARIABLE, description="Airflow variable (on the site's worker) holding the noise secret"
    )
    budget: SiteBudget | None = Field(
        None, description="the site's ε budget over all its runs and jobs, kept in a ledger at the site"
    )

    @field_validator("delta", mode="before")
    @classmethod
    def _delta(cls, value: Any) -> float | None:
        return _check_delta(value)

    @field_validator("noise_secret_variable")
    @classmethod
    def _own_secret(cls, value: str) -> str:
        if not value.strip():
            raise ValueError(
                f"noise_secret_variable is empty; name the site's own variable (default {NOISE_SECRET_VARIABLE})"
            )
        if value == CENTRAL_NOISE_SECRET_VARIABLE:
            raise ValueError(
                f"noise_secret_variable names the server's central-DP secret ({CENTRAL_NOISE_SECRET_VARIABLE}): a "
                f"server holding the site's secret could regenerate and subtract its noise; use the site's own, e.g. "
                f"{NOISE_SECRET_VARIABLE}"
            )
        return value

    @model_validator(mode="after")
    def _noise_needs_delta(self) -> SitePrivacy:
        if self.delta is None and any(f.noise() is not None for f in self.filters):
            raise ValueError(
                "a gaussian filter needs privacy.delta (e.g. 1.0e-5, below 1/number of records) to report its ε"
            )
        return self


class CentralDP(Strict):
    """Central DP in the aggregation: clip each update, noise the sum, divide by the number of sites."""

    clip: float
    noise_multiplier: float

    @field_validator("clip", mode="before")
    @classmethod
    def _clip(cls, value: Any) -> float:
        return positive_number(value, "clip", "the L2 norm bound of each site's update, e.g. 1.0")

    @field_validator("noise_multiplier", mode="before")
    @classmethod
    def _z(cls, value: Any) -> float:
        return positive_number(value, "noise_multiplier", "z, the noise's sd in units of clip")


class JobPrivacy(Strict):
    """The job's privacy: filters added at every site, the account's δ, the budget, central DP."""

    filters: list[FilterSpec] = Field(default_factory=list, description="added after each site's own filters")
    public_metrics: list[str] | None = Field(None, description="used at sites without a privacy block of their own")
    public_tensors: list[str] | None = None
    public_meta: list[str] | None = None
    skip_site_filters: list[FilterType] = Field(
        default_factory=list, description="refused wherever a site applies one: a job never removes a site's filter"
    )
    delta: float | None = Field(None, description="δ of the run's (ε, δ) account")
    max_epsilon: float | None = Field(None, description="end the run before the round whose ε would exceed this")
    central: CentralDP | None = Field(
        None, description="central DP in the aggregation: clip each update, noise the sum, divide by the sites"
    )

    @field_validator("delta", mode="before")
    @classmethod
    def _delta(cls, value: Any) -> float | None:
        return _check_delta(value)

    @field_validator("max_epsilon", mode="before")
    @classmethod
    def _max_epsilon(cls, value: Any) -> float | None:
        return None if value is None else positive_number(value, "max_epsilon", "the run's privacy budget ε, e.g. 8")

    @model_validator(mode="after")
    def _account(self) -> JobPrivacy:
        noisy = any(f.noise() is not None for f in self.filters) or self.central is not None
        if noisy and self.delta is None:
            raise ValueError(
                "noise (a gaussian filter or privacy.central) needs privacy.delta, the δ of the run's (ε, δ) "
                "account (e.g. 1.0e-5, below 1/number of records)"
            )
        if self.max_epsilon is not None and self.noise_multiplier is None:
            raise ValueError(
                "max_epsilon needs noise the job itself applies (a gaussian filter in privacy.filters or "
                "privacy.central): the budget is spent by the job's own noise, known before the run"
            )
        if self.max_epsilon is not None and self.rounds_allowed(1) == 0:
            assert self.delta is not None  # checked above
            raise ValueError(
                f"max_epsilon {self.max_epsilon:g} is below the ε of a single round ({self.epsilon_after(1):.3f} at "
                f"δ={self.delta:g} with noise_multiplier {self.noise_multiplier:g}): raise max_epsilon, or the noise "
                f"(one round within it needs {needed_z(self.max_epsilon, self.delta, 1)})"
            )
        return self

    @property
    def noise_multiplier(self) -> float | None:
        """The largest z the job applies (its gaussian filters run at every site, central DP on the sum):
        every release is at least that private (post-processing), so the run's ε is computed from it."""
        zs = [z for f in self.filters if (z := f.noise()) is not None]
        if self.central is not None:
            zs.append(self.central.noise_multiplier)
        return max(zs) if zs else None

    def run_budget(self) -> dict[str, float] | None:
        """What a site task checks of the job's ``max_epsilon`` against the run's releases at the site
        (the job's gaussian filters: central DP's releases are the server's)."""
        zs = [z for f in self.filters if (z := f.noise()) is not None]
        if self.max_epsilon is None or self.delta is None or not zs:
            return None
        return {"max_epsilon": self.max_epsilon, "delta": self.delta, "noise_multiplier": max(zs)}

    def epsilon_after(self, rounds: int) -> float | None:
        """The run's ε at ``delta`` after ``rounds`` rounds, or None when the job adds no noise."""
        z = self.noise_multiplier
        if z is None or self.delta is None:
            return None
        return epsilon_after(z, rounds, self.delta)

    def rounds_allowed(self, rounds: int) -> int:
        """How many of ``rounds`` rounds the budget allows (all of them without ``max_epsilon``)."""
        z = self.noise_multiplier
        if self.max_epsilon is None or z is None or self.delta is None:
            return rounds
        return rounds_within_budget(z, self.delta, self.max_epsilon, rounds)

    def account(
        self, round_num: int, site_releases: Mapping[str, int] | None = None, central_releases: int | None = None
    ) -> dict[str, Any] | None:
        """What a round's summary and the run's report say of the privacy spent after ``round_num``.

        ``site_releases``: the distinct releases each site charged in this run so far (its site
        task's report); ``central_releases``: the distinct central-DP sums released so far. A site
        task retried with another update released twice in one round, a round re-aggregated after
        a cleared site released two sums: the run's ε is composed over the most releases, never
        fewer than the rounds.
        """
        z = self.noise_multiplier
        if z is None or self.delta is None:
            return None
        releases = max([round_num, *(site_releases or {}).values(), central_releases or 0])
        row: dict[str, Any] = {
            "epsilon": epsilon_after(z, releases, self.delta),
            "delta": self.delta,
            "noise_multiplier": z,
            "accountant": "gdp",
            "releases": releases,
        }
        if site_releases:
            row["site_releases"] = dict(sorted(site_releases.items()))
        if central_releases is not None:
            row["central_releases"] = central_releases
        if self.max_epsilon is not None:
            row["max_epsilon"] = self.max_epsilon
        return row

    def budget_note(self, rounds: int) -> str | None:
        """Why the run stops before ``rounds`` (the budget), or None when it does not."""
        allowed = self.rounds_allowed(rounds)
        if allowed >= rounds:
            return None
        over = self.epsilon_after(allowed + 1)
        spent = self.epsilon_after(allowed) if allowed else 0.0
        return (
            f"privacy budget exhausted at round {allowed + 1}: its ε would be {over:.3f} > max_epsilon "
            f"{self.max_epsilon:g} (δ={self.delta:g}); the run trained {allowed} of {rounds} rounds, ε = {spent:.3f}"
        )


def site_privacy_plan(site_privacy: SitePrivacy | None, job: JobPrivacy, site: str, where: str) -> PrivacyPlan | None:
    """The plan a site task applies: the site's filters, then the job's; None when neither asks for any.

    Raises :class:`ConfigError` (naming ``where``) when the job adds a filter type the site does
    not allow, asks to skip a site filter, or declares public what the site keeps home.
    """
    job_public = {
        "public_metrics": job.public_metrics,
        "public_tensors": job.public_tensors,
        "public_meta": job.public_meta,
    }
    if site_privacy is None and not job.filters and all(v is None for v in job_public.values()):
        return None
    if site_privacy is None:
        site_privacy = SitePrivacy(
            public_metrics=job.public_metrics or [],
            public_tensors=job.public_tensors or [],
            public_meta=job.public_meta or [],
            delta=job.delta,
        )
    else:
        skipped = sorted({f.type for f in site_privacy.filters} & set(job.skip_site_filters))
        if skipped:
            raise ConfigError(
                f"{where}: the job asks to skip the site's {', '.join(skipped)} filter(s) (privacy.skip_site_filters); "
                "a job may add filters, never remove a site's: remove skip_site_filters, or ask the site's admin"
            )
        refused = sorted({f.type for f in job.filters} - set(site_privacy.allow_job_filters))
        if refused:
            raise ConfigError(
                f"{where}: the job adds {', '.join(refused)} filter(s) (privacy.filters) but the site allows jobs to "
                f"add only {', '.join(site_privacy.allow_job_filters) or 'none'} (its privacy.allow_job_filters); "
                "remove them from the job, or ask the site's admin"
            )
        for key, declared in job_public.items():
            broader = sorted(set(declared or ()) - set(getattr(site_privacy, key)))
            if broader:
                raise ConfigError(
                    f"{where}: the job declares {', '.join(map(repr, broader[:10]))} public (privacy.{key}) but the "
                    f"site keeps them home (its privacy.{key} is {getattr(site_privacy, key)}); a job cannot make "
                    "public what the site does not: remove them from the job, or ask the site's admin"
                )
    filters = [*site_privacy.filters, *job.filters]
    budget = site_privacy.budget
    if budget is not None:
        zs = [z for f in filters if (z := f.noise()) is not None]
        if not zs:
            raise ConfigError(
                f"{where}: the site has a privacy budget (privacy.budget) but neither it nor the job adds noise (a "
                "gaussian filter): every release would spend an unbounded ε. Add a gaussian filter to the site's or "
                f"the job's privacy.filters ({needed_z(budget.max_epsilon, budget.delta, 1)} fits one release)"
            )
        one = epsilon_after(max(zs), 1, budget.delta)
        if not one <= budget.max_epsilon:
            raise ConfigError(
                f"{where}: one release with noise_multiplier {max(zs):g} spends ε = {one:.3f} at δ={budget.delta:g}, "
                f"more than the site's whole budget max_epsilon {budget.max_epsilon:g}; one release within it needs "
                f"{needed_z(budget.max_epsilon, budget.delta, 1)}"
            )
    return PrivacyPlan(
        filters=[f.model_dump() for f in filters],
        public_metrics=list(site_privacy.public_metrics),
        public_tensors=list(site_privacy.public_tensors),
        public_meta=list(site_privacy.public_meta),
        delta=site_privacy.delta if site_privacy.delta is not None else job.delta,
        noise_secret_variable=site_privacy.noise_secret_variable,
        budget=budget.model_dump() if budget is not None else None,
        run_budget=job.run_budget(),
    )

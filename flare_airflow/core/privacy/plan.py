"""A site's privacy plan: the filters its site task applies and what it lets leave besides them.

Made at the site from the site's privacy and the job's
(:func:`flare_airflow.core.config.privacy.site_privacy_plan`), carried to the site task in its
spec, applied by :func:`release` after the trainer sent its update and before it is published.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from flare_airflow.core.privacy.accountant import epsilon_after, epsilon_of_releases
from flare_airflow.core.privacy.filters import Params, PrivacyRefused, SiteFilter, apply_filters, site_filter
from flare_airflow.core.privacy.ledger import Budget, BudgetExceeded, PrivacyLedger, default_ledger_path
from flare_airflow.core.tracking import TRACKED_META_KEY, tracked_points


@dataclass(frozen=True)
class PrivacyPlan:
    """Filters (in order, as dicts with a ``type``) and the site's public names."""

    filters: list[dict[str, Any]] = field(default_factory=list)
    public_metrics: list[str] = field(default_factory=list)
    public_tensors: list[str] = field(default_factory=list)
    public_meta: list[str] = field(default_factory=list)
    delta: float | None = None
    noise_secret_variable: str = "flare_noise_secret"  # noqa: S105 - an Airflow variable's name
    budget: dict[str, Any] | None = None  # the site's SiteBudget: max_epsilon, delta, ledger
    # The job's max_epsilon over this run, with the job's δ and z: {max_epsilon, delta, noise_multiplier}.
    run_budget: dict[str, float] | None = None
    # A ledger file of its own, over the budget's and the default: try-trainer's trial ledger, so a
    # trial never spends the site's budget. Left out of to_dict() when unset.
    ledger_file: str | None = None

    def site_budget(self) -> Budget | None:
        if self.budget is None:
            return None
        return Budget(max_epsilon=float(self.budget["max_epsilon"]), delta=float(self.budget["delta"]))

    def ledger(self) -> PrivacyLedger:
        """The site's ledger on this worker (the budget's file, else the default)."""
        path = self.ledger_file or (self.budget or {}).get("ledger")
        return PrivacyLedger(path or default_ledger_path())

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if data["ledger_file"] is None:
            del data["ledger_file"]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PrivacyPlan:
        return cls(**dict(data))

    @property
    def adds_noise(self) -> bool:
        return self.noise_multiplier() is not None

    def steps(self) -> list[SiteFilter]:
        """The plan's filters, in order (:data:`~.filters.FILTERS` by each entry's ``type``)."""
        return [site_filter(f, where=f"privacy plan filter {i}") for i, f in enumerate(self.filters)]

    def noise_multiplier(self) -> float | None:
        """The largest z of the plan's noising filters: each release is at least that private."""
        zs = [z for step in self.steps() if (z := step.noise()) is not None]
        return max(zs) if zs else None

    def epsilon_after(self, rounds: int) -> float:
        """The site's own ε at its δ after ``rounds`` rounds (inf without noise)."""
        z = self.noise_multiplier()
        if z is None or self.delta is None:
            return math.inf
        return epsilon_after(z, rounds, self.delta)


@dataclass
class Release:
    """What leaves the site: the filtered tensors, the public metrics and meta, and the account."""

    params: Params
    metrics: dict[str, float]
    meta: dict[str, Any]
    report: dict[str, Any]


def release(
    plan: PrivacyPlan,
    params: Params,
    global_params: Params,
    *,
    diff_update: bool,
    metrics: Mapping[str, float],
    meta: Mapping[str, Any],
    round_num: int,
    key: bytes | None,
    where: str,
    frozen: Sequence[str] = (),
) -> Release:
    """Apply ``plan`` to an update. Raises :class:`PrivacyRefused` (fail closed) for metrics or meta
    keys not declared public, private non-float tensors, a noising plan without its ``key``, or a
    ``frozen`` tensor (the strategy's, glob patterns) that moved; the filters skip the frozen ones."""
    private = sorted(set(metrics) - set(plan.public_metrics))
    if private:
        raise PrivacyRefused(
            f"{where}: metric(s) {', '.join(map(repr, private[:10]))} are not declared public by the site; the "
            "update is not published. Add them to the site's privacy.public_metrics (metrics are computed on the "
            "site's data and are not covered by ε), or stop sending them"
        )
    # A trainer's own scalars (flare.log_metric) are metrics too: each leaves by its name in
    # public_metrics, checked entry by entry here, not as one opaque meta key (issue 37 #3).
    judged_meta = set(meta)
    if TRACKED_META_KEY in meta and TRACKED_META_KEY not in plan.public_meta:
        points, problems = tracked_points(meta)
        if problems:
            raise PrivacyRefused(
                f"{where}: the trainer's logged metrics (meta[{TRACKED_META_KEY!r}]) are malformed: "
                f"{'; '.join(problems[:5])}; the update is not published. Log numbers with flare.log_metric"
            )
        private_tracked = sorted(set(points) - set(plan.public_metrics))
        if private_tracked:
            raise PrivacyRefused(
                f"{where}: logged metric(s) {', '.join(map(repr, private_tracked[:10]))} (flare.log_metric) are not "
                "declared public by the site; the update is not published. Add them to the site's "
                "privacy.public_metrics (metrics are computed on the site's data and are not covered by ε), or stop "
                "logging them"
            )
        judged_meta.discard(TRACKED_META_KEY)
    private_meta = sorted(judged_meta - set(plan.public_meta))
    if private_meta:
        raise PrivacyRefused(
            f"{where}: meta key(s) {', '.join(map(repr, private_meta[:10]))} are not declared public by the site; "
            "the update is not published. Add them to the site's privacy.public_meta, or stop sending them"
        )
    result = apply_filters(
        params,
        global_params,
        diff_update=diff_update,
        steps=plan.steps(),
        key=key,
        public_tensors=plan.public_tensors,
        frozen=frozen,
        where=where,
    )
    epsilon = plan.epsilon_after(round_num)
    report: dict[str, Any] = {"filters": result.applied, "excluded": result.excluded}
    if plan.noise_multiplier() is not None:
        report.update({"epsilon": epsilon, "delta": plan.delta, "noise_multiplier": plan.noise_multiplier()})
    if result.release_id is not None:
        report["release_id"] = result.release_id
    return Release(params=result.params, metrics=dict(metrics), meta=dict(meta), report=report)


def check_budget(plan: PrivacyPlan, site: str, *, job: str, run_id: str, round_num: int) -> dict[str, float] | None:
    """Before the trainer starts: refuse (:class:`~.ledger.BudgetExceeded`) a site task whose
    release would take the site beyond its budget, whatever job or run it belongs to, or take this
    run beyond the job's ``max_epsilon`` (the run's rounds were planned for one release each; a
    retry that released another update spent more). Counts the task as one new release (a retry
    may release another update). None without a site budget."""
    budget, z = plan.site_budget(), plan.noise_multiplier()
    run_budget = plan.run_budget
    if run_budget is not None and plan.adds_noise:
        done = plan.ledger().run_count(site, job, run_id)
        z_job, d = float(run_budget["noise_multiplier"]), float(run_budget["delta"])
        would_be = epsilon_after(z_job, done + 1, d)
        if would_be > float(run_budget["max_epsilon"]):
            raise BudgetExceeded(
                f"site {site!r} round {round_num}: the job's max_epsilon {run_budget['max_epsilon']:g} (δ={d:g}) would "
                f"be crossed: this run has {done} release(s) at this site (ε = {epsilon_after(z_job, done, d):.4f}), "
                f"and one more would make it ε = {would_be:.4f} -- a retried site task that released another update "
                "is a release of its own. Nothing was released"
            )
    if budget is None:
        return None
    if z is None:
        raise PrivacyRefused(f"site {site!r} has a privacy budget but this job's plan adds no noise: refused")
    spent, would_be = plan.ledger().check(site, 1.0 / z, budget)
    return {"spent_epsilon": spent, "would_be_epsilon": would_be, "max_epsilon": budget.max_epsilon}


def charge_release(
    plan: PrivacyPlan, report: dict[str, Any], *, site: str, job: str, run_id: str, round_num: int
) -> None:
    """Charge a noised release to the site's ledger before it is published, and put the account in
    ``report``: the run's ε over the site's distinct releases in this run (``releases``, ``epsilon``
    at the plan's δ), and with a budget the site's over all its runs. A republished release (same
    ``release_id``) is not charged again; one that would cross the budget raises
    :class:`~.ledger.BudgetExceeded` and nothing is written."""
    z = plan.noise_multiplier()
    if z is None or "release_id" not in report:
        return
    budget = plan.site_budget()
    charge = plan.ledger().charge(
        site=site,
        release_id=report["release_id"],
        job=job,
        run_id=run_id,
        round_num=round_num,
        noise_multiplier=z,
        budget=budget,
    )
    report["releases"] = charge.run_releases
    report["charged"] = charge.new
    if plan.delta is not None:
        report["epsilon"] = epsilon_of_releases(charge.run_mus, plan.delta)
    if budget is not None:
        report["budget"] = {
            "max_epsilon": budget.max_epsilon,
            "delta": budget.delta,
            "epsilon": charge.site_epsilon,
            "releases": charge.site_releases,
        }


__all__ = ["PrivacyPlan", "PrivacyRefused", "Release", "charge_release", "check_budget", "release"]

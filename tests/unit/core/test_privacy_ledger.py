"""The site's privacy odometer: exact composition over distinct releases, a durable ledger that
concurrent tasks share, refusal before the budget is crossed (issue 34)."""

from __future__ import annotations

import math
import multiprocessing
import pathlib

import pytest

from flare_airflow.core.privacy.accountant import (
    composed_mu_of,
    epsilon_after,
    epsilon_of_releases,
    gdp_delta,
    gdp_epsilon,
    noise_multiplier_for,
)
from flare_airflow.core.privacy.filters import PrivacyRefused
from flare_airflow.core.privacy.ledger import Budget, BudgetExceeded, PrivacyLedger
from flare_airflow.core.privacy.plan import PrivacyPlan, charge_release, check_budget

DELTA = 1e-5
BUDGET = Budget(max_epsilon=8.0, delta=DELTA)


def test_epsilon_of_releases_is_the_closed_form_to_1e_6() -> None:
    # Three releases at z = 2, 2, 1: μ = sqrt(1/4 + 1/4 + 1) = sqrt(1.5); ε is the root of the
    # closed-form δ(ε) = Φ(-ε/μ + μ/2) - e^ε Φ(-ε/μ - μ/2) at δ = 1e-5.
    mus = [0.5, 0.5, 1.0]
    assert composed_mu_of(mus) == pytest.approx(math.sqrt(1.5), abs=1e-12)
    eps = epsilon_of_releases(mus, DELTA)
    phi = lambda x: 0.5 * math.erfc(-x / math.sqrt(2))  # noqa: E731
    mu = math.sqrt(1.5)
    closed = phi(-eps / mu + mu / 2) - math.exp(eps) * phi(-eps / mu - mu / 2)
    assert closed == pytest.approx(DELTA, rel=1e-6)
    assert gdp_delta(eps - 1e-6, mu) > DELTA > gdp_delta(eps + 1e-6, mu)  # the root, to 1e-6
    # T equal releases are T rounds of the old account.
    assert epsilon_of_releases([0.5] * 11, DELTA) == pytest.approx(epsilon_after(2.0, 11, DELTA), abs=1e-9)
    assert round(epsilon_of_releases([0.5] * 11, DELTA), 3) == 7.955


def test_every_z_above_zero_has_a_finite_epsilon_and_its_inverse() -> None:
    for z in (1e-6, 1e-3, 0.01, 0.05):
        eps = epsilon_after(z, 1, DELTA)
        assert math.isfinite(eps) and eps > 0
        assert gdp_delta(eps, 1 / z) == pytest.approx(DELTA, rel=1e-6)
    # A budget the old account refused (ε = inf at z = 0.01) is now a plain comparison.
    assert round(epsilon_after(0.01, 1, DELTA), 1) == 5425.5
    assert noise_multiplier_for(8, DELTA, 1) == pytest.approx(0.6002, abs=1e-3)
    assert gdp_epsilon(1 / noise_multiplier_for(8, DELTA, 1), DELTA) == pytest.approx(8, abs=1e-6)


def _charge(ledger: PrivacyLedger, rid: str, run: str = "r1", budget: Budget | None = BUDGET):
    return ledger.charge(
        site="site-1", release_id=rid, job="j", run_id=run, round_num=1, noise_multiplier=2.0, budget=budget
    )


def test_a_republished_release_is_charged_once_and_the_ledger_survives_a_reopen(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "state" / "ledger.sqlite"
    first = _charge(PrivacyLedger(path), "a")
    again = _charge(PrivacyLedger(path), "a")  # a retry republishing the same bytes
    assert first.new and not again.new and again.site_releases == 1
    other = _charge(PrivacyLedger(path), "b")  # another try, another update: another release
    assert other.new and other.site_releases == 2 and other.run_releases == 2
    assert other.site_epsilon == pytest.approx(epsilon_after(2.0, 2, DELTA), abs=1e-9)
    # Another job's run on the same site: counted in the site's total, not in this run's.
    later = _charge(PrivacyLedger(path), "c", run="r2")
    assert later.site_releases == 3 and later.run_releases == 1
    assert [r["release_id"] for r in PrivacyLedger(path).rows("site-1")] == ["a", "b", "c"]


def test_the_release_that_would_cross_the_budget_is_refused_and_not_written(tmp_path: pathlib.Path) -> None:
    ledger = PrivacyLedger(tmp_path / "l.sqlite")
    for i in range(11):  # z = 2: 11 releases spend 7.955, a 12th would spend 8.385
        _charge(ledger, f"r{i}")
    with pytest.raises(BudgetExceeded) as info:
        ledger.check("site-1", 0.5, BUDGET)
    message = str(info.value)
    assert "max_epsilon 8 (δ=1e-05)" in message and "ε = 7.9552" in message and "ε = 8.3854" in message
    with pytest.raises(BudgetExceeded):
        _charge(ledger, "r11")
    assert len(ledger.mus("site-1")) == 11
    _charge(ledger, "r0")  # a republished release still passes: it spends nothing


def _charge_many(path: str, start: int, n: int) -> int:
    ledger, refused = PrivacyLedger(path), 0
    for i in range(start, start + n):
        try:
            _charge(ledger, f"x{i}")
        except BudgetExceeded:
            refused += 1
    return refused


def test_concurrent_tasks_never_spend_past_the_budget(tmp_path: pathlib.Path) -> None:
    # 4 processes race 8 releases each at a budget that fits 11: exactly 11 are written, 21 refused.
    path = str(tmp_path / "l.sqlite")
    ctx = multiprocessing.get_context("fork")  # no connection is open before the fork
    with ctx.Pool(4) as pool:
        refused = sum(pool.starmap(_charge_many, [(path, k * 8, 8) for k in range(4)]))
    assert len(PrivacyLedger(path).mus("site-1")) == 11 and refused == 21


def test_the_plan_checks_before_and_charges_after(tmp_path: pathlib.Path) -> None:
    plan = PrivacyPlan(
        filters=[{"type": "gaussian", "clip": 1.0, "noise_multiplier": 2.0}],
        delta=DELTA,
        budget={"max_epsilon": 3.0, "delta": DELTA, "ledger": str(tmp_path / "l.sqlite")},
    )
    checked = check_budget(plan, "site-1", job="j", run_id="r", round_num=1)
    assert checked == {"spent_epsilon": 0.0, "would_be_epsilon": pytest.approx(1.993, abs=1e-3), "max_epsilon": 3.0}
    report = {"release_id": "one"}
    charge_release(plan, report, site="site-1", job="j", run_id="r", round_num=1)
    assert report["releases"] == 1 and report["charged"] and report["budget"]["releases"] == 1
    report = {"release_id": "two"}
    charge_release(plan, report, site="site-1", job="j", run_id="r", round_num=1)  # a hostile retry's release
    assert report["releases"] == 2 and report["epsilon"] == pytest.approx(epsilon_after(2.0, 2, DELTA))
    with pytest.raises(BudgetExceeded, match="would be crossed"):  # 3 releases: 3.709 > 3
        check_budget(plan, "site-1", job="j", run_id="r", round_num=1)


def test_site_budget_prints_the_ledger(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    from flare_airflow.cli.commands import main

    ledger = tmp_path / "ledger.sqlite"
    for rid in ("a", "b"):
        _charge(PrivacyLedger(ledger), rid)
    policy = tmp_path / "site.yaml"
    policy.write_text(
        "sites:\n  site-1:\n    privacy:\n      delta: 1.0e-5\n"
        f"      budget: {{max_epsilon: 8, delta: 1.0e-5, ledger: {ledger}}}\n"
        "      filters: [{type: gaussian, clip: 1.0, noise_multiplier: 2.0}]\n"
    )
    assert main(["site", "budget", "--policy", str(policy), "--releases"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("site-1"))
    assert row.split()[:4] == ["site-1", "2", f"{epsilon_after(2.0, 2, DELTA):.4f}", "8"]
    assert "job j run r1 round 1  z=2" in out


def test_the_runs_epsilon_is_composed_over_the_most_releases_of_any_site() -> None:
    from flare_airflow.core.config.privacy import JobPrivacy

    job = JobPrivacy.model_validate(
        {"filters": [{"type": "gaussian", "clip": 1.0, "noise_multiplier": 2.0}], "delta": DELTA}
    )
    honest = job.account(3, {"site-1": 3, "site-2": 3})
    assert honest is not None and honest["releases"] == 3
    assert honest["epsilon"] == pytest.approx(epsilon_after(2.0, 3, DELTA))
    retried = job.account(3, {"site-1": 4, "site-2": 3})  # site-1 released two updates in one round
    assert retried is not None and retried["releases"] == 4 and retried["site_releases"] == {"site-1": 4, "site-2": 3}
    assert retried["epsilon"] == pytest.approx(epsilon_after(2.0, 4, DELTA))


def test_a_hostile_retry_cannot_carry_a_run_past_the_jobs_max_epsilon(tmp_path: pathlib.Path) -> None:
    # The job planned 2 rounds within max_epsilon 3.5 (z = 2: 2.943); a third release (a retry that
    # sent another update) would make the run's ε 3.709: the site task is refused before it runs.
    plan = PrivacyPlan(
        filters=[{"type": "gaussian", "clip": 1.0, "noise_multiplier": 2.0}],
        delta=DELTA,
        run_budget={"max_epsilon": 3.5, "delta": DELTA, "noise_multiplier": 2.0},
    )
    for rid in ("round-1", "round-1-retry"):
        assert check_budget(plan, "site-1", job="j", run_id="r", round_num=1) is None
        charge_release(plan, {"release_id": rid}, site="site-1", job="j", run_id="r", round_num=1)
    with pytest.raises(BudgetExceeded, match=r"the job's max_epsilon 3.5 \(δ=1e-05\) would be crossed"):
        check_budget(plan, "site-1", job="j", run_id="r", round_num=2)
    assert check_budget(plan, "site-1", job="j", run_id="another run", round_num=1) is None


def test_a_ledger_that_cannot_be_written_refuses_the_release(tmp_path: pathlib.Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    with pytest.raises(PrivacyRefused, match=r"privacy ledger .* cannot be used .* nothing was released"):
        _charge(PrivacyLedger(blocker / "ledger.sqlite"), "a")
    corrupt = tmp_path / "corrupt.sqlite"
    corrupt.write_bytes(b"this is not a database" * 100)
    with pytest.raises(PrivacyRefused, match="DatabaseError"):
        _charge(PrivacyLedger(corrupt), "a")

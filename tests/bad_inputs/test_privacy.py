"""Bad-input battery, category "privacy": the job's and the site's privacy settings, and what a trainer sends.

Job-file cases are loaded as ``flare-airflow validate`` loads them; site-policy cases are applied
to a job's request as the site task does on the site's worker; trainer cases go through the site's
release step (what the site task runs after the trainer ends). Each asserts a clear error naming
the field and what to do.
"""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np
import pytest
import yaml

from flare_airflow.core.config import apply_site_policy, load_site_policy
from flare_airflow.core.errors import ConfigError, FlareAirflowError
from flare_airflow.core.privacy.filters import PrivacyRefused
from flare_airflow.core.privacy.plan import PrivacyPlan, release
from tests.bad_inputs.cases import Case, assert_clear
from tests.bad_inputs.test_job_file import MAX_MESSAGE, Bad, build, validate
from tests.unit.airflow_layer import make_job

GAUSSIAN = {"type": "gaussian", "clip": 1.0, "noise_multiplier": 1.0}

JOB_CASES = {
    "privacy-clip-zero": (
        "a clip filter with clip: 0",
        "clip must be a number > 0 (the L2 norm bound of the update",
        {"filters": [{"type": "clip", "clip": 0}]},
    ),
    "privacy-gaussian-negative-clip": (
        "a gaussian filter with clip: -1",
        "clip must be a number > 0 (the L2 norm bound of the update and the noise's sensitivity",
        {"filters": [{**GAUSSIAN, "clip": -1.0}], "delta": 1.0e-5},
    ),
    "privacy-noise-without-delta": (
        "a gaussian filter in the job without privacy.delta",
        "noise (a gaussian filter or privacy.central) needs privacy.delta",
        {"filters": [GAUSSIAN]},
    ),
    "privacy-central-without-delta": (
        "privacy.central without privacy.delta",
        "noise (a gaussian filter or privacy.central) needs privacy.delta",
        {"central": {"clip": 1.0, "noise_multiplier": 1.0}},
    ),
    "privacy-budget-without-noise": (
        "max_epsilon in a job that adds no noise of its own",
        "max_epsilon needs noise the job itself applies",
        {"max_epsilon": 8, "delta": 1.0e-5},
    ),
    "privacy-budget-below-one-round": (
        "max_epsilon 1 with z = 1 (one round alone spends 4.377)",
        "max_epsilon 1 is below the ε of a single round (4.377",
        {"filters": [GAUSSIAN], "delta": 1.0e-5, "max_epsilon": 1},
    ),
    "privacy-delta-out-of-range": ("delta: 2", "delta must be a number in (0, 1)", {"delta": 2}),
    "privacy-bad-regex": (
        "exclude_vars with a regex that does not compile",
        "regex 'fc[' is not a valid regular expression",
        {"filters": [{"type": "exclude_vars", "regex": "fc["}]},
    ),
    "privacy-unknown-filter": (
        "a filter type that does not exist (dp_sgd)",
        "'dp_sgd'",
        {"filters": [{"type": "dp_sgd"}]},
    ),
    "privacy-noise-multiplier-true": (
        "a gaussian filter with noise_multiplier: true (a boolean is not a number)",
        "noise_multiplier must be a number > 0 (z, the noise's sd in units of clip, e.g. 1.0), got True",
        {"filters": [{**GAUSSIAN, "noise_multiplier": True}], "delta": 1.0e-5},
    ),
    "privacy-clip-true": (
        "a clip filter with clip: true",
        "clip must be a number > 0 (the L2 norm bound of the update, e.g. 1.0), got True",
        {"filters": [{"type": "clip", "clip": True}]},
    ),
    "privacy-max-epsilon-true": (
        "max_epsilon: true",
        "max_epsilon must be a number > 0 (the run's privacy budget ε, e.g. 8), got True",
        {"filters": [GAUSSIAN], "delta": 1.0e-5, "max_epsilon": True},
    ),
    "privacy-percentile-true": (
        "a percentile filter with percentile: true",
        "percentile must be a number from 0 to 100, got True",
        {"filters": [{"type": "percentile", "percentile": True, "gamma": 0.1}]},
    ),
    "privacy-central-z-true": (
        "privacy.central with noise_multiplier: true",
        "noise_multiplier must be a number > 0 (z, the noise's sd in units of clip), got True",
        {"central": {"clip": 1.0, "noise_multiplier": True}, "delta": 1.0e-5},
    ),
    "privacy-tiny-z-budget": (
        "max_epsilon 8 with z = 0.01 (one round spends ε = 5425.5, finite, not inf)",
        "one round within it needs a noise_multiplier of at least 0.",
        {"filters": [{**GAUSSIAN, "noise_multiplier": 0.01}], "delta": 1.0e-5, "max_epsilon": 8},
    ),
    "privacy-percentile-out-of-range": (
        "a percentile filter with percentile 150",
        "percentile must be a number from 0 to 100",
        {"filters": [{"type": "percentile", "percentile": 150, "gamma": 0.1}]},
    ),
}

POLICY_CASES = {
    "privacy-site-noise-without-delta": (
        "a site policy with a gaussian filter and no delta",
        "a gaussian filter needs privacy.delta",
        "sites:\n  site-1:\n    privacy: {filters: [{type: gaussian, clip: 1.0, noise_multiplier: 1.0}]}\n",
        {},
    ),
    "privacy-filter-not-allowed": (
        "the job adds a gaussian filter, the site allows jobs to add only clip",
        "the job adds gaussian filter(s) (privacy.filters) but the site allows jobs to add only clip",
        "sites:\n  site-1:\n    privacy: {allow_job_filters: [clip]}\n",
        {"filters": [GAUSSIAN], "delta": 1.0e-5},
    ),
    "privacy-job-removes-site-filter": (
        "the job asks to skip the site's gaussian filter",
        "a job may add filters, never remove a site's",
        "sites:\n  site-1:\n    privacy:\n      delta: 1.0e-5\n"
        "      filters: [{type: gaussian, clip: 1.0, noise_multiplier: 1.0}]\n",
        {"skip_site_filters": ["gaussian"]},
    ),
    "privacy-job-publishes-site-metric": (
        "the job declares a metric public that the site keeps home",
        "a job cannot make public what the site does not",
        "sites:\n  site-1:\n    privacy: {public_metrics: [train_loss]}\n",
        {"public_metrics": ["train_loss", "val_auc"]},
    ),
    "privacy-site-secret-is-central": (
        "the site's noise_secret_variable names the server's flare_central_noise_secret",
        "noise_secret_variable names the server's central-DP secret (flare_central_noise_secret)",
        "sites:\n  site-1:\n    privacy: {noise_secret_variable: flare_central_noise_secret}\n",
        {},
    ),
    "privacy-site-secret-variable-empty": (
        "the site's noise_secret_variable is empty",
        "noise_secret_variable is empty; name the site's own variable",
        "sites:\n  site-1:\n    privacy: {noise_secret_variable: ''}\n",
        {},
    ),
    "privacy-site-budget-true": (
        "a site budget with max_epsilon: true",
        "privacy.budget.max_epsilon must be a number > 0",
        "sites:\n  site-1:\n    privacy: {budget: {max_epsilon: true, delta: 1.0e-5}}\n",
        {},
    ),
    "privacy-site-budget-without-noise": (
        "a site budget, and neither the site nor the job adds noise",
        "the site has a privacy budget (privacy.budget) but neither it nor the job adds noise",
        "sites:\n  site-1:\n    privacy: {budget: {max_epsilon: 8, delta: 1.0e-5}}\n",
        {},
    ),
    "privacy-site-budget-below-one-release": (
        "a site budget of ε = 1 with z = 1 (one release spends 4.377)",
        "one release within it needs a noise_multiplier of at least 3.731",
        "sites:\n  site-1:\n    privacy:\n      delta: 1.0e-5\n      budget: {max_epsilon: 1, delta: 1.0e-5}\n"
        "      filters: [{type: gaussian, clip: 1.0, noise_multiplier: 1.0}]\n",
        {},
    ),
}

# The site's noise secret as its worker holds it: (bad input, error, the value).
SECRET_CASES = {
    "privacy-secret-one-character": (
        "the site's noise secret is one character",
        "is too weak: about 0 bits of entropy (1 characters), below the 128 bits",
        "Q",
    ),
    "privacy-secret-repeated-pattern": (
        'the site\'s noise secret is a 64-character repeated pattern ("5e" * 32)',
        "is too weak: about 64 bits of entropy (64 characters)",
        "5e" * 32,
    ),
}

TRAINER_CASES = {
    "privacy-private-metric": (
        "the trainer sends a metric the site did not declare public",
        "metric(s) 'patients' are not declared public by the site; the update is not published",
    ),
    "privacy-private-int-tensor": (
        "the trainer's update holds an integer tensor the site did not declare public",
        "tensor(s) 'steps' are not floating-point, so no filter can clip or noise them",
    ),
}

# Central DP with an aggregator it cannot run with: (bad input, error, the job's aggregator).
AGGREGATOR_CASES = {
    "privacy-central-with-robust-rule": (
        "central DP together with a robust aggregation rule (median)",
        "privacy.central (central DP) cannot be combined with the robust aggregation rule 'median'",
        {"name": "median"},
    ),
    "privacy-central-with-norm-bound": (
        "central DP together with aggregator.norm_bound",
        "aggregator.norm_bound cannot be combined with central DP, which clips every update",
        {"name": "fedavg", "norm_bound": 5.0},
    ),
}

CASES = [
    *(Case(cid, "privacy", bad, err) for cid, (bad, err, _) in JOB_CASES.items()),
    *(Case(cid, "privacy", bad, err) for cid, (bad, err, _, _) in POLICY_CASES.items()),
    *(Case(cid, "privacy", bad, err) for cid, (bad, err, _) in AGGREGATOR_CASES.items()),
    *(Case(cid, "privacy", bad, err) for cid, (bad, err) in TRAINER_CASES.items()),
    *(Case(cid, "privacy", bad, err) for cid, (bad, err, _) in SECRET_CASES.items()),
]
BY_ID = {c.id: c for c in CASES}


@pytest.mark.parametrize("cid", list(JOB_CASES))
def test_bad_privacy_in_the_job_file(cid: str, tmp_path: pathlib.Path) -> None:
    path = build(tmp_path, Bad(field="privacy", value=JOB_CASES[cid][2]))
    message = validate(path)
    assert_clear(BY_ID[cid], message)
    assert "privacy" in message and len(message) < MAX_MESSAGE


@pytest.mark.parametrize("cid", list(POLICY_CASES))
def test_bad_privacy_in_the_site_policy(cid: str, tmp_path: pathlib.Path) -> None:
    _, _, text, job_privacy = POLICY_CASES[cid]
    job = make_job(tmp_path, privacy=job_privacy)
    path = tmp_path / "site.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        apply_site_policy(job, "site-1", load_site_policy(path))
    assert_clear(BY_ID[cid], str(info.value))
    assert str(path) in str(info.value)


@pytest.mark.parametrize("cid", list(AGGREGATOR_CASES))
def test_central_dp_with_an_aggregator_it_cannot_run_with(cid: str, tmp_path: pathlib.Path) -> None:
    path = build(
        tmp_path, Bad(field="privacy", value={"central": {"clip": 1.0, "noise_multiplier": 1.0}, "delta": 1e-5})
    )
    data = yaml.safe_load(path.read_text())
    data["aggregator"] = AGGREGATOR_CASES[cid][2]
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    message = validate(path)
    assert_clear(BY_ID[cid], message)
    assert "privacy.central" in message and len(message) < MAX_MESSAGE


@pytest.mark.parametrize("cid", list(TRAINER_CASES))
def test_what_a_trainer_sends_that_may_not_leave(cid: str) -> None:
    glob: dict[str, Any] = {"w": np.zeros(3, np.float32), "steps": np.array(1, np.int64)}
    sent = {"w": np.ones(3, np.float32), "steps": np.array(2, np.int64)}
    plan = PrivacyPlan(
        filters=[{"type": "clip", "clip": 1.0}],
        public_metrics=["loss"],
        public_tensors=["steps"] if cid == "privacy-private-metric" else [],
    )
    metrics = {"loss": 0.1, "patients": 12.0} if cid == "privacy-private-metric" else {"loss": 0.1}
    with pytest.raises(FlareAirflowError) as info:
        release(
            plan, sent, glob, diff_update=False, metrics=metrics, meta={}, round_num=1, key=None, where="site-1 round 1"
        )
    assert isinstance(info.value, PrivacyRefused)
    assert_clear(BY_ID[cid], str(info.value))


@pytest.mark.parametrize("cid", list(SECRET_CASES))
def test_a_weak_noise_secret_is_refused_before_the_trainer_starts(
    cid: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flare_airflow.operators.site_steps import SiteJobFailed, noise_secret_for

    job = make_job(tmp_path, privacy={"filters": [GAUSSIAN], "delta": 1.0e-5})
    plan = job.privacy_plan("site-1")
    assert plan is not None
    monkeypatch.setenv("AIRFLOW_VAR_FLARE_NOISE_SECRET", SECRET_CASES[cid][2])
    run = type("Run", (), {"site": "site-1", "privacy": plan.to_dict()})()
    with pytest.raises(SiteJobFailed) as info:
        noise_secret_for(run)  # type: ignore[arg-type]
    assert_clear(BY_ID[cid], str(info.value))
    assert "secrets.token_hex(32)" in str(info.value) and SECRET_CASES[cid][2] not in str(info.value)

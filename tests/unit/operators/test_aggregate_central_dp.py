"""AggregateOperator with privacy.central: the secret from the aggregation worker's Airflow variable,
the fixed denominator, a retry's identical bytes, the round's ε, and a clear failure without it."""

from __future__ import annotations

import numpy as np
import pytest
from airflow.sdk.exceptions import AirflowFailException

from flare_airflow.core.model import read_artifact
from flare_airflow.core.privacy.accountant import epsilon_after
from tests.unit.airflow_layer import RUN_ID, context, make_job
from tests.unit.operators.test_aggregate import SITES, operator, setup_round

SECRET = "a986307b82cb17f1ae6fb8bd78eb542b8ef1b5da2640f7a4d781c2f79215ba71"
PRIVACY = {"central": {"clip": 10.0, "noise_multiplier": 1e-6}, "delta": 1e-5}


@pytest.fixture
def job(tmp_path):
    return make_job(tmp_path, min_clients=2, sites={site: {} for site in SITES}, privacy=PRIVACY)


def test_central_dp_round_fixed_denominator_retry_and_epsilon(job, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW_VAR_FLARE_CENTRAL_NOISE_SECRET", SECRET)
    store, ti = setup_round(job, {"site-1": 1.0, "site-2": 3.0})  # site-3 sent nothing
    summary = operator(job).execute(context(ti))
    assert summary["accepted"] == ["site-1", "site-2"] and summary["strategy"] == "central_dp"
    params, record = read_artifact(store.global_model(job.job, RUN_ID, 1))
    # (1 + 3) x sqrt(3) < clip: no clipping; divided by the job's 3 sites, not the 2 that arrived.
    np.testing.assert_allclose(params["w"], 4.0 / 3, atol=1e-4)
    assert record.sha256 == summary["sha256"]
    assert summary["privacy"]["epsilon"] == pytest.approx(epsilon_after(1e-6, 1, 1e-5))
    assert SECRET not in repr(summary)
    assert summary["privacy"]["releases"] == 1 and summary["privacy"]["central_releases"] == 1
    # A retried aggregation (the task cleared and run again) releases the identical bytes: one release.
    again = operator(job).execute(context(ti))
    assert again["sha256"] == summary["sha256"] and again["privacy"]["central_releases"] == 1
    # site-3 cleared and succeeded, the round aggregated again: another sum, fresh noise, charged again.
    store, ti = setup_round(job, {"site-1": 1.0, "site-2": 3.0, "site-3": 2.0})
    after = operator(job).execute(context(ti))
    assert after["sha256"] != summary["sha256"] and after["privacy"]["central_releases"] == 2
    assert after["privacy"]["epsilon"] == pytest.approx(epsilon_after(1e-6, 2, 1e-5))


def test_without_the_secret_the_round_fails_saying_how_and_writes_nothing(job, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIRFLOW_VAR_FLARE_CENTRAL_NOISE_SECRET", raising=False)
    store, ti = setup_round(job, {"site-1": 1.0, "site-2": 3.0})
    with pytest.raises(AirflowFailException) as info:
        operator(job).execute(context(ti))
    message = str(info.value)
    assert "privacy.central" in message and "airflow variables set flare_central_noise_secret" in message
    assert not store.global_model(job.job, RUN_ID, 1).exists()


def test_a_weak_central_secret_fails_the_round_saying_how_to_make_one(job, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW_VAR_FLARE_CENTRAL_NOISE_SECRET", "c3" * 32)  # 64 characters, about 64 bits
    store, ti = setup_round(job, {"site-1": 1.0, "site-2": 3.0})
    with pytest.raises(AirflowFailException) as info:
        operator(job).execute(context(ti))
    message = str(info.value)
    assert "'flare_central_noise_secret' is too weak: about 64 bits" in message and "token_hex(32)" in message
    assert "c3c3" not in message and not store.global_model(job.job, RUN_ID, 1).exists()

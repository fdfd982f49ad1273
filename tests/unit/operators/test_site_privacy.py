"""The site's privacy in the Airflow layer: the plan a site task carries, and the pod / SLURM path.

Process sites apply the plan in the site runner (tests/unit/site_task/test_privacy.py); pod and
SLURM site tasks (and the sensor) apply it in ``accept_update`` on the site's worker, after the job
ended: the trainer, wherever it ran, cannot skip it.
"""

from __future__ import annotations

import hashlib
import pathlib
from typing import Any

import numpy as np
import pytest

from flare_airflow.core.model import FLModel, read_artifact, write_artifact
from flare_airflow.core.privacy.filters import l2_norm
from flare_airflow.core.store import failure_path, path_from_uri
from flare_airflow.operators.common import run_params
from flare_airflow.operators.site_outputs import accept_update
from flare_airflow.operators.site_steps import SiteJobFailed, check_site_budget, job_at_site, make_site_run
from tests.unit.airflow_layer import FakeTI, context, make_job

SITE_GAUSSIAN = {"type": "gaussian", "clip": 0.5, "noise_multiplier": 1.0}
JOB_CLIP = {"type": "clip", "clip": 0.25}


class PushingTI(FakeTI):
    def xcom_push(self, key: str, value: Any) -> None:
        self.xcoms[("self", key)] = value


def private_job(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    job = make_job(
        tmp_path,
        privacy={"filters": [JOB_CLIP], "public_metrics": ["loss"]},
        # The job file's own block for site-1 is not used where the site has a policy.
        sites={"site-1": {"privacy": {"public_metrics": ["loss", "secret"]}}, "site-2": {}},
    )
    policy = tmp_path / "site.yaml"
    policy.write_text(
        "sites:\n  site-1:\n    privacy:\n      delta: 1.0e-5\n      public_metrics: [loss]\n"
        "      filters: [{type: gaussian, clip: 0.5, noise_multiplier: 1.0}]\n"
    )
    monkeypatch.setenv("FLARE_SITE_CONFIG", str(policy))
    return job_at_site(job, "site-1", context(), 1)


def test_the_site_task_carries_the_sites_filters_then_the_jobs(tmp_path, monkeypatch) -> None:
    at_site = private_job(tmp_path, monkeypatch)
    run = make_site_run(at_site, "site-1", 1, context(), argv=["python", "t.py"])
    assert run.privacy is not None
    assert run.privacy["filters"] == [SITE_GAUSSIAN, JOB_CLIP]
    assert run.privacy["public_metrics"] == ["loss"] and run.privacy["delta"] == 1e-5
    assert '"secret"' not in run.to_json()  # the job file's own site-1 block was replaced by the policy's


def staged_update(run: Any, step: float) -> None:
    glob = {"w": np.zeros(3, np.float32)}
    write_artifact(path_from_uri(run.global_model), FLModel(params=glob))
    # Written straight into the staging place, as any trainer (or a pod's process) can.
    write_artifact(
        path_from_uri(run.staging), FLModel(params={"w": glob["w"] + np.float32(step)}, metrics={"loss": 0.3})
    )


def test_a_pod_or_slurm_site_task_filters_what_the_trainer_wrote_and_retries_publish_the_same(
    tmp_path, monkeypatch
) -> None:
    at_site = private_job(tmp_path, monkeypatch)
    monkeypatch.setenv(
        "AIRFLOW_VAR_FLARE_NOISE_SECRET", "0048d92e674fa28bd2f5b4538ab89b6ee5cc3825d3b7aab3101d4769ac874a0e"
    )
    published = []
    for try_number in (1, 2):
        ti = PushingTI(try_number=try_number)
        run = make_site_run(at_site, "site-1", 1, context(ti), argv=["python", "t.py"])
        staged_update(run, 10.0)
        summary = accept_update(context(ti), "site-1", 1, run)
        out = path_from_uri(run.output)
        data = pathlib.Path(str(out)).read_bytes()
        published.append((data, summary["sha256"]))
        assert hashlib.sha256(data).hexdigest() == summary["sha256"]
        params, record = read_artifact(out)
        assert [f["type"] for f in record.meta["privacy"]["filters"]] == ["gaussian", "clip"]
        assert l2_norm({"w": params["w"]}) <= 0.25 * (1 + 1e-6)  # the job's clip ran after the site's noise
        assert summary["privacy"]["epsilon"] == pytest.approx(4.377, abs=1e-3)
        assert summary["privacy"]["releases"] == 1  # the same bytes republished: charged once
    assert published[0] == published[1]


def test_a_hostile_retry_is_a_second_release_and_the_budget_refuses_the_third_before_launch(
    tmp_path, monkeypatch
) -> None:
    ledger = tmp_path / "site-state" / "ledger.sqlite"
    job = make_job(tmp_path, privacy={"public_metrics": ["loss"]})
    policy = tmp_path / "site.yaml"
    policy.write_text(
        "sites:\n  site-1:\n    privacy:\n      delta: 1.0e-5\n      public_metrics: [loss]\n"
        f"      budget: {{max_epsilon: 7, delta: 1.0e-5, ledger: {ledger}}}\n"
        "      filters: [{type: gaussian, clip: 0.5, noise_multiplier: 1.0}]\n"
    )
    monkeypatch.setenv("FLARE_SITE_CONFIG", str(policy))
    monkeypatch.setenv(
        "AIRFLOW_VAR_FLARE_NOISE_SECRET", "6f1c0a4b9d2e7f3851c6a0b4e9d27f3c85a1b6e0d4c9f2a7b3e8d1c6f0a5b9e2"
    )
    at_site = job_at_site(job, "site-1", context(), 1)
    for try_number, step in ((1, 10.0), (2, -3.0)):  # try 2's trainer sends another update
        ti = PushingTI(try_number=try_number)
        run = make_site_run(at_site, "site-1", 1, context(ti), argv=["python", "t.py"])
        check_site_budget(run)  # ε 4.377 then 6.573 (two releases at z = 1) fit in 7
        staged_update(run, step)
        summary = accept_update(context(ti), "site-1", 1, run)
        assert summary["privacy"]["releases"] == try_number
    assert summary["privacy"]["budget"]["epsilon"] == pytest.approx(6.573, abs=1e-3)
    run = make_site_run(at_site, "site-1", 1, context(PushingTI(try_number=3)), argv=["python", "t.py"])
    with pytest.raises(SiteJobFailed) as info:
        check_site_budget(run)
    assert "privacy budget max_epsilon 7 (δ=1e-05) would be crossed" in str(info.value)
    assert "spent ε = 6.5730 over 2 release(s)" in str(info.value) and "ε = 8.3854" in str(info.value)


def test_without_the_noise_secret_a_pod_site_task_fails_and_publishes_nothing(tmp_path, monkeypatch) -> None:
    at_site = private_job(tmp_path, monkeypatch)
    monkeypatch.delenv("AIRFLOW_VAR_FLARE_NOISE_SECRET", raising=False)
    ti = PushingTI()
    run = make_site_run(at_site, "site-1", 1, context(ti), argv=["python", "t.py"])
    staged_update(run, 1.0)
    with pytest.raises(SiteJobFailed, match="Airflow variable 'flare_noise_secret', which this worker does not have"):
        accept_update(context(ti), "site-1", 1, run)
    out = path_from_uri(run.output)
    assert not out.exists() and failure_path(out).exists()


def test_the_budget_ends_the_run_before_the_round_beyond_it(tmp_path) -> None:
    job = make_job(
        tmp_path,
        rounds=20,
        privacy={
            "filters": [{"type": "gaussian", "clip": 1.0, "noise_multiplier": 2.0}],
            "delta": 1e-5,
            "max_epsilon": 8,
        },
    )
    params = run_params(context(), job)
    assert params.rounds == 11
    assert params.budget_note is not None and "budget exhausted at round 12: its ε would be 8.385" in params.budget_note
    assert run_params(context(rounds=5), job).rounds == 5 and run_params(context(rounds=5), job).budget_note is None

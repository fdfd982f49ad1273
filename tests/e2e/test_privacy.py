"""A run under a privacy budget through real Airflow (`flare-airflow run`): the job's gaussian filter at
every site, ε after every round, and max_epsilon ending the run cleanly before the round beyond it;
central DP in the aggregation, its release bitwise the pure maths; a site's own budget over all its
runs (the ledger at the site), charging a hostile retry's second release and refusing another job's
round that would cross it."""

from __future__ import annotations

import json
import pathlib
import sqlite3
import subprocess

import numpy as np
import pytest
from safetensors.numpy import load_file

from flare_airflow.core.privacy.accountant import epsilon_after
from flare_airflow.core.privacy.central import central_dp_round, central_noise_key
from flare_airflow_testing.harness import BIN, AirflowHome, behave_job
from tests.e2e.test_runs import _asset_events

pytestmark = pytest.mark.e2e

EPSILON = {1: 1.993, 2: 2.943}  # z = 2, δ = 1e-5: the exact Gaussian-DP account


def test_max_epsilon_stops_the_run_after_round_2_and_publishes_it(airflow_home: AirflowHome) -> None:
    job = behave_job(airflow_home.root, "private", sites=1, rounds=3, min_clients=1, args=[])
    job["evaluate"] = False
    job["privacy"] = {
        "filters": [{"type": "gaussian", "clip": 1.0, "noise_multiplier": 2.0}],
        "delta": 1.0e-5,
        "max_epsilon": 3.5,
        "public_metrics": ["train_loss"],
    }
    dag_file = airflow_home.write_job("private", job)
    # The sites' noise secret, as a site's worker holds it (its environment / secrets backend).
    airflow_home.env["AIRFLOW_VAR_FLARE_NOISE_SECRET"] = (
        "6d5a9bc813553e31487faf695ff5697711fa4caab5d143c9f95a9d33da139eda"
    )
    try:
        result = airflow_home.run("flare_private", dag_file)
    finally:
        del airflow_home.env["AIRFLOW_VAR_FLARE_NOISE_SECRET"]
    assert result.returncode == 0, result.log[-4000:] + result.stderr[-2000:]
    assert result.state["state"] == "success"
    tasks = result.tasks
    assert tasks["prepare"] == "success" and tasks["publish"] == "success"
    for r in range(1, 3):
        assert (tasks[f"round_{r}.site-1"], tasks[f"round_{r}.global_model"]) == ("success", "success"), r
    assert (tasks["round_3.site-1"], tasks["round_3.global_model"]) == ("skipped", "skipped")
    assert "privacy budget exhausted at round 3" in result.log

    published = result.state["published"]
    assert published["round"] == 2
    report = json.loads(pathlib.Path(published["metrics"].removeprefix("file://")).read_text())
    assert report["rounds_completed"] == 2
    epsilons = [row["epsilon"] for row in report["rounds"]]
    assert [round(epsilons[r - 1], 3) for r in EPSILON] == list(EPSILON.values())
    assert epsilons == sorted(epsilons)
    assert round(report["privacy"]["epsilon"], 3) == 2.943
    assert report["privacy"]["note"].startswith("privacy budget exhausted at round 3: its ε would be 3.709")
    # The site's update was clipped to 1 and noised (sd 2 per element): the model is not global + 2.
    final = load_file(published["final_model"].removeprefix("file://"))
    assert not np.allclose(final["w"], 2.0, atol=1.0)
    extra = _asset_events(airflow_home, "flare_airflow.private.global_model")[-1]
    assert round(extra["privacy"]["epsilon"], 3) == 2.943 and extra["round"] == 2


def test_central_dp_through_a_real_run(airflow_home: AirflowHome) -> None:
    # 3 sites, site-3 fails: the release is global + (2 clipped updates + noise) / 3, keyed by the
    # server's secret -- bitwise what the pure maths gives for that run and round. Safe across
    # processes and CPU kinds: before the noise every value is exact (norm² = 6 of ones, sqrt
    # correctly rounded), and the noise is PCG64's, drawn on this same machine.
    job = behave_job(airflow_home.root, "central", sites=3, rounds=1, min_clients=2, args=["--fail", "site-3"])
    job["evaluate"] = False
    job["privacy"] = {"central": {"clip": 1.0, "noise_multiplier": 0.5}, "delta": 1.0e-5}
    dag_file = airflow_home.write_job("central", job)
    secret = "1f048a00e2b92a71dab65dd1a9bf611f9d525c721dbfb0c084399c5e1f112b40"
    airflow_home.env["AIRFLOW_VAR_FLARE_CENTRAL_NOISE_SECRET"] = secret
    try:
        result = airflow_home.run("flare_central", dag_file)
    finally:
        del airflow_home.env["AIRFLOW_VAR_FLARE_CENTRAL_NOISE_SECRET"]
    tasks = result.tasks
    assert result.state["state"] == "success", result.log[-4000:] + result.stderr[-2000:]
    assert (tasks["round_1.site-1"], tasks["round_1.site-2"], tasks["round_1.site-3"]) == (
        "success",
        "success",
        "failed",
    )
    assert (tasks["round_1.global_model"], tasks["publish"]) == ("success", "success")
    assert secret not in result.log
    published = result.state["published"]
    glob = {"w": np.zeros(4, np.float32), "b": np.zeros(2, np.float32)}
    ones = {k: v + np.float32(1) for k, v in glob.items()}  # healthy sites send global + 1
    key = central_noise_key(secret.encode(), "central", result.state["run_id"], 1)
    expected = central_dp_round(
        glob, [("site-1", ones, False), ("site-2", ones, False)], clip=1.0, noise_multiplier=0.5, num_sites=3, key=key
    )
    final = load_file(published["final_model"].removeprefix("file://"))
    assert all(final[k].tobytes() == expected[k].tobytes() for k in glob)
    report = json.loads(pathlib.Path(published["metrics"].removeprefix("file://")).read_text())
    assert round(report["rounds"][0]["epsilon"], 3) == round(epsilon_after(0.5, 1, 1e-5), 3)


SITE_SECRET = "9d3b51f0c2a86e47b1d05f93e8a26c4d7f0e1b3a95c8d26e4f71a0b3c5d8e92f"


def test_a_sites_budget_charges_a_hostile_retry_and_refuses_another_jobs_round(
    airflow_home: AirflowHome, tmp_path: pathlib.Path
) -> None:
    # One site whose policy sets a budget of ε = 8 at δ = 1e-5, its ledger a file at the site.
    ledger = tmp_path / "site-1-state" / "privacy-ledger.sqlite"
    policy_file = tmp_path / "site-policy.yaml"
    policy_file.write_text(
        "sites:\n  site-1:\n    launcher: process\n    privacy:\n      delta: 1.0e-5\n"
        f"      public_metrics: [train_loss]\n      budget: {{max_epsilon: 8, delta: 1.0e-5, ledger: {ledger}}}\n"
    )
    env = {"FLARE_SITE_CONFIG": str(policy_file), "AIRFLOW_VAR_FLARE_NOISE_SECRET": SITE_SECRET}
    gaussian = {"type": "gaussian", "clip": 1.0, "noise_multiplier": 2.0}

    # Job 1: round 1 publishes (release 1), round 2 fails; a resume from round 1 re-runs site-1's
    # round 1 (try 2), whose hostile trainer now sends the global model back (release 2), then round 2 (3).
    marker = tmp_path / "round-2-fixed"
    args = ["--hostile-retry", "site-1", "--fail-in-round", "site-1:2", "--until-file", str(marker)]
    job = behave_job(airflow_home.root, "retried", sites=1, rounds=2, min_clients=1, args=args)
    job["evaluate"] = False
    job["privacy"] = {"filters": [gaussian], "delta": 1.0e-5, "public_metrics": ["train_loss"]}
    dag_file = airflow_home.write_job("retried", job)
    failed = airflow_home.run("flare_retried", dag_file, env=env)
    assert failed.state["state"] == "failed" and failed.tasks["round_1.site-1"] == "success", failed.log[-3000:]
    run_id = failed.state["run_id"]
    (run_dir,) = [p for p in (airflow_home.store / "retried").iterdir() if p.is_dir()]
    update = run_dir / "round-0001" / "sites" / "site-1.safetensors"
    first = load_file(update)
    marker.touch()
    cmd = [str(BIN / "flare-airflow"), "resume", "flare_retried", run_id, "--dagfile", str(dag_file)]
    cmd += ["--from-round", "1", "--in-process"]
    out = subprocess.run(
        cmd, env={**airflow_home.env, **env}, capture_output=True, text=True, check=False, timeout=600,
        cwd=airflow_home.root,
    )  # fmt: skip
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    second = load_file(update)
    # try 1 sent global + 1 (clipped: 1/sqrt(6) per element), try 2 the global model (0). Keyed by
    # (job, run, round, site) alone, release 1 - release 2 was exactly that clipped update.
    clipped = {k: np.full(v.shape, 1 / np.sqrt(6), np.float32) for k, v in first.items()}
    assert not all(np.allclose(first[k] - second[k], clipped[k], atol=1e-3) for k in first)
    rows = sqlite3.connect(ledger).execute("SELECT job, round FROM releases ORDER BY rowid").fetchall()
    assert rows == [("retried", 1), ("retried", 1), ("retried", 2)]  # both of round 1's releases charged
    (metrics_json,) = (airflow_home.store / "retried").rglob("metrics.json")
    report = json.loads(metrics_json.read_text())
    assert report["privacy"]["releases"] == 3
    assert report["privacy"]["epsilon"] == pytest.approx(epsilon_after(2.0, 3, 1e-5), abs=1e-6)  # 3.709
    assert [row["releases"] for row in report["rounds"]] == [2, 3]  # round 1's two releases, then round 2's
    extra = _asset_events(airflow_home, "flare_airflow.retried.global_model")[-1]
    assert extra["privacy"]["releases"] == 3 and round(extra["privacy"]["epsilon"], 3) == 3.709

    # Job 2, another job and run on the same site (a new worker process; the ledger is the file):
    # at z = 0.8 its round 1 fits (ε 7.168), its round 2 would make ε 9.804 > 8 and is refused
    # before its trainer starts.
    job2 = behave_job(airflow_home.root, "second", sites=1, rounds=2, min_clients=1, args=[])
    job2["evaluate"] = False
    job2["privacy"] = {"filters": [{**gaussian, "noise_multiplier": 0.8}], "delta": 1.0e-5}
    job2["privacy"]["public_metrics"] = ["train_loss"]
    result = airflow_home.run("flare_second", airflow_home.write_job("second", job2), env=env)
    tasks = result.tasks
    assert (tasks["round_1.site-1"], tasks["round_2.site-1"]) == ("success", "failed"), result.log[-3000:]
    assert "privacy budget max_epsilon 8 (δ=1e-05) would be crossed" in result.log
    assert "spent ε = 7.1680 over 4 release(s)" in result.log and "ε = 9.8038" in result.log
    assert len(sqlite3.connect(ledger).execute("SELECT 1 FROM releases").fetchall()) == 4

"""Failing sites, bad updates and lost quorum through real Airflow: each task's final state, the
reasons, and that the global model is never written from bad data."""

from __future__ import annotations

import json
import os
import pathlib
import time

import numpy as np
import pytest
from safetensors.numpy import load_file

from flare_airflow_testing.harness import AirflowHome, behave_job

pytestmark = pytest.mark.e2e


def _run_dir(home: AirflowHome, job: str) -> pathlib.Path:
    (run_dir,) = [p for p in (home.store / job).iterdir() if p.is_dir()]
    return run_dir


def test_one_site_failing_every_round_still_completes(airflow_home: AirflowHome) -> None:
    job = behave_job(airflow_home.root, "one-down", sites=4, rounds=3, min_clients=3, args=["--fail", "site-4"])
    dag_file = airflow_home.write_job("one_down", job)
    result = airflow_home.run("flare_one_down", dag_file, conf={"rounds": 2})
    tasks = result.tasks
    assert result.state["state"] == "success", result.log[-4000:]
    for r in (1, 2):
        assert tasks[f"round_{r}.site-4"] == "failed"
        assert all(tasks[f"round_{r}.site-{i}"] == "success" for i in (1, 2, 3))
        assert tasks[f"round_{r}.global_model"] == "success"
    # rounds beyond the form's value are skipped, visibly, all at once by prepare: none of their
    # tasks ran (under the scheduler each would cost a task process)
    assert {tasks[f"round_3.{t}"] for t in ("site-1", "site-4", "global_model")} == {"skipped"}
    assert "asked for 2 of 3 rounds: skipping rounds 3-3" in result.log
    assert "round 3 skipped" not in result.log
    assert tasks["publish"] == "success"
    report = result.metrics()
    assert [row["sites_valid"] for row in report["rounds"]] == [3, 3]
    reason = report["rounds"][0]["rejected"]["site-4"]
    assert "exit code 3" in reason and "EXECUTION_ERROR" in reason
    # FedAvg of three sites that each sent global + 1: the global model grows by exactly 1 a round
    final = load_file(report["final_model"].removeprefix("file://"))
    np.testing.assert_array_equal(final["w"], np.full(4, 2.0, np.float32))
    assert "site 'site-4' round 1 failed: trainer failed: exit code 3" in result.log
    # A run the quorum carried through is a success: exit 0, and the absorbed failures are named.
    assert result.returncode == 0, result.stderr
    assert "site failures the quorum absorbed" in result.stderr
    assert "round_1.site-4: trainer failed: exit code 3; its last output: site-4: failing on purpose" in result.stderr


def test_bad_updates_are_rejected_and_never_reach_the_global_model(airflow_home: AirflowHome) -> None:
    args = ["--nan", "site-2", "--shape", "site-3", "--pickle", "site-4", "--silent", "site-5", "--dtype", "site-6"]
    job = behave_job(airflow_home.root, "bad-updates", sites=6, rounds=1, min_clients=1, args=args)
    result = airflow_home.run("flare_bad_updates", airflow_home.write_job("bad_updates", job))
    tasks = result.tasks
    assert tasks["round_1.site-1"] == "success"
    assert {tasks[f"round_1.site-{i}"] for i in range(2, 7)} == {"failed"}
    assert tasks["round_1.global_model"] == "success" and tasks["publish"] == "success"
    rejected = result.metrics()["rounds"][0]["rejected"]
    assert "NaN" in rejected["site-2"]
    assert "shape" in rejected["site-3"]
    assert "pickle" in rejected["site-4"]
    assert "sent no update" in rejected["site-5"]
    assert "dtype" in rejected["site-6"]
    # Only site-1's update counted: the global model is exactly its update (zeros + 1).
    final = load_file(result.metrics()["final_model"].removeprefix("file://"))
    np.testing.assert_array_equal(final["w"], np.ones(4, np.float32))
    # Bad updates were removed from the store; each failed site left a failure record.
    sites_dir = _run_dir(airflow_home, "bad-updates") / "round-0001" / "sites"
    assert sorted(p.name for p in sites_dir.glob("*.safetensors")) == ["site-1.safetensors"]
    assert json.loads((sites_dir / "site-4.failure.json").read_text())["name"] == "EXECUTION_ERROR"


def test_lost_quorum_fails_the_round_and_writes_no_global_model(airflow_home: AirflowHome) -> None:
    job = behave_job(
        airflow_home.root, "no-quorum", sites=4, rounds=2, min_clients=3, args=["--fail", "site-3", "--nan", "site-4"]
    )
    result = airflow_home.run("flare_no_quorum", airflow_home.write_job("no_quorum", job))
    tasks = result.tasks
    assert result.returncode != 0 and result.state["state"] == "failed"
    assert tasks["round_1.global_model"] == "failed"
    assert {tasks[f"round_2.site-{i}"] for i in range(1, 5)} == {"upstream_failed"}
    assert tasks["publish"] in {"upstream_failed", "skipped"}
    assert "round 1 failed: 2 valid update(s) from ['site-1', 'site-2'], min_clients is 3" in result.log
    # The failing round's reason comes first in what flare-airflow run prints.
    verdict = result.stderr[result.stderr.index("FAILED: run") :].splitlines()
    assert verdict[1].startswith("  round_1.global_model: round 1 failed: 2 valid update(s)"), verdict
    assert verdict[2].startswith("  round_1.site-3: trainer failed: exit code 3"), verdict
    assert verdict[3].startswith("  round_1.site-4: update from site 'site-4' rejected: tensor 'w'"), verdict
    assert verdict[-1].startswith("  not run because of that (5): publish, round_2.site-1"), verdict
    assert "site-3: trainer failed: exit code 3" in result.log
    assert "site-4: " in result.log and "NaN" in result.log
    round_dir = _run_dir(airflow_home, "no-quorum") / "round-0001"
    assert not (round_dir / "global.safetensors").exists()
    assert not (round_dir / "global.json").exists()


def test_a_site_job_killed_by_its_timeout_leaves_no_process(airflow_home: AirflowHome, tmp_path: pathlib.Path) -> None:
    job = behave_job(
        airflow_home.root,
        "hang",
        sites=2,
        rounds=1,
        min_clients=1,
        args=["--hang", "site-2", "--pidfile-dir", str(tmp_path)],
    )
    job["trainer"]["timeout"] = 8
    # Unconfined (the site policy's opt-out): the pid file holds the trainer's host pid; a confined
    # trainer has its own PID namespace (tests/unit/site_task/test_confinement.py drills that).
    policy = {"sites": {s: {"confinement": {"mode": "off"}} for s in ("site-1", "site-2")}}
    result = airflow_home.run("flare_hang", airflow_home.write_job("hang", job), site_policy=policy)
    assert result.tasks["round_1.site-2"] == "failed"
    assert result.tasks["round_1.site-1"] == "success"
    assert result.tasks["round_1.global_model"] == "success"
    pid = int((tmp_path / "site-2.pid").read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.2)
    assert not _alive(pid), f"trainer {pid} of the timed-out site task is still running"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = pathlib.Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def test_a_crashing_evaluator_fails_its_round_with_the_reason(airflow_home: AirflowHome) -> None:
    job = behave_job(airflow_home.root, "bad-eval", sites=2, rounds=1, min_clients=2, args=["--fail-evaluate"])
    result = airflow_home.run("flare_bad_eval", airflow_home.write_job("bad_eval", job))
    tasks = result.tasks
    assert result.state["state"] == "failed"
    assert tasks["round_1.site-1"] == "success" and tasks["round_1.site-2"] == "success"
    assert tasks["round_1.global_model"] == "failed"
    assert tasks["publish"] == "upstream_failed"
    assert "evaluation of the round 1 global model failed: trainer failed: exit code 4" in result.log

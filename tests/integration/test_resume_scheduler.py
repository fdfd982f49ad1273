"""``flare-airflow resume`` with a real scheduler (PostgreSQL, LocalExecutor): the clear goes to the
metadata database and the scheduler runs the cleared tasks; completed rounds are not run again."""

from __future__ import annotations

import pathlib
import subprocess

import pytest
import yaml

from tests.harness import behave_job
from tests.stack import BIN, AirflowStack, Postgres

SITES = ("site-1", "site-2", "site-3")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("stack")
    pg = Postgres()
    airflow = AirflowStack(root / "af", pg.url)
    airflow.start()
    yield airflow
    airflow.stop()
    pg.stop()


def test_resume_lets_the_running_scheduler_finish_the_run(stack: AirflowStack, tmp_path: pathlib.Path) -> None:
    marker = tmp_path / "site-2-fixed"
    folder = stack.dags / "sched_resume"
    folder.mkdir()
    args = ["--fail-in-round", "site-2:2", "--until-file", str(marker)]
    job = behave_job(folder, "sched-resume", sites=3, rounds=2, min_clients=3, args=args)
    (folder / "job.yaml").write_text(yaml.safe_dump(job))
    (folder / "dag.py").write_text(
        "from pathlib import Path\nfrom flare_airflow.builder import build_dag\n"
        "dag = build_dag(Path(__file__).with_name('job.yaml'))\n"
    )
    dag_id = "flare_sched_resume"
    run_id = stack.trigger(dag_id)
    assert stack.wait_for_run(dag_id, run_id) == "failed"
    tis = stack.task_instances(dag_id, run_id)
    assert tis["round_2.site-2"]["state"] == "failed" and tis["round_2.global_model"]["state"] == "failed"
    assert tis["publish"]["state"] == "upstream_failed"

    marker.touch()
    out = subprocess.run(
        [str(BIN / "flare-airflow"), "resume", dag_id, run_id, "--timeout", "300"],
        env=stack.env,
        capture_output=True,
        text=True,
        check=False,
        timeout=400,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "a scheduler is running" in text and "from round 2 of 2" in text, text
    tis = stack.task_instances(dag_id, run_id)
    assert {ti["state"] for ti in tis.values()} == {"success"}, {t: ti["state"] for t, ti in tis.items()}
    for task in ("prepare", "round_1.global_model", *(f"round_1.{s}" for s in SITES)):
        assert tis[task]["try_number"] == 1, task  # completed round: not run again
    for task in ("round_2.global_model", *(f"round_2.{s}" for s in SITES)):
        assert tis[task]["try_number"] == 2, task
    assert stack.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}")["state"] == "success"

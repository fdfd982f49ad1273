"""Run-level behaviour through real Airflow: warm start from the last successful run, the Asset
event, hyper-parameters reaching the trainer, and the TaskGroup inside an author's own DAG."""

from __future__ import annotations

import json
import pathlib
import subprocess

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file

from tests.harness import BIN, AirflowHome, behave_job

pytestmark = pytest.mark.e2e


def test_warm_start_continues_from_the_last_successful_run(airflow_home: AirflowHome, tmp_path: pathlib.Path) -> None:
    echo = tmp_path / "args.json"
    args = ["--echo-args", str(echo), "--", "$(touch /tmp/flare-pwned)", "a b;c", "{{ ds }}"]
    job = behave_job(airflow_home.root, "warm", sites=2, rounds=2, min_clients=2, args=args)
    job["trainer"]["hparams"] = {"lr": 0.1}
    dag_file = airflow_home.write_job("warm", job)

    # The trainer writes the echo file outside its staging directory: the site admin allows it.
    policy = {"sites": {s: {"confinement": {"writable": [str(tmp_path)]}} for s in ("site-1", "site-2")}}
    cold = airflow_home.run("flare_warm", dag_file, site_policy=policy)
    assert cold.returncode == 0, cold.log[-4000:]
    cold_final = load_file(cold.state["published"]["final_model"].removeprefix("file://"))
    np.testing.assert_array_equal(cold_final["w"], np.full(4, 2.0, np.float32))
    # Trainer arguments reach the trainer literally: no shell, no template rendering.
    seen = json.loads(echo.read_text())
    assert seen["args"] == ["--", "$(touch /tmp/flare-pwned)", "a b;c", "{{ ds }}"]
    assert seen["hparams"] == {"lr": 0.1}
    assert not pathlib.Path("/tmp/flare-pwned").exists()

    warm = airflow_home.run(
        "flare_warm", dag_file, conf={"warm_start": True, "rounds": 1, "hp_lr": 0.5}, site_policy=policy
    )
    assert warm.returncode == 0, warm.log[-4000:]
    assert f"warm start from run {cold.state['run_id']}" in warm.log
    assert json.loads(echo.read_text())["hparams"] == {"lr": 0.5}, "the form's hyper-parameters reach the trainer"
    warm_final = load_file(warm.state["published"]["final_model"].removeprefix("file://"))
    np.testing.assert_array_equal(warm_final["w"], np.full(4, 3.0, np.float32))
    pointer = json.loads((airflow_home.store / "warm" / "latest.json").read_text())
    assert pointer["run_id"] == warm.state["run_id"]

    events = _asset_events(airflow_home, "flare_airflow.warm.global_model")
    assert [e["run_id"] for e in events] == [cold.state["run_id"], warm.state["run_id"]]
    assert events[-1]["sha256"] == warm.state["published"]["sha256"]

    # Form values that are not JSON, then a DAG that no longer parses: the command fails with
    # Airflow's reason and never reports the state of the (successful) run before it.
    def run_cli(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(BIN / "flare-airflow"), "run", "flare_warm", "--dagfile", str(dag_file), *extra],
            env=airflow_home.env,
            capture_output=True,
            text=True,
            check=False,
            timeout=300,
        )

    bad_conf = run_cli("--conf", "{rounds: 1")
    assert bad_conf.returncode == 1
    assert "no new run of DAG 'flare_warm'" in bad_conf.stderr and "is not valid JSON" in bad_conf.stderr
    dag_file.write_text("this is not python\n")
    broken = run_cli()
    assert broken.returncode == 1
    assert "no new run of DAG 'flare_warm'" in broken.stderr, broken.stderr
    assert "could not be found" in broken.stderr, broken.stderr
    assert "success" not in broken.stdout + bad_conf.stdout


def _asset_events(home: AirflowHome, name: str) -> list[dict]:
    import sys

    code = (
        "import json\n"
        "from sqlalchemy import select\n"
        "from airflow.models.asset import AssetEvent, AssetModel\n"
        "from airflow.utils.session import create_session\n"
        "with create_session() as s:\n"
        "    q = select(AssetEvent).join(AssetModel, AssetEvent.asset_id == AssetModel.id)\n"
        f"    q = q.where(AssetModel.name == {name!r})\n"
        "    print(json.dumps([e.extra for e in s.scalars(q.order_by(AssetEvent.id))]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=home.env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_task_group_inside_an_authors_dag(airflow_home: AirflowHome) -> None:
    job = behave_job(airflow_home.root, "grouped", sites=2, rounds=2, min_clients=2, args=[])
    dag_code = """
        from pathlib import Path
        import pendulum
        from airflow.sdk import DAG
        from airflow.providers.standard.operators.empty import EmptyOperator
        from flare_airflow.builder import federated_task_group

        with DAG("author_dag", schedule=None, start_date=pendulum.datetime(2026, 1, 1)):
            EmptyOperator(task_id="extract") >> federated_task_group(Path(__file__).with_name("job.yaml")) \\
                >> EmptyOperator(task_id="deploy")
    """
    result = airflow_home.run("author_dag", airflow_home.write_job("grouped", job, dag_code))
    assert result.returncode == 0, result.log[-4000:]
    expected = {"extract", "deploy", "grouped.prepare", "grouped.publish"} | {
        f"grouped.round_{r}.{t}" for r in (1, 2) for t in ("site-1", "site-2", "global_model")
    }
    assert result.tasks == dict.fromkeys(expected, "success")
    final = load_file(result.state["published"]["final_model"].removeprefix("file://"))
    np.testing.assert_array_equal(final["b"], np.full(2, 2.0, np.float32))


def test_a_dag_file_outside_the_dags_folder_runs(airflow_home: AirflowHome, tmp_path: pathlib.Path) -> None:
    """A user's own job folder anywhere: `flare-airflow run --dagfile PATH` (Airflow alone refuses a
    file that is not in the subpath of its DAGs folder)."""
    folder = tmp_path / "my-job"
    folder.mkdir()
    job = behave_job(folder, "outside", sites=2, rounds=1, min_clients=2, args=[])
    (folder / "job.yaml").write_text(yaml.safe_dump(job))
    dag_file = folder / "dag.py"
    dag_file.write_text(
        "from pathlib import Path\n"
        "from flare_airflow.builder import build_dag\n"
        "dag = build_dag(Path(__file__).with_name('job.yaml'))\n"
    )
    assert not str(dag_file).startswith(str(airflow_home.dags))
    result = airflow_home.run("flare_outside", dag_file)
    assert result.returncode == 0, result.stderr[-3000:]
    assert set(result.tasks.values()) == {"success"}, result.tasks


def test_an_unknown_conf_key_fails_the_run_at_prepare_only(airflow_home: AirflowHome) -> None:
    """A typo in the conf: prepare fails naming it; nothing trains; the aggregations skip instead of
    failing a second time; publish fails (a skipped leaf would make the run a success)."""
    job = behave_job(airflow_home.root, "typo", sites=2, rounds=2, min_clients=2, args=[])
    result = airflow_home.run("flare_typo", airflow_home.write_job("typo", job), conf={"round": 1})
    assert result.state["state"] == "failed"
    tasks = result.tasks
    assert tasks["prepare"] == "failed" and tasks["publish"] == "failed"
    assert {tasks[f"round_{r}.global_model"] for r in (1, 2)} == {"skipped"}
    assert {tasks["round_1.site-1"], tasks["round_1.site-2"]} == {"upstream_failed"}
    assert result.returncode == 1
    reasons = [line for line in result.stderr.splitlines() if line.startswith("  ")]
    assert reasons[0].startswith(
        "  prepare: invalid run parameters: unknown run parameter(s) 'round' (did you mean 'rounds'?)"
    )

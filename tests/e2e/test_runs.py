"""Run-level behaviour through real Airflow: warm start from the last successful run, the Asset
event, hyper-parameters reaching the trainer, and the TaskGroup inside an author's own DAG."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file

from flare_airflow_testing.harness import BIN, AirflowHome, behave_job

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

    # The job's store moves (another directory; for a real team, a local path to object storage):
    # the Asset is the job's, not the store's, so the next run publishes an event to the same
    # Asset. Its warm start finds no latest.json in the new store and starts from initial_model.
    moved_store = tmp_path / "moved-store"
    (dag_file.parent / "job.yaml").write_text(yaml.safe_dump({**job, "store": str(moved_store)}))
    moved = airflow_home.run("flare_warm", dag_file, conf={"warm_start": True, "rounds": 1}, site_policy=policy)
    assert moved.returncode == 0, moved.stderr[-3000:]
    assert moved.tasks == {
        "prepare": "success",
        **{f"round_1.{t}": "success" for t in ("site-1", "site-2", "global_model")},
        **{f"round_2.{t}": "skipped" for t in ("site-1", "site-2", "global_model")},
        "publish": "success",
        "verdict": "success",
    }
    assert "job warm has no successful run yet; starting from initial_model" in moved.log
    moved_final = moved.state["published"]["final_model"]
    assert moved_final.removeprefix("file://").startswith(str(moved_store) + "/warm/")
    np.testing.assert_array_equal(load_file(moved_final.removeprefix("file://"))["w"], np.full(4, 1.0, np.float32))
    events = _asset_events(airflow_home, "flare_airflow.warm.global_model")
    assert [e["run_id"] for e in events] == [r.state["run_id"] for r in (cold, warm, moved)]
    assert events[-1]["model_uri"] == moved_final and events[-1]["sha256"] == moved.state["published"]["sha256"]
    assert events[0]["model_uri"] == cold.state["published"]["final_model"], "earlier events keep their store"
    assert _assets(airflow_home, "flare_airflow.warm.global_model") == [["flare_airflow.warm.global_model", True]]

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


def _assets(home: AirflowHome, name: str) -> list[list]:
    """[uri, active] of every Asset named ``name`` in the metadata database."""
    code = (
        "import json\n"
        "from sqlalchemy import select\n"
        "from airflow.models.asset import AssetActive, AssetModel\n"
        "from airflow.utils.session import create_session\n"
        "with create_session() as s:\n"
        f"    models = s.scalars(select(AssetModel).where(AssetModel.name == {name!r})).all()\n"
        f"    active = set(s.scalars(select(AssetActive.uri).where(AssetActive.name == {name!r})))\n"
        "    print(json.dumps([[m.uri, m.uri in active] for m in models]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=home.env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_failure_before_execute_reaches_the_runs_reasons(airflow_home: AirflowHome, tmp_path: pathlib.Path) -> None:
    """A task that fails in Airflow's checks before ``execute`` (here ``publish``, whose Asset another
    DAG declared first with a store path as URI, as older docs showed) has its reason printed by
    ``flare-airflow run``, not "no reason recorded"."""
    consumer = tmp_path / "deploy" / "dag.py"
    consumer.parent.mkdir()
    consumer.write_text(
        "import pendulum\n"
        "from airflow.sdk import DAG, Asset\n"
        "from airflow.providers.standard.operators.empty import EmptyOperator\n"
        "with DAG('deploy_clash', start_date=pendulum.datetime(2026, 1, 1), schedule=[Asset(\n"
        "        name='flare_airflow.clash.global_model', uri='s3://models/clash/latest.json')]):\n"
        "    EmptyOperator(task_id='deploy')\n"
    )
    deploy = airflow_home.run("deploy_clash", consumer)  # exits 1: a DAG of its own publishes no model
    assert deploy.tasks == {"deploy": "success"}, deploy.stderr[-3000:]

    job = behave_job(airflow_home.root, "clash", sites=1, rounds=1, min_clients=1, args=[])
    result = airflow_home.run("flare_clash", airflow_home.write_job("clash", job))
    assert result.returncode == 1
    assert result.tasks == {"prepare": "success", "round_1.site-1": "success", "round_1.global_model": "success",
                            "publish": "failed", "verdict": "failed"}  # fmt: skip
    reason = "AirflowInactiveAssetInInletOrOutletException: Task has the following inactive assets"
    assert reason in result.state["tasks"]["publish"]["reason"]
    assert f"publish: {reason}" in result.stderr and "another Asset with this name is active" in result.stderr
    assert "no reason recorded" not in result.stderr
    assert sorted(_assets(airflow_home, "flare_airflow.clash.global_model")) == [
        ["flare_airflow.clash.global_model", False],
        ["s3://models/clash/latest.json", True],
    ]


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
    expected = {"extract", "deploy", "grouped.prepare", "grouped.publish", "grouped.verdict"} | {
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

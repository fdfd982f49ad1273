"""Experiment tracking through real Airflow runs: MLflow's embedded SQLite store, TensorBoard event
files, OpenLineage events, and a real ``mlflow server`` reached through an Airflow connection.

The digits demo (3 rounds) tracked by the deployment's default (``[flare_airflow] tracking`` as an
environment variable: MLflow and TensorBoard, registering the final model; the job file says
nothing): one parent run whose ``global_accuracy`` points equal ``metrics.json``, one child run per
site with its ``train_loss`` and the trainer's own ``epoch_train_loss`` (Client API ``log_metric``);
the same scalars read back with TensorBoard's own reader; one registered model version; and
OpenLineage's file transport holds a COMPLETE event of each round's aggregation naming the sites'
updates in and that round's global model out. Round 3's aggregation and publish cleared and re-run
leave the same points, event files and model version, one parent run. Then a server reached through
``AIRFLOW_CONN_*`` (credentials that never reach a log), down while a run goes: the run still
publishes and every writer says why it did not track; once a real ``mlflow server`` is up on a free
loopback port, a re-run of publish fills the gap. A missing connection is in the bad-input battery.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import textwrap
from typing import Any

import pytest
import yaml
from mlflow.tracking import MlflowClient
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from flare_airflow.core.store import ModelStore
from flare_airflow.core.tracking import run_key
from flare_airflow.operators.lineage import dataset_name
from flare_airflow_testing.harness import BIN, REPO, AirflowHome, behave_job
from flare_airflow_testing.mlflow_server import MlflowServer
from flare_airflow_testing.ports import free_port

pytestmark = pytest.mark.e2e

ROUNDS = 3
SITES = ("site-1", "site-2", "site-3", "site-4")

# Clear the given tasks of a run (as the UI's Clear with "Only failed" off) and run what is left in-process.
CLEAR = textwrap.dedent(
    """
    import json, sys
    from airflow import settings
    from airflow.serialization.serialized_objects import DagSerialization
    from airflow.utils.cli import get_bagged_dag
    from flare_airflow.cli import resume

    dag_id, run_id, dagfile, *task_ids = sys.argv[1:]
    dag = get_bagged_dag(None, dag_id, dagfile)
    sdag = DagSerialization.deserialize_dag(DagSerialization.serialize_dag(dag))
    session = settings.Session()
    sdag.clear(task_ids=task_ids, run_id=run_id, only_failed=False, session=session)
    session.commit()
    print(json.dumps({"state": resume.run_in_process(dag, sdag, run_id, session)}))
    """
)


def _clear_and_rerun(home: AirflowHome, dag_id: str, run_id: str, dag_file: pathlib.Path, *tasks: str, env=None) -> str:
    out = subprocess.run(
        [str(BIN / "python"), "-c", CLEAR, dag_id, run_id, str(dag_file), *tasks],
        env={**home.env, **(env or {})},
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout + out.stderr


def _task_logs(home: AirflowHome, dag_id: str) -> str:
    files = (home.home / "logs").rglob("*.log")
    return "\n".join(p.read_text(errors="replace") for p in files if f"dag_id={dag_id}" in str(p))


def _parent_runs(client: MlflowClient, experiment: str, dag_id: str, run_id: str) -> list[Any]:
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"no MLflow experiment {experiment!r}"
    key = run_key(dag_id, run_id)
    return client.search_runs([exp.experiment_id], filter_string=f"tags.`flare_airflow.run_key` = '{key}'")


def _history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def _children(client: MlflowClient, parent: Any) -> dict[str, Any]:
    runs = client.search_runs(
        [parent.info.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'"
    )
    return {r.data.tags["flare_airflow.site"]: r for r in runs}


def _assert_tracked_like_metrics_json(client: MlflowClient, dag_id: str, state: dict[str, Any], report: dict) -> None:
    (parent,) = _parent_runs(client, "digits_tracked", dag_id, state["run_id"])
    rows = report["rounds"]
    assert len(rows) == ROUNDS
    expected = [(row["round"], row["evaluation"]["accuracy"]) for row in rows]
    assert _history(client, parent.info.run_id, "global_accuracy") == expected
    assert _history(client, parent.info.run_id, "global_loss") == [(r["round"], r["evaluation"]["loss"]) for r in rows]
    assert _history(client, parent.info.run_id, "sites_valid") == [(r, 4.0) for r in range(1, ROUNDS + 1)]
    data = parent.data
    assert data.params["rounds"] == str(ROUNDS) and data.params["hp_lr"] == "0.5"
    assert data.params["strategy.name"] == "fedavg" and data.params["sites"] == ",".join(SITES)
    assert data.tags["flare_airflow.dag_id"] == dag_id and data.tags["flare_airflow.run_id"] == state["run_id"]
    assert data.tags["flare_airflow.job"] == "digits_tracked"
    assert data.tags["flare_airflow.final_model.sha256"] == state["published"]["sha256"]
    assert data.tags["flare_airflow.final_model.uri"] == state["published"]["model_uri"]
    assert client.get_run(parent.info.run_id).info.status == "FINISHED"
    children = _children(client, parent)
    assert sorted(children) == list(SITES)
    for site, child in children.items():
        losses = [(r["round"], r["site_metrics"][site]["train_loss"]) for r in rows]
        assert _history(client, child.info.run_id, "train_loss") == losses, site
        epochs = _history(client, child.info.run_id, "epoch_train_loss")
        assert [step for step, _ in epochs] == list(range(1, ROUNDS * 10 + 1)), site  # local_epochs: 10
        assert epochs[-1][1] == pytest.approx(losses[-1][1], rel=1e-5), site  # the last epoch's loss is the sent one
        assert len(_history(client, child.info.run_id, "num_samples")) == ROUNDS


def _scalars(folder: pathlib.Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series of a TensorBoard run folder, read by TensorBoard's own reader."""
    reader = EventAccumulator(str(folder))
    reader.Reload()
    return {tag: [(e.step, e.value) for e in reader.Scalars(tag)] for tag in reader.Tags()["scalars"]}


def _assert_tensorboard_like_metrics_json(folder: pathlib.Path, report: dict) -> None:
    rows = report["rounds"]
    assert sorted(p.name for p in folder.iterdir()) == ["global", *SITES]
    series = _scalars(folder / "global")
    accuracy = series["global_accuracy"]
    assert [s for s, _ in accuracy] == [r["round"] for r in rows]  # one point per round, even after re-runs
    # Event files hold float32: equal to metrics.json to float32's precision.
    assert [v for _, v in accuracy] == pytest.approx([r["evaluation"]["accuracy"] for r in rows], rel=1e-6)
    assert len(list((folder / "global").glob("*tfevents*"))) == ROUNDS
    for site in SITES:
        own = _scalars(folder / site)
        expected = [(r["round"], r["site_metrics"][site]["train_loss"]) for r in rows]
        assert [s for s, _ in own["train_loss"]] == [s for s, _ in expected], site
        assert [v for _, v in own["train_loss"]] == pytest.approx([v for _, v in expected], rel=1e-6), site
        assert [s for s, _ in own["epoch_train_loss"]] == list(range(1, ROUNDS * 10 + 1)), site


def _lineage_of_round(events: list[dict], dag_id: str, r: int) -> dict:
    complete = [
        e for e in events if e.get("eventType") == "COMPLETE" and e["job"]["name"] == f"{dag_id}.round_{r}.global_model"
    ]
    assert complete, f"no COMPLETE OpenLineage event of round {r}'s aggregation: {[e['job']['name'] for e in events]}"
    return complete[-1]


def test_digits_run_is_tracked_by_the_deployment_default_once_per_round_even_when_rerun(
    airflow_home: AirflowHome, tmp_path: pathlib.Path
) -> None:
    job = yaml.safe_load((REPO / "dags" / "digits.yaml").read_text())
    job.update(job="digits_tracked", rounds=ROUNDS)  # no tracking: the deployment's default applies
    job["initial_model"] = str(REPO / "examples" / "digits" / "initial_model.safetensors")
    job["trainer"]["script"] = str(REPO / "examples" / "digits" / "trainer.py")
    dag_file = airflow_home.write_job("digits_tracked", job)
    dag_id = "flare_digits_tracked"
    lineage = tmp_path / "openlineage.jsonl"
    default = {"backend": ["mlflow", "tensorboard"], "register_model": "digits-global"}
    env = {
        "AIRFLOW__FLARE_AIRFLOW__TRACKING": json.dumps(default),
        "AIRFLOW__OPENLINEAGE__TRANSPORT": json.dumps({"type": "file", "log_file_path": str(lineage), "append": True}),
        "AIRFLOW__OPENLINEAGE__NAMESPACE": "flare-test",
        # DAG-run events too: they go through a process pool that `airflow dags test` never shuts
        # down; `flare-airflow run` stops Airflow's listeners as its own jobs do, or it would hang here.
    }
    result = airflow_home.run(dag_id, dag_file, env=env)
    assert result.returncode == 0 and result.state["state"] == "success", result.log[-5000:]
    assert set(result.tasks.values()) == {"success"} and len(result.tasks) == 3 + ROUNDS * 5, result.tasks
    report = result.metrics()
    db = airflow_home.store / "mlflow.db"
    assert db.is_file(), "the embedded store is a SQLite file next to the model store"
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    _assert_tracked_like_metrics_json(client, dag_id, result.state, report)
    logs = _task_logs(airflow_home, dag_id)
    assert "experiment tracking (round 3): MLflow experiment" in logs
    assert "experiment tracking (round 3): TensorBoard event files in" in logs
    run_id = result.state["run_id"]
    tensorboard = airflow_home.store / "tensorboard" / "digits_tracked" / run_id
    _assert_tensorboard_like_metrics_json(tensorboard, report)
    (parent,) = _parent_runs(client, "digits_tracked", dag_id, run_id)
    (version,) = client.search_model_versions("name = 'digits-global'")
    assert version.run_id == parent.info.run_id and version.source == result.state["published"]["model_uri"]
    assert version.tags["flare_airflow.sha256"] == result.state["published"]["sha256"]
    # OpenLineage (the provider's file transport): each aggregation read the sites' updates and wrote its model.
    events = [json.loads(line) for line in lineage.read_text().splitlines() if line.strip()]
    assert any(e["eventType"] == "COMPLETE" and e["job"]["name"] == dag_id for e in events), "no DAG-run event"
    store = ModelStore.from_uri(str(airflow_home.store))
    for r in range(1, ROUNDS + 1):
        event = _lineage_of_round(events, dag_id, r)
        outputs = [(d["namespace"], d["name"]) for d in event["outputs"]]
        assert outputs == [dataset_name(str(store.global_model("digits_tracked", run_id, r)))], outputs
        inputs = sorted((d["namespace"], d["name"]) for d in event["inputs"])
        updates = [dataset_name(str(store.site_update("digits_tracked", run_id, r, site))) for site in SITES]
        assert inputs == sorted(updates), inputs

    # Round 3's aggregation and publish run again (a second try each): not one point more.
    _clear_and_rerun(airflow_home, dag_id, run_id, dag_file, "round_3.global_model", "publish", env=env)
    state = dict(result.state)
    assert len(_parent_runs(client, "digits_tracked", dag_id, run_id)) == 1
    _assert_tracked_like_metrics_json(client, dag_id, state, report)
    _assert_tensorboard_like_metrics_json(tensorboard, report)
    assert len(client.search_model_versions("name = 'digits-global'")) == 1


def test_a_tracking_server_through_a_connection_that_is_down_then_back(
    airflow_home: AirflowHome, tmp_path: pathlib.Path
) -> None:
    server = MlflowServer(tmp_path, free_port())
    job = behave_job(airflow_home.root, "served", sites=2, rounds=2, min_clients=2, args=[])
    job["tracking"] = {"backend": "mlflow", "conn_id": "mlflow_team", "experiment": "team/served"}
    dag_file = airflow_home.write_job("served", job)
    secret = "pw-7f3a9c1e"
    env = {
        "AIRFLOW_CONN_MLFLOW_TEAM": f"http://alice:{secret}@127.0.0.1:{server.port}",
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",  # MLflow's own knob (docs/tracking.md): fail fast while down
    }
    # The tracker is down: the run still completes and publishes its model, and says why it was not tracked.
    down = airflow_home.run("flare_served", dag_file, env=env)
    assert down.state["state"] == "success" and set(down.tasks.values()) == {"success"}, down.log[-3000:]
    assert pathlib.Path(down.state["published"]["final_model"].removeprefix("file://")).is_file()
    logs = _task_logs(airflow_home, "flare_served")
    for task in ("run start", "round 1", "round 2", "publish"):
        assert f"experiment tracking failed ({task}): " in logs, task
    assert "the run goes on without it" in logs and "Connection refused" in logs
    try:
        server.start()  # back: a re-run of publish writes every round's points, the final model, FINISHED
        out = _clear_and_rerun(airflow_home, "flare_served", down.state["run_id"], dag_file, "publish", env=env)
        client = MlflowClient(tracking_uri=server.uri)
        (parent,) = _parent_runs(client, "team/served", "flare_served", down.state["run_id"])
        assert _history(client, parent.info.run_id, "sites_valid") == [(1, 2.0), (2, 2.0)]
        children = _children(client, parent)
        assert sorted(children) == ["site-1", "site-2"]
        assert [s for s, _ in _history(client, children["site-2"].info.run_id, "num_samples")] == [1, 2]
        run = client.get_run(parent.info.run_id)
        assert run.info.status == "FINISHED"
        assert run.data.tags["flare_airflow.final_model.sha256"] == down.state["published"]["sha256"]
        everything = _task_logs(airflow_home, "flare_served") + down.log + down.stderr + out
        assert secret not in everything, "the connection's password reached a log"
        assert not (airflow_home.store / "mlflow.db").exists() or "served" not in _experiments(airflow_home)
    finally:
        server.stop()


def _experiments(home: AirflowHome) -> str:
    client = MlflowClient(tracking_uri=f"sqlite:///{home.store / 'mlflow.db'}")
    return " ".join(e.name for e in client.search_experiments())

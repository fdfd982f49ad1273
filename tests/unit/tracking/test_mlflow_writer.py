"""The MLflow writer on MLflow's own SQLite store: idempotent writes, and failures as TrackingError."""

from __future__ import annotations

import os
import pathlib
import socket

import pytest

from flare_airflow.tracking import MlflowWriter, RunIdentity, TrackingError

WHO = RunIdentity("flare_demo", "manual__1", "demo", "file:///store", {"rounds": "2", "hp_lr": "0.5"})


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("mlflow") / "mlflow.db"


def _writer(db: pathlib.Path) -> MlflowWriter:
    return MlflowWriter(f"sqlite:///{db}", "demo", artifact_location=f"file://{db.parent}/artifacts")


def test_writing_twice_logs_each_point_once_and_reports_a_changed_value(db: pathlib.Path) -> None:
    run = {"global_accuracy": {1: 0.5, 2: 0.7}}
    sites = {"site-1": {"train_loss": {1: 0.9, 2: 0.8}}, "site-2": {"train_loss": {1: 1.0}}}
    with _writer(db).session() as writer:
        first = writer.write(WHO, run, sites)
    with _writer(db).session() as writer:  # a retried task: a new process, a new client
        again = writer.write(WHO, run, sites, final={"uri": "file:///m", "sha256": "ab" * 32})
        changed = writer.write(WHO, {"global_accuracy": {2: 0.75}}, {})
        client = writer.client
    assert first["run_id"] == again["run_id"] and again["differ"] == []
    assert changed["differ"] == ["global_accuracy at step 2: logged 0.7, now 0.75"]
    history = sorted((m.step, m.value) for m in client.get_metric_history(first["run_id"], "global_accuracy"))
    assert history == [(1, 0.5), (2, 0.7)]
    parent = client.get_run(first["run_id"])
    assert parent.info.status == "FINISHED" and parent.data.params == {"rounds": "2", "hp_lr": "0.5"}
    assert parent.data.tags["flare_airflow.final_model.sha256"] == "ab" * 32
    children = client.search_runs([first["experiment_id"]], f"tags.`mlflow.parentRunId` = '{first['run_id']}'")
    assert sorted(c.data.tags["flare_airflow.site"] for c in children) == ["site-1", "site-2"]
    # Another DAG run of the job: its own parent run in the same experiment.
    with _writer(db).session() as writer:
        other = writer.write(RunIdentity("flare_demo", "manual__2", "demo", "file:///store"), run, {})
    assert other["run_id"] != first["run_id"] and other["experiment_id"] == first["experiment_id"]


def test_round_after_round_reads_no_history_and_publish_still_fills_a_gap(
    db: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    who = RunIdentity("flare_demo", "manual__3", "demo", "file:///store")
    reads: list[str] = []
    with _writer(db).session() as writer:
        client = writer.client
        real = client.get_metric_history
        monkeypatch.setattr(client, "get_metric_history", lambda run_id, key: reads.append(key) or real(run_id, key))
        writer.write(who, {"global_accuracy": {1: 0.5}}, {"site-1": {"train_loss": {1: 0.9}}})
        # Round 2's write was lost (the tracker was down); round 3's goes on.
        writer.write(who, {"global_accuracy": {3: 0.7}}, {"site-1": {"train_loss": {3: 0.7}}})
        assert reads == [], "one round after another needs no history read"
        # Publish writes every round: the keys holding steps at or above the wanted ones are read.
        done = writer.write(
            who, {"global_accuracy": {1: 0.5, 2: 0.6, 3: 0.7}}, {"site-1": {"train_loss": {1: 0.9, 2: 0.8, 3: 0.7}}}
        )
        again = writer.write(who, {"global_accuracy": {3: 0.7}}, {"site-1": {"train_loss": {3: 0.7}}})  # a retry
    assert sorted(reads) == ["global_accuracy", "global_accuracy", "train_loss", "train_loss"]
    assert done["differ"] == [] and again["differ"] == []
    history = sorted((m.step, m.value) for m in real(done["run_id"], "global_accuracy"))
    assert history == [(1, 0.5), (2, 0.6), (3, 0.7)]
    (child,) = client.search_runs([done["experiment_id"]], f"tags.`mlflow.parentRunId` = '{done['run_id']}'")
    assert sorted((m.step, m.value) for m in real(child.info.run_id, "train_loss")) == [(1, 0.9), (2, 0.8), (3, 0.7)]


def test_a_tracker_that_is_down_raises_tracking_error_quickly(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    writer = MlflowWriter(f"http://127.0.0.1:{port}", "demo", env={"MLFLOW_TRACKING_PASSWORD": "pw-secret"})
    with pytest.raises(TrackingError) as info, writer.session():
        writer.write(WHO, {"a": {1: 1.0}}, {})
    message = str(info.value)
    assert f"127.0.0.1:{port}" in message and "Connection refused" in message, message
    assert "pw-secret" not in message
    assert "MLFLOW_TRACKING_PASSWORD" not in os.environ, "credentials live only while the writer writes"


def test_the_final_model_is_registered_once_per_run(db: pathlib.Path) -> None:
    final = {"uri": "file:///store/demo/final/model.safetensors", "sha256": "cd" * 32}
    who = RunIdentity("flare_demo", "manual__registered", "demo", "file:///store")
    with _writer(db).session() as writer:
        first = writer.write(who, {}, {}, final=final, register_model="demo-global")
    with _writer(db).session() as writer:  # publish re-run: the same version, none added
        again = writer.write(who, {}, {}, final=final, register_model="demo-global")
        other = writer.write(RunIdentity("flare_demo", "manual__next", "demo", "file:///store"), {}, {},
                             final=final, register_model="demo-global")  # fmt: skip
        versions = writer.client.search_model_versions("name = 'demo-global'")
    assert first["model_version"] == again["model_version"] == "1" and other["model_version"] == "2"
    assert sorted((v.version, v.run_id) for v in versions) == [(1, first["run_id"]), (2, other["run_id"])]
    assert {v.source for v in versions} == {final["uri"]} and versions[0].tags["flare_airflow.sha256"] == "cd" * 32

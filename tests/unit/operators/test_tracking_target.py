"""Where a job's tracking writes: the embedded store next to the model store, or a server from an
Airflow connection (URI and credentials, read by the Task SDK's ``Connection.get``)."""

from __future__ import annotations

import pathlib

import pytest

from flare_airflow.core.config import job_from_dict
from flare_airflow.core.store import ModelStore
from flare_airflow.operators import tracking_target as target
from flare_airflow.operators.tracking_target import (
    TrackingConfigError,
    mlflow_link,
    tracking_target,
    with_deployment_tracking,
)

REPO = pathlib.Path(__file__).resolve().parents[3]


def tracked_job(tmp_path: pathlib.Path, **spec: str):
    """A one-site job tracked by MLflow with ``spec`` (the tests of the writes use it too)."""
    return _untracked(tmp_path, tracking={"backend": "mlflow", **spec})


def _connections(monkeypatch: pytest.MonkeyPatch, **uris: str) -> None:
    """Connections as a deployment gives them to Airflow: AIRFLOW_CONN_* variables (URI or JSON)."""
    for conn_id, uri in uris.items():
        monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", uri)


def test_the_embedded_store_is_a_sqlite_file_at_the_model_stores_root(tmp_path: pathlib.Path) -> None:
    uri, env, artifacts = tracking_target(tracked_job(tmp_path), ModelStore(tmp_path / "store"))
    assert uri == f"sqlite:///{tmp_path}/store/mlflow.db" and env == {}
    assert artifacts == f"file://{tmp_path}/store/mlflow-artifacts"


def test_an_object_store_needs_a_server(tmp_path: pathlib.Path) -> None:
    from airflow.sdk import ObjectStoragePath

    with pytest.raises(TrackingConfigError, match="not on this machine's file system; name a tracking server"):
        tracking_target(tracked_job(tmp_path), ModelStore(ObjectStoragePath("memory://bucket/store")))


@pytest.mark.parametrize(
    ("conn", "uri", "env"),
    [
        (
            "http://alice:pw@mlflow.internal:5000",
            "http://mlflow.internal:5000",
            {"MLFLOW_TRACKING_USERNAME": "alice", "MLFLOW_TRACKING_PASSWORD": "pw"},
        ),
        ('{"conn_type": "http", "host": "mlflow.internal", "schema": "https", "password": "tok"}',
         "https://mlflow.internal", {"MLFLOW_TRACKING_TOKEN": "tok"}),
        ('{"conn_type": "http", "extra": "{\\"tracking_uri\\": \\"https://m.example/mlflow\\", \\"token\\": \\"t\\"}"}',
         "https://m.example/mlflow", {"MLFLOW_TRACKING_TOKEN": "t"}),
    ],
)  # fmt: skip
def test_a_server_connection_gives_uri_and_credentials(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, conn: str, uri: str, env: dict[str, str]
) -> None:
    _connections(monkeypatch, mlflow_team=conn)
    got = tracking_target(tracked_job(tmp_path, conn_id="mlflow_team"), ModelStore(tmp_path))
    assert got == (uri, env, None)


def test_a_missing_connection_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIRFLOW_CONN_MLFLOW_TEAM", raising=False)
    with pytest.raises(TrackingConfigError) as info:
        target._connection_target("mlflow_team")
    message = str(info.value)
    assert "tracking.conn_id 'mlflow_team': no such Airflow connection" in message
    assert "AIRFLOW_CONN_MLFLOW_TEAM" in message


def _untracked(tmp_path: pathlib.Path, **extra: object):
    (tmp_path / "train.py").write_text("")
    return job_from_dict(
        {
            "job": "demo",
            "rounds": 1,
            "min_clients": 1,
            "initial_model": str(REPO / "examples" / "digits" / "initial_model.safetensors"),
            "trainer": {"script": "train.py"},
            "sites": {"site-1": {}},
            **extra,
        },
        base_dir=str(tmp_path),
    )


def test_the_deployment_default_tracks_jobs_that_do_not_say(tmp_path: pathlib.Path, monkeypatch) -> None:
    monkeypatch.delenv("AIRFLOW__FLARE_AIRFLOW__TRACKING", raising=False)
    assert with_deployment_tracking(_untracked(tmp_path)).tracking is None  # no default: nothing tracked
    monkeypatch.setenv("AIRFLOW__FLARE_AIRFLOW__TRACKING", "mlflow,tensorboard")
    tracked = with_deployment_tracking(_untracked(tmp_path)).tracking
    assert tracked is not None and tracked.backend == ("mlflow", "tensorboard")
    monkeypatch.setenv("AIRFLOW__FLARE_AIRFLOW__TRACKING", '{"backend": "mlflow", "conn_id": "mlflow_team"}')
    assert with_deployment_tracking(_untracked(tmp_path)).tracking.conn_id == "mlflow_team"
    # The job's own word wins: its tracking block, or `tracking: false` for none.
    own = with_deployment_tracking(_untracked(tmp_path, tracking={"backend": "tensorboard"})).tracking
    assert own is not None and own.backend == ("tensorboard",) and own.conn_id is None
    assert with_deployment_tracking(_untracked(tmp_path, tracking=False)).tracking is None


@pytest.mark.parametrize(
    ("tracking_uri", "configured", "server", "url"),
    [
        (
            "http://mlflow.internal:5000",
            "",
            "http://mlflow.internal:5000",
            "http://mlflow.internal:5000/#/experiments/3/runs/abc",
        ),
        (
            "https://alice:pw@mlflow.example.org/mlflow/",
            "",
            "https://mlflow.example.org/mlflow",
            "https://mlflow.example.org/mlflow/#/experiments/3/runs/abc",
        ),
        # Issue 37 #4: tracked on its own server (a Connection), the run is there, not in the
        # deployment's embedded store that mlflow_ui_url browses.
        (
            "http://team-mlflow:5000",
            "http://127.0.0.1:5000/",
            "http://team-mlflow:5000",
            "http://team-mlflow:5000/#/experiments/3/runs/abc",
        ),
        ("sqlite:////srv/store/mlflow.db", "", None, None),  # the embedded store: no UI until `mlflow ui` runs
        (
            "sqlite:////srv/store/mlflow.db",
            "http://127.0.0.1:5000/",
            None,
            "http://127.0.0.1:5000/#/experiments/3/runs/abc",
        ),
    ],
)
def test_the_mlflow_link_goes_where_the_run_was_tracked_without_credentials(
    tracking_uri, configured, server, url, monkeypatch
) -> None:
    monkeypatch.setenv("AIRFLOW__FLARE_AIRFLOW__MLFLOW_UI_URL", configured)
    link = mlflow_link(tracking_uri, "3", "abc")
    assert link == {"experiment_id": "3", "run_id": "abc", "server": server, "url": url}


def test_a_job_uri_is_one_the_deployment_lists(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW__FLARE_AIRFLOW__TRACKING_URIS", "http://mlflow.internal:5000, sqlite:////srv/m.db")
    monkeypatch.delenv("AIRFLOW__FLARE_AIRFLOW__TRACKING", raising=False)
    store = ModelStore(tmp_path)
    assert (
        tracking_target(tracked_job(tmp_path, uri="http://mlflow.internal:5000/"), store)[0]
        == "http://mlflow.internal:5000/"
    )
    assert tracking_target(tracked_job(tmp_path, uri="sqlite:////srv/m.db"), store)[0] == "sqlite:////srv/m.db"
    with pytest.raises(TrackingConfigError, match="not a tracking destination this deployment allows"):
        tracking_target(tracked_job(tmp_path, uri="http://elsewhere:5000"), store)
    # the deployment's own default block names an allowed uri too
    monkeypatch.delenv("AIRFLOW__FLARE_AIRFLOW__TRACKING_URIS")
    monkeypatch.setenv("AIRFLOW__FLARE_AIRFLOW__TRACKING", '{"backend": "mlflow", "uri": "http://team:5000"}')
    assert tracking_target(tracked_job(tmp_path, uri="http://team:5000"), store)[0] == "http://team:5000"


def test_user_info_in_a_connections_host_becomes_basic_auth(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The URI MLflow is given (and that error messages repeat) carries no password."""
    _connections(monkeypatch, mlflow_team='{"conn_type": "http", "host": "https://alice:p%40ss@m.example:5000/x"}')
    got = tracking_target(tracked_job(tmp_path, conn_id="mlflow_team"), ModelStore(tmp_path))
    assert got == (
        "https://m.example:5000/x",
        {"MLFLOW_TRACKING_USERNAME": "alice", "MLFLOW_TRACKING_PASSWORD": "p@ss"},
        None,
    )

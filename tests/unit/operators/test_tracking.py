"""Where a job's tracking writes: the embedded store next to the model store, or a server from an
Airflow connection (URI and credentials, read by the Task SDK's ``Connection.get``)."""

from __future__ import annotations

import pathlib

import pytest

from flare_airflow.core.config import job_from_dict
from flare_airflow.core.store import ModelStore
from flare_airflow.operators import tracking
from flare_airflow.operators.tracking import TrackingConfigError, tracking_target

REPO = pathlib.Path(__file__).resolve().parents[3]


def _job(tmp_path: pathlib.Path, **spec: str):
    (tmp_path / "train.py").write_text("")
    return job_from_dict(
        {
            "job": "demo",
            "rounds": 1,
            "min_clients": 1,
            "initial_model": str(REPO / "examples" / "digits" / "initial_model.safetensors"),
            "trainer": {"script": "train.py"},
            "tracking": {"backend": "mlflow", **spec},
            "sites": {"site-1": {}},
        },
        base_dir=str(tmp_path),
    )


def _connections(monkeypatch: pytest.MonkeyPatch, **uris: str) -> None:
    """Connections as a deployment gives them to Airflow: AIRFLOW_CONN_* variables (URI or JSON)."""
    for conn_id, uri in uris.items():
        monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", uri)


def test_the_embedded_store_is_a_sqlite_file_at_the_model_stores_root(tmp_path: pathlib.Path) -> None:
    uri, env, artifacts = tracking_target(_job(tmp_path), ModelStore(tmp_path / "store"))
    assert uri == f"sqlite:///{tmp_path}/store/mlflow.db" and env == {}
    assert artifacts == f"file://{tmp_path}/store/mlflow-artifacts"


def test_an_object_store_needs_a_server(tmp_path: pathlib.Path) -> None:
    from airflow.sdk import ObjectStoragePath

    with pytest.raises(TrackingConfigError, match="not on this machine's file system; name a tracking server"):
        tracking_target(_job(tmp_path), ModelStore(ObjectStoragePath("memory://bucket/store")))


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
    got = tracking_target(_job(tmp_path, conn_id="mlflow_team"), ModelStore(tmp_path))
    assert got == (uri, env, None)


def test_a_missing_connection_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIRFLOW_CONN_MLFLOW_TEAM", raising=False)
    with pytest.raises(TrackingConfigError) as info:
        tracking._connection_target("mlflow_team")
    message = str(info.value)
    assert "tracking.conn_id 'mlflow_team': no such Airflow connection" in message
    assert "AIRFLOW_CONN_MLFLOW_TEAM" in message

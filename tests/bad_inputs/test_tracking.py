"""Bad-input battery, category "tracking": a job's tracking that cannot work in this deployment.

Found at the run's start (the ``prepare`` task, :func:`track_run_start`), never mid-run; a
deployment default that cannot be read (``[flare_airflow] tracking``) fails the DAG file's parse,
where the admin reads import errors. The job
file's own mistakes (unknown backend, credentials in a URI) are refused by ``validate``: see
test_job_file.py. The connection is looked up as in a task, by the Task SDK (AIRFLOW_CONN_*).
"""

from __future__ import annotations

import pathlib

import pytest
from airflow.sdk.exceptions import AirflowFailException

from flare_airflow.core.config import job_from_dict
from flare_airflow.core.errors import ConfigError
from flare_airflow.operators import tracking
from flare_airflow.operators.tracking import track_run_start
from flare_airflow.operators.tracking_target import with_deployment_tracking
from tests.bad_inputs.cases import Case, assert_clear

REPO = pathlib.Path(__file__).resolve().parents[2]

START_CASES = [
    Case(
        "tracking-connection-missing",
        "tracking",
        "tracking.conn_id names an Airflow connection that does not exist",
        "tracking.conn_id 'mlflow_team': no such Airflow connection (AirflowNotFoundException); create it with "
        "the tracking server's URI and credentials",
    ),
    Case(
        "tracking-mlflow-not-installed",
        "tracking",
        "tracking: {backend: mlflow} on workers without the mlflow package",
        "tracking: backend mlflow needs the mlflow package where Airflow runs this job's tasks: "
        "pip install 'flare-airflow[tracking]' there",
    ),
    Case(
        "tracking-embedded-on-object-store",
        "tracking",
        "tracking with the embedded store and an s3:// model store (no place for a SQLite file)",
        "is not on this machine's file system; name a tracking server in tracking.conn_id",
    ),
    Case(
        "tracking-tensorboard-on-object-store",
        "tracking",
        "tracking: {backend: tensorboard} with an s3:// model store (no local folder for event files)",
        "TensorBoard event files go next to the model store, but the store s3://models/flare is not on this "
        "machine's file system",
    ),
]
SPECS = {
    "tracking-connection-missing": ({"conn_id": "mlflow_team"}, None),
    "tracking-embedded-on-object-store": ({}, "s3://models/flare"),
    "tracking-mlflow-not-installed": ({}, None),
    "tracking-tensorboard-on-object-store": ({"backend": "tensorboard"}, "s3://models/flare"),
}
DEFAULT_CASES = [
    Case(
        "tracking-deployment-default-unknown",
        "tracking",
        "[flare_airflow] tracking = wandb (a deployment default naming an unknown tracker)",
        "[flare_airflow] tracking (AIRFLOW__FLARE_AIRFLOW__TRACKING): unknown tracking backend 'wandb': use one of "
        "mlflow, tensorboard",
    ),
    Case(
        "tracking-deployment-default-bad-json",
        "tracking",
        "[flare_airflow] tracking = {backend: mlflow} (JSON without quotes)",
        "[flare_airflow] tracking (AIRFLOW__FLARE_AIRFLOW__TRACKING): not valid JSON",
    ),
]
DEFAULTS = {
    "tracking-deployment-default-unknown": "wandb",
    "tracking-deployment-default-bad-json": "{backend: mlflow}",
}
CASES = START_CASES + DEFAULT_CASES  # the battery's table reads CASES


@pytest.mark.parametrize("bad_case", START_CASES, ids=lambda c: c.id)
def test_tracking_that_cannot_work_stops_the_run_at_its_start(
    bad_case: Case, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AIRFLOW_CONN_MLFLOW_TEAM", raising=False)
    if bad_case.id == "tracking-mlflow-not-installed":
        # Stand-in for a worker without mlflow (this environment has it): the package lookup finds nothing.
        monkeypatch.setattr(tracking, "find_spec", lambda name: None)
    spec, store = SPECS[bad_case.id]
    (tmp_path / "train.py").write_text("")
    job = job_from_dict(
        {
            "job": "demo",
            "rounds": 1,
            "min_clients": 1,
            "initial_model": str(REPO / "examples" / "digits" / "initial_model.safetensors"),
            "trainer": {"script": "train.py"},
            "tracking": {"backend": "mlflow", **spec},
            **({"store": store} if store else {}),
            "sites": {"site-1": {}},
        },
        base_dir=str(tmp_path),
    )
    with pytest.raises(AirflowFailException) as info:
        track_run_start(job, {}, None)  # refused before the context or the log is used
    assert_clear(bad_case, str(info.value))


@pytest.mark.parametrize("bad_case", DEFAULT_CASES, ids=lambda c: c.id)
def test_a_deployment_default_that_cannot_be_read_fails_the_parse(
    bad_case: Case, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIRFLOW__FLARE_AIRFLOW__TRACKING", DEFAULTS[bad_case.id])
    (tmp_path / "train.py").write_text("")
    job = job_from_dict(
        {
            "job": "demo",
            "rounds": 1,
            "min_clients": 1,
            "initial_model": str(REPO / "examples" / "digits" / "initial_model.safetensors"),
            "trainer": {"script": "train.py"},
            "sites": {"site-1": {}},
        },
        base_dir=str(tmp_path),
    )
    with pytest.raises(ConfigError) as info:
        with_deployment_tracking(job)  # what build_dag does with every job file
    assert_clear(bad_case, str(info.value))


# -- Issue 35: tracking that leaks credentials or writes where the deployment did not allow.
# A connection's credentials never reach the task log, whatever part of it carries them and
# whether the tracker takes the write or fails; a job's tracking.uri is one the deployment lists,
# never Airflow's metadata database.
PASSWORD = "s3cr3t-pw-35"
LEAK_CASES = [
    Case(
        "tracking-connection-password-in-host",
        "tracking",
        "a connection whose host is http://alice:PASSWORD@server, and the server is down",
        "experiment tracking failed (run start)",
    ),
    Case(
        "tracking-connection-token-in-extra-uri",
        "tracking",
        "a connection whose extra tracking_uri carries ?auth_token=PASSWORD, and the server is down",
        "experiment tracking failed (run start)",
    ),
]
LEAK_CONNECTIONS = {
    "tracking-connection-password-in-host": {"conn_type": "http", "host": "http://alice:{pw}@127.0.0.1:{port}"},
    "tracking-connection-token-in-extra-uri": {
        "conn_type": "http",
        "extra": {"tracking_uri": "http://127.0.0.1:{port}/?auth_token={pw}&sslpassword={pw}"},
    },
}
DESTINATION_CASES = [
    Case(
        "tracking-uri-airflow-metadata-db",
        "tracking",
        "tracking.uri sqlite:///<AIRFLOW_HOME>/airflow.db (MLflow's tables in Airflow's own database), even listed "
        "in [flare_airflow] tracking_uris",
        "is Airflow's own metadata database; MLflow would create its tables there",
    ),
    Case(
        "tracking-uri-not-allowed",
        "tracking",
        "tracking.uri file:///any/dir, a destination the deployment does not list",
        "tracking.uri file:///any/dir: not a tracking destination this deployment allows",
    ),
    Case(
        "tracking-connection-to-metadata-db",
        "tracking",
        "tracking.conn_id names a connection whose tracking_uri is Airflow's sql_alchemy_conn",
        "tracking.conn_id 'mlflow_team': ",
    ),
]
CASES += LEAK_CASES + DESTINATION_CASES


class _Log:
    """The task log, as the task's logger receives it (messages formatted as logging would)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def _add(self, message: str, *args: object) -> None:
        self.lines.append(message % args)

    info = warning = error = _add


def _tracked_job(tmp_path: pathlib.Path, **spec: object):
    (tmp_path / "train.py").write_text("")
    return job_from_dict(
        {
            "job": "demo",
            "rounds": 1,
            "min_clients": 1,
            "initial_model": str(REPO / "examples" / "digits" / "initial_model.safetensors"),
            "trainer": {"script": "train.py"},
            "store": str(tmp_path / "store"),
            "tracking": {"backend": "mlflow", **spec},
            "sites": {"site-1": {}},
        },
        base_dir=str(tmp_path),
    )


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("bad_case", LEAK_CASES, ids=lambda c: c.id)
def test_a_connections_credentials_never_reach_the_task_log(
    bad_case: Case, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json
    from types import SimpleNamespace

    conn = json.dumps(LEAK_CONNECTIONS[bad_case.id]).replace("{pw}", PASSWORD).replace("{port}", str(_closed_port()))
    monkeypatch.setenv("AIRFLOW_CONN_MLFLOW_TEAM", conn)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    log = _Log()
    context = {"ti": SimpleNamespace(dag_id="flare_demo"), "run_id": "manual__35", "params": {}}
    assert track_run_start(_tracked_job(tmp_path, conn_id="mlflow_team"), context, log) is None  # the run goes on
    text = "\n".join(log.lines)
    assert_clear(bad_case, text)
    assert PASSWORD not in text, text


@pytest.mark.parametrize("bad_case", DESTINATION_CASES, ids=lambda c: c.id)
def test_a_job_writes_only_where_the_deployment_allows(
    bad_case: Case, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from airflow.configuration import AIRFLOW_HOME, conf

    metadata_db = f"sqlite:///{AIRFLOW_HOME}/airflow.db"
    monkeypatch.setenv("AIRFLOW__FLARE_AIRFLOW__TRACKING_URIS", metadata_db)
    if bad_case.id == "tracking-connection-to-metadata-db":
        sql_alchemy_conn = conf.get("database", "sql_alchemy_conn")
        monkeypatch.setenv("AIRFLOW_CONN_MLFLOW_TEAM", f'{{"conn_type": "http", "host": "{sql_alchemy_conn}"}}')
        job = _tracked_job(tmp_path, conn_id="mlflow_team")
    else:
        uri = metadata_db if bad_case.id == "tracking-uri-airflow-metadata-db" else "file:///any/dir"
        job = _tracked_job(tmp_path, uri=uri)
    with pytest.raises(AirflowFailException) as info:
        track_run_start(job, {}, None)  # refused before the context or the log is used
    assert_clear(bad_case, str(info.value))
    assert "Airflow's own metadata database" in str(info.value) or bad_case.id == "tracking-uri-not-allowed"

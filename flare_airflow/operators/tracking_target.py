"""Where a run's tracking goes: the destination a job may choose among those the deployment allows.

An Airflow connection (``conn_id``), the embedded store (an MLflow SQLite database and TensorBoard
event files under the model store), or a ``uri`` the deployment lists (its ``[flare_airflow]
tracking`` default, ``[flare_airflow] tracking_uris``); never Airflow's own metadata database. A
destination that cannot work is a :class:`TrackingConfigError`, raised at the run's start. The
writes themselves: :mod:`flare_airflow.operators.tracking`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from urllib.parse import SplitResult, unquote, urlsplit

from flare_airflow.core.config import JobConfig, TrackingSpec, deployment_tracking
from flare_airflow.core.errors import FlareAirflowError
from flare_airflow.core.redact import redact_uri
from flare_airflow.core.store import ModelStore, local_file
from flare_airflow.core.tracking import (
    mlflow_run_url,
)

EMBEDDED_DB = "mlflow.db"
EMBEDDED_ARTIFACTS = "mlflow-artifacts"
TENSORBOARD_DIR = "tensorboard"


class TrackingConfigError(FlareAirflowError):
    """The job's tracking cannot work in this deployment (missing connection, no place for the store)."""


def deployment_default() -> TrackingSpec | None:
    """The deployment's ``[flare_airflow] tracking`` (or ``AIRFLOW__FLARE_AIRFLOW__TRACKING``), parsed."""
    from airflow.configuration import conf

    return deployment_tracking(conf.get("flare_airflow", "tracking", fallback="") or "")


def with_deployment_tracking(job: JobConfig) -> JobConfig:
    """``job`` tracked as the deployment's default says, unless its file says ``tracking:`` itself."""
    if "tracking" in job.model_fields_set:
        return job
    spec = deployment_default()
    return job if spec is None else job.model_copy(update={"tracking": spec})


def _connection_target(conn_id: str) -> tuple[str, dict[str, str]]:
    """Tracking URI and credentials (as MLflow's environment variables) of an Airflow connection."""
    from airflow.sdk import Connection

    try:
        conn = Connection.get(conn_id)
    except Exception as exc:  # the Task SDK raises AirflowNotFoundException (and others when the API fails)
        raise TrackingConfigError(
            f"tracking.conn_id {conn_id!r}: no such Airflow connection ({type(exc).__name__}); create it with the "
            "tracking server's URI and credentials (e.g. AIRFLOW_CONN_" + conn_id.upper().replace("-", "_") + "=http"
            "://user:password@host:5000, or in the secrets backend), or remove tracking.conn_id for the embedded store"
        ) from None
    extra = conn.extra_dejson if isinstance(conn.extra_dejson, Mapping) else {}
    _mask_secrets(conn.password, extra.get("token"))
    host = str(conn.host or "")
    if extra.get("tracking_uri"):
        uri = str(extra["tracking_uri"])
    elif "://" in host:
        uri = host
    elif host:
        scheme = conn.schema if conn.schema in ("http", "https") else ("https" if conn.conn_type == "https" else "http")
        uri = f"{scheme}://{host}" + (f":{conn.port}" if conn.port else "")
    else:
        raise TrackingConfigError(
            f"tracking.conn_id {conn_id!r}: the connection has no host; set the tracking server's host and port "
            "(or extra tracking_uri)"
        )
    uri, login, password = _without_userinfo(uri)
    _mask_secrets(password)
    env: dict[str, str] = {}
    if login and not conn.login:
        # user:password@ in the host or extra.tracking_uri: MLflow's basic auth, kept out of the URI that is logged
        env["MLFLOW_TRACKING_USERNAME"] = login
        if password:
            env["MLFLOW_TRACKING_PASSWORD"] = password
    if conn.login:
        env["MLFLOW_TRACKING_USERNAME"] = str(conn.login)
        if conn.password:
            env["MLFLOW_TRACKING_PASSWORD"] = str(conn.password)
    elif conn.password:
        env["MLFLOW_TRACKING_TOKEN"] = str(conn.password)
    if extra.get("token"):
        env["MLFLOW_TRACKING_TOKEN"] = str(extra["token"])
    return uri, env


def _mask_secrets(*values: object) -> None:
    """Register credentials with Airflow's secrets masker: whatever logs them shows ``***``."""
    from airflow.sdk.log import mask_secret

    for value in values:
        if value:
            mask_secret(str(value))


def _without_userinfo(uri: str) -> tuple[str, str | None, str | None]:
    """``uri`` without ``user:password@``, and the user and password it held."""
    try:
        parts = urlsplit(uri)
    except ValueError:
        return uri, None, None
    if "@" not in parts.netloc:
        return uri, None, None
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    bare = SplitResult(parts.scheme, hostport, parts.path, parts.query, parts.fragment).geturl()
    return bare, unquote(user) or None, unquote(password) or None


def allowed_uris() -> list[str]:
    """The tracking URIs a job file may name: ``[flare_airflow] tracking_uris`` (comma-separated) and
    the ``uri`` of the deployment's default (``[flare_airflow] tracking``)."""
    from airflow.configuration import conf

    listed = [u.strip() for u in (conf.get("flare_airflow", "tracking_uris", fallback="") or "").split(",")]
    default = deployment_default()
    return [u for u in listed if u] + ([default.uri] if default is not None and default.uri else [])


def _database_key(uri: str) -> tuple[str, ...] | None:
    """What names one database in a SQLAlchemy/MLflow URI: a SQLite file's real path, else the
    server's host, port and database (driver, credentials and options aside)."""
    try:
        parts = urlsplit(uri)
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.split("+")[0].lower()
    if scheme == "sqlite":
        path = uri.split("://", 1)[1].split("?", 1)[0]
        return ("sqlite", os.path.realpath(path[1:] if path.startswith("/") else path)) if path else None
    if scheme in ("postgresql", "postgres", "mysql", "mssql", "oracle"):
        scheme = "postgresql" if scheme == "postgres" else scheme
        return (scheme, (parts.hostname or "localhost").lower(), str(port or ""), parts.path.strip("/"))
    return None


def _airflow_metadata_databases() -> list[str]:
    from airflow.configuration import AIRFLOW_HOME, conf

    found = [f"sqlite:///{os.path.join(AIRFLOW_HOME, 'airflow.db')}"]
    configured = conf.get("database", "sql_alchemy_conn", fallback="") or ""
    return found + ([configured] if configured else [])


def _refuse_metadata_database(uri: str, where: str) -> None:
    key = _database_key(uri)
    if key is not None and any(key == _database_key(db) for db in _airflow_metadata_databases()):
        raise TrackingConfigError(
            f"{where}: {redact_uri(uri)} is Airflow's own metadata database; MLflow would create its tables "
            "there. Give MLflow a database of its own (or leave uri out for the embedded store next to the "
            "model store)"
        )


def _allowed_job_uri(uri: str) -> str:
    """``tracking.uri`` of a job file, if the deployment allows it (else :class:`TrackingConfigError`)."""
    _refuse_metadata_database(uri, "tracking.uri")
    allowed = allowed_uris()
    if uri.rstrip("/") not in {a.rstrip("/") for a in allowed}:
        raise TrackingConfigError(
            f"tracking.uri {redact_uri(uri)}: not a tracking destination this deployment allows (a job file "
            "chooses among them, so that a job cannot send the run's writes anywhere); use tracking.conn_id "
            "(an Airflow connection), leave uri out for the embedded store, or ask the admin to list it in "
            "[flare_airflow] tracking_uris (AIRFLOW__FLARE_AIRFLOW__TRACKING_URIS)"
            + (f"; allowed: {', '.join(redact_uri(a) for a in allowed)}" if allowed else "")
        )
    return uri


def tracking_target(job: JobConfig, store: ModelStore) -> tuple[str, dict[str, str], str | None]:
    """(tracking URI, environment for the writes, artifact location of a new experiment)."""
    spec = job.tracking
    assert spec is not None
    if spec.conn_id is not None:
        uri, env = _connection_target(spec.conn_id)
        _refuse_metadata_database(uri, f"tracking.conn_id {spec.conn_id!r}")
        return uri, env, None
    if spec.uri is not None:
        return _allowed_job_uri(spec.uri), {}, None
    root = local_file(store.root)
    if root is None:
        raise TrackingConfigError(
            f"tracking: the embedded MLflow store is a SQLite file next to the model store, but the store "
            f"{store.root} is not on this machine's file system; name a tracking server in tracking.conn_id "
            "(an Airflow connection) or a database in tracking.uri"
        )
    root = root.rstrip("/")
    return f"sqlite:///{root}/{EMBEDDED_DB}", {}, f"file://{root}/{EMBEDDED_ARTIFACTS}"


def tensorboard_root(store: ModelStore) -> str:
    """The folder of a store's TensorBoard event files (``tensorboard --logdir`` it)."""
    root = local_file(store.root)
    if root is None:
        raise TrackingConfigError(
            f"tracking: TensorBoard event files go next to the model store, but the store {store.root} is not on "
            "this machine's file system; use a local store or remove tensorboard from tracking.backend"
        )
    return f"{root.rstrip('/')}/{TENSORBOARD_DIR}"


def mlflow_ui_url() -> str | None:
    """``[flare_airflow] mlflow_ui_url``: where people browse the embedded store (and any store
    that is not a server), or None."""
    from airflow.configuration import conf

    configured = (conf.get("flare_airflow", "mlflow_ui_url", fallback="") or "").strip()
    return configured.rstrip("/") or None


def mlflow_server_ui(tracking_uri: str) -> str | None:
    """A tracking server's own URI without user info (its UI is served there), or None when the
    run was not tracked on a server (the embedded store, a database)."""
    parts = urlsplit(tracking_uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path.rstrip('/')}"


def mlflow_link(tracking_uri: str, experiment_id: str, run_id: str) -> dict[str, str | None]:
    """The MLflow run of a DAG run, for the Federated runs page: its ids, ``server`` (the tracking
    server's UI when it was tracked on one, else None) and ``url`` as of now.

    The page resolves the link when it renders (:func:`flare_airflow.ui.view.build_run_view`): on
    ``server`` for a run tracked on a server -- never ``mlflow_ui_url``, which browses another
    store, where MLflow would say the run does not exist -- else on ``mlflow_ui_url`` as it is set
    then, so setting it later fixes the links of earlier runs.
    """
    server = mlflow_server_ui(tracking_uri)
    url = mlflow_run_url(server or mlflow_ui_url(), experiment_id, run_id)
    return {"experiment_id": experiment_id, "run_id": run_id, "server": server, "url": url}

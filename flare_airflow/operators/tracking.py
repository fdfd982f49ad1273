"""Experiment tracking from the run's own tasks: prepare opens the run, each aggregation logs its
round, publish fills any gap and links (or registers) the final model (docs/tracking.md). The
trackers: MLflow, TensorBoard event files, or both.

Sites never talk to the tracker: their numbers come from the round's summary and their update
records. A tracker that is down or refuses a write never fails the federated run: the task log
says why, and the next writer (a later round, publish, or a publish retry) logs what is missing.
Only a configuration error -- a connection that does not exist, a store with no place for the
embedded tracker, a destination the deployment does not allow -- stops the run, and only at its
start (prepare).

A job file chooses among the destinations the deployment allows: an Airflow connection
(``conn_id``), the embedded store, or a ``uri`` the deployment lists (its ``[flare_airflow] tracking``
default, ``[flare_airflow] tracking_uris``); never Airflow's own metadata database. Every URI this
module logs goes through :func:`flare_airflow.core.redact.redact_uris` first.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from importlib.util import find_spec
from typing import Any
from urllib.parse import SplitResult, unquote, urlsplit

from airflow.sdk import Context
from airflow.sdk.exceptions import AirflowFailException

from flare_airflow.core.config import JobConfig, TrackingSpec, deployment_tracking
from flare_airflow.core.errors import FlareAirflowError
from flare_airflow.core.model import read_record
from flare_airflow.core.redact import redact_uri, redact_uris
from flare_airflow.core.store import ModelStore, local_file
from flare_airflow.core.tracking import (
    Points,
    at_step,
    flat_params,
    merge_points,
    mlflow_run_url,
    round_points,
    site_points,
    tracked_points,
)
from flare_airflow.operators.common import HPARAM_PREFIX, RunParamsError, run_id_of, run_params, store_for

EMBEDDED_DB = "mlflow.db"
EMBEDDED_ARTIFACTS = "mlflow-artifacts"
TENSORBOARD_DIR = "tensorboard"
# (round, its run-level points, each counted site's points)
RoundPoints = tuple[int, Points, dict[str, Points]]


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


def _writer(job: JobConfig, store: ModelStore) -> Any:
    from flare_airflow.tracking import MlflowWriter

    spec = job.tracking
    assert spec is not None
    uri, env, artifacts = tracking_target(job, store)
    return MlflowWriter(uri, spec.experiment or job.job, env=env, artifact_location=artifacts)


def _identity(job: JobConfig, context: Context, store: ModelStore) -> Any:
    from flare_airflow.tracking import RunIdentity

    params: dict[str, Any] = {}
    try:
        run = run_params(context, job)
        params = {
            "rounds": run.rounds,
            "min_clients": run.min_clients,
            "warm_start": run.warm_start,
            **{HPARAM_PREFIX + k: v for k, v in run.hparams.items()},
        }
    except RunParamsError:
        pass  # prepare refuses the run with the reason; nothing is tracked past it
    params["sites"] = sorted(job.sites)
    params["strategy"] = job.aggregator.model_dump(mode="json")
    return RunIdentity(
        dag_id=str(context["ti"].dag_id),
        run_id=run_id_of(context),
        job=job.job,
        store_uri=str(store.root),
        params=flat_params(params),
    )


def _write(
    job: JobConfig,
    context: Context,
    log: Any,
    what: str,
    rounds: Sequence[RoundPoints],
    final: Mapping[str, str] | None = None,
) -> dict[str, str | None] | None:
    """Each tracker of the job gets ``rounds``; one that fails is logged and skipped, never raised.
    Returns the MLflow run's link when MLflow took the write."""
    spec = job.tracking
    assert spec is not None
    link = _write_mlflow(job, context, log, what, rounds, final) if spec.mlflow else None
    if spec.tensorboard:
        _write_tensorboard(job, context, log, what, rounds)
    return link


def _write_mlflow(
    job: JobConfig,
    context: Context,
    log: Any,
    what: str,
    rounds: Sequence[RoundPoints],
    final: Mapping[str, str] | None,
) -> dict[str, str | None] | None:
    from flare_airflow.tracking import TrackingError

    run_points: Points = {}
    sites: dict[str, Points] = {}
    for _, points, by_site in rounds:
        run_points = merge_points(run_points, points)
        for site, site_pts in by_site.items():
            sites[site] = merge_points(sites.get(site, {}), site_pts)
    store = store_for(job)
    assert job.tracking is not None
    try:
        writer = _writer(job, store)
        with writer.session():
            done = writer.write(
                _identity(job, context, store),
                run_points,
                sites,
                final=final,
                register_model=job.tracking.register_model,
            )
    except (TrackingError, TrackingConfigError) as exc:
        log.warning(
            "experiment tracking failed (%s): %s; the run goes on without it, and the next round or a retry of "
            "publish logs what is missing",
            what,
            redact_uris(str(exc)),
        )
        return None
    for line in done["differ"]:
        log.warning("experiment tracking: %s (MLflow keeps the first point of a step)", line)
    log.info(
        "experiment tracking (%s): MLflow experiment %s, run %s at %s",
        what,
        done["experiment_id"],
        done["run_id"],
        redact_uri(writer.tracking_uri),
    )
    if done["model_version"] is not None:
        log.info(
            "experiment tracking (%s): the final model is version %s of registered model %r",
            what,
            done["model_version"],
            job.tracking.register_model,
        )
    return mlflow_link(writer.tracking_uri, str(done["experiment_id"]), str(done["run_id"]))


def _write_tensorboard(job: JobConfig, context: Context, log: Any, what: str, rounds: Sequence[RoundPoints]) -> None:
    from flare_airflow.tracking import TensorBoardWriter, TrackingError

    if not rounds:
        return
    try:
        writer = TensorBoardWriter(tensorboard_root(store_for(job)), job.job, run_id_of(context))
        with writer.session():
            for round_num, points, by_site in rounds:
                writer.write_round(round_num, points, by_site)
    except (TrackingError, TrackingConfigError) as exc:
        log.warning(
            "experiment tracking failed (%s, TensorBoard): %s; the run goes on without it, and a retry of publish "
            "writes what is missing",
            what,
            redact_uris(str(exc)),
        )
        return
    log.info("experiment tracking (%s): TensorBoard event files in %s", what, writer.run_dir)


def track_run_start(job: JobConfig, context: Context, log: Any) -> dict[str, str | None] | None:
    """At the run's start (prepare): refuse a tracking configuration that cannot work; open the run.
    Returns the MLflow run's link (None without MLflow or when the write failed)."""
    spec = job.tracking
    if spec is None:
        return None
    for backend, package in (("mlflow", "mlflow"), ("tensorboard", "tensorboardX")):
        if backend in spec.backend and find_spec(package) is None:
            raise AirflowFailException(
                f"tracking: backend {backend} needs the {package} package where Airflow runs this job's tasks: "
                "pip install 'flare-airflow[tracking]' there, or remove it from tracking.backend"
            )
    try:
        if spec.mlflow:
            _writer(job, store_for(job))
        if spec.tensorboard:
            tensorboard_root(store_for(job))
    except TrackingConfigError as exc:
        raise AirflowFailException(redact_uris(str(exc))) from None
    return _write_mlflow(job, context, log, "run start", [], None) if spec.mlflow else None


def _round(job: JobConfig, run_id: str, store: ModelStore, summary: Mapping[str, Any], log: Any) -> RoundPoints:
    r = int(summary["round"])
    sites: dict[str, Points] = {}
    for site in summary.get("accepted") or ():
        own: Points = {}
        values = site_points(summary, site)
        try:
            record = read_record(store.site_update(job.job, run_id, r, site))
        except FlareAirflowError as exc:
            # The update counted, so its record was read before: a lost record costs its scalars only.
            log.warning("experiment tracking: round %d site %s: no trainer scalars (%s)", r, site, exc)
        else:
            own, problems = tracked_points(record.meta)
            for problem in problems[:5]:
                log.warning("experiment tracking: round %d site %s: a trainer scalar left out: %s", r, site, problem)
            if record.num_samples is not None:
                values["num_samples"] = float(record.num_samples)
        sites[site] = merge_points(at_step(values, r), own)
    return r, at_step(round_points(summary), r), sites


def track_round(job: JobConfig, context: Context, summary: Mapping[str, Any], log: Any) -> None:
    """After a round's aggregation: its run-level points and each counted site's points."""
    if job.tracking is None:
        return
    _write(
        job, context, log, f"round {summary['round']}", [_round(job, run_id_of(context), store_for(job), summary, log)]
    )


def track_publish(
    job: JobConfig,
    context: Context,
    summaries: Sequence[Mapping[str, Any]],
    published: Mapping[str, Any],
    log: Any,
) -> dict[str, str | None] | None:
    """At publish: every round's points (what a failed write left out), the final model, FINISHED.
    Returns the MLflow run's link (None without MLflow or when the write failed)."""
    if job.tracking is None:
        return None
    store, run_id = store_for(job), run_id_of(context)
    rounds = [_round(job, run_id, store, summary, log) for summary in summaries]
    final = {"uri": str(published["model_uri"]), "sha256": str(published["sha256"])}
    return _write(job, context, log, "publish", rounds, final=final)

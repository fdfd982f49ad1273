"""Experiment tracking from the run's own tasks: prepare opens the run, each aggregation logs its
round, publish fills any gap and links the final model (docs/tracking.md).

Sites never talk to the tracker: their numbers come from the round's summary and their update
records. A tracker that is down or refuses a write never fails the federated run: the task log
says why, and the next writer (a later round, publish, or a publish retry) logs what is missing.
Only a configuration error -- a connection that does not exist, a store with no place for the
embedded tracker -- stops the run, and only at its start (prepare).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from importlib.util import find_spec
from typing import Any

from airflow.sdk import Context
from airflow.sdk.exceptions import AirflowFailException

from flare_airflow.core.config import JobConfig
from flare_airflow.core.errors import FlareAirflowError
from flare_airflow.core.model import read_record
from flare_airflow.core.store import ModelStore, local_file
from flare_airflow.core.tracking import (
    Points,
    at_step,
    flat_params,
    merge_points,
    round_points,
    site_points,
    tracked_points,
)
from flare_airflow.operators.common import HPARAM_PREFIX, RunParamsError, run_id_of, run_params, store_for

EMBEDDED_DB = "mlflow.db"
EMBEDDED_ARTIFACTS = "mlflow-artifacts"


class TrackingConfigError(FlareAirflowError):
    """The job's tracking cannot work in this deployment (missing connection, no place for the store)."""


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
    env: dict[str, str] = {}
    if conn.login:
        env["MLFLOW_TRACKING_USERNAME"] = str(conn.login)
        if conn.password:
            env["MLFLOW_TRACKING_PASSWORD"] = str(conn.password)
    elif conn.password:
        env["MLFLOW_TRACKING_TOKEN"] = str(conn.password)
    if extra.get("token"):
        env["MLFLOW_TRACKING_TOKEN"] = str(extra["token"])
    return uri, env


def tracking_target(job: JobConfig, store: ModelStore) -> tuple[str, dict[str, str], str | None]:
    """(tracking URI, environment for the writes, artifact location of a new experiment)."""
    spec = job.tracking
    assert spec is not None
    if spec.conn_id is not None:
        uri, env = _connection_target(spec.conn_id)
        return uri, env, None
    if spec.uri is not None:
        return spec.uri, {}, None
    root = local_file(store.root)
    if root is None:
        raise TrackingConfigError(
            f"tracking: the embedded MLflow store is a SQLite file next to the model store, but the store "
            f"{store.root} is not on this machine's file system; name a tracking server in tracking.conn_id "
            "(an Airflow connection) or a database in tracking.uri"
        )
    root = root.rstrip("/")
    return f"sqlite:///{root}/{EMBEDDED_DB}", {}, f"file://{root}/{EMBEDDED_ARTIFACTS}"


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
    run_points: Points,
    sites: Mapping[str, Points],
    final: Mapping[str, str] | None = None,
) -> None:
    from flare_airflow.tracking import TrackingError

    store = store_for(job)
    try:
        writer = _writer(job, store)
        with writer.session():
            done = writer.write(_identity(job, context, store), run_points, sites, final=final)
    except (TrackingError, TrackingConfigError) as exc:
        log.warning(
            "experiment tracking failed (%s): %s; the run goes on without it, and the next round or a retry of "
            "publish logs what is missing",
            what,
            exc,
        )
        return
    for line in done["differ"]:
        log.warning("experiment tracking: %s (MLflow keeps the first point of a step)", line)
    log.info(
        "experiment tracking (%s): MLflow experiment %s, run %s at %s",
        what,
        done["experiment_id"],
        done["run_id"],
        writer.tracking_uri,
    )


def track_run_start(job: JobConfig, context: Context, log: Any) -> None:
    """At the run's start (prepare): refuse a tracking configuration that cannot work; open the run."""
    if job.tracking is None:
        return
    if find_spec("mlflow") is None:
        raise AirflowFailException(
            "tracking: backend mlflow needs the mlflow package where Airflow runs this job's tasks: "
            "pip install 'flare-airflow[tracking]' there, or remove tracking from the job"
        )
    try:
        _writer(job, store_for(job))
    except TrackingConfigError as exc:
        raise AirflowFailException(str(exc)) from None
    _write(job, context, log, "run start", {}, {})


def _round(
    job: JobConfig, run_id: str, store: ModelStore, summary: Mapping[str, Any], log: Any
) -> tuple[Points, dict[str, Points]]:
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
    return at_step(round_points(summary), r), sites


def track_round(job: JobConfig, context: Context, summary: Mapping[str, Any], log: Any) -> None:
    """After a round's aggregation: its run-level points and each counted site's points."""
    if job.tracking is None:
        return
    run_points, sites = _round(job, run_id_of(context), store_for(job), summary, log)
    _write(job, context, log, f"round {summary['round']}", run_points, sites)


def track_publish(
    job: JobConfig,
    context: Context,
    summaries: Sequence[Mapping[str, Any]],
    published: Mapping[str, Any],
    log: Any,
) -> None:
    """At publish: every round's points (what a failed write left out), the final model, FINISHED."""
    if job.tracking is None:
        return
    store, run_id = store_for(job), run_id_of(context)
    run_points: Points = {}
    sites: dict[str, Points] = {}
    for summary in summaries:
        points, by_site = _round(job, run_id, store, summary, log)
        run_points = merge_points(run_points, points)
        for site, site_pts in by_site.items():
            sites[site] = merge_points(sites.get(site, {}), site_pts)
    final = {"uri": str(published["model_uri"]), "sha256": str(published["sha256"])}
    _write(job, context, log, "publish", run_points, sites, final=final)

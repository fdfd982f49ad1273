"""Experiment tracking from the run's own tasks: prepare opens the run, each aggregation logs its
round, publish fills any gap and links (or registers) the final model (docs/tracking.md). The
trackers: MLflow, TensorBoard event files, or both.

Sites never talk to the tracker: their numbers come from the round's summary and their update
records. A tracker that is down or refuses a write never fails the federated run: the task log
says why, and the next writer (a later round, publish, or a publish retry) logs what is missing.
Only a configuration error -- a connection that does not exist, a store with no place for the
embedded tracker, a destination the deployment does not allow -- stops the run, and only at its
start (prepare).

Where the writes go (the destinations a job may choose among): :mod:`flare_airflow.operators.tracking_target`.
Every URI this module logs goes through :func:`flare_airflow.core.redact.redact_uris` first.
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
from flare_airflow.core.redact import redact_uri, redact_uris
from flare_airflow.core.store import ModelStore
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
from flare_airflow.operators.tracking_target import (
    TrackingConfigError,
    mlflow_link,
    tensorboard_root,
    tracking_target,
)

# (round, its run-level points, each counted site's points)
RoundPoints = tuple[int, Points, dict[str, Points]]


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

"""The MLflow writer: one experiment per job, one parent run per DAG run, one child run per site.

Every write is idempotent, because Airflow re-runs tasks (retries, Clear, ``flare-airflow resume``):
the parent run is found again by its ``flare_airflow.run_key`` tag, a site's child run by its
``flare_airflow.site`` tag under that parent, and only metric points missing at their step are
logged (:func:`flare_airflow.core.tracking.missing_points`).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from flare_airflow.core.errors import FlareAirflowError
from flare_airflow.core.redact import redact_uris
from flare_airflow.core.tracking import Points, missing_points, run_key, sorted_steps

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

TAG_RUN_KEY = "flare_airflow.run_key"
TAG_SITE = "flare_airflow.site"
TAG_PARENT = "mlflow.parentRunId"
# A tracker that is down must not hold a round up: MLflow's HTTP client retries 7 times with
# exponential backoff by default (minutes). These apply unless the deployment sets its own.
HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
}
# MLflow's log_batch limit is 1000 metrics per call.
BATCH = 1000


class TrackingError(FlareAirflowError):
    """The experiment tracker could not be reached or refused a write (the run goes on without it)."""


def preload_mlflow() -> None:
    """Import what a write to MLflow needs, in a process that forks task processes.

    A task process of its own pays ~1.6 CPU-s importing MLflow and ~0.8 CPU-s more for its SQL
    store (SQLAlchemy's models and their mappers, Alembic) before its first write; forked from a
    process that ran this, it pays ~0.1 CPU-s (benchmarks/results/tracking.md). Nothing here opens
    a file, a connection or a thread, so forking afterwards is safe.
    """
    import mlflow.store.tracking.sqlalchemy_store
    import mlflow.tracking  # noqa: F401
    from sqlalchemy.orm import configure_mappers

    configure_mappers()


@dataclass(frozen=True)
class TrackedRun:
    """An MLflow run and, per metric key, the highest step it holds (MLflow keeps a key's point of
    the highest step as its latest, and a search returns it): a key's points above that step are
    new without reading the key's history -- the common case, one round after another."""

    run_id: str
    latest: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, run: Any) -> TrackedRun:
        return cls(str(run.info.run_id), {m.key: int(m.step) for m in run.data.to_proto().metrics})


@dataclass(frozen=True)
class RunIdentity:
    """Which DAG run the tracked run stands for, and what it was asked to do."""

    dag_id: str
    run_id: str
    job: str
    store_uri: str
    params: dict[str, str] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return run_key(self.dag_id, self.run_id)

    def tags(self) -> dict[str, str]:
        return {
            TAG_RUN_KEY: self.key,
            "flare_airflow.dag_id": self.dag_id,
            "flare_airflow.run_id": self.run_id,
            "flare_airflow.job": self.job,
            "flare_airflow.store": self.store_uri,
            "mlflow.runName": self.run_id,
        }


@contextlib.contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    """Set ``values`` (credentials from the connection, HTTP limits) for the writes, then restore.

    MLflow's REST client reads credentials from these variables on every request; they live only
    in this task process and only while it writes.
    """
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in before.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


class MlflowWriter:
    """Writes one DAG run's numbers to MLflow at ``tracking_uri`` (a SQLite file, a server).

    Parameters
    ----------
    tracking_uri:
        ``sqlite:///path/mlflow.db`` (the embedded store) or a server's ``http(s)://`` URI.
    experiment:
        The experiment name (the job's name by default).
    env:
        Environment for the writes: a server connection's credentials (``MLFLOW_TRACKING_USERNAME``,
        ``MLFLOW_TRACKING_PASSWORD``, ``MLFLOW_TRACKING_TOKEN``).
    artifact_location:
        Where a new experiment keeps artifacts (next to the embedded store; the server's own otherwise).
    """

    def __init__(
        self,
        tracking_uri: str,
        experiment: str,
        *,
        env: Mapping[str, str] | None = None,
        artifact_location: str | None = None,
    ) -> None:
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.env = {**{k: v for k, v in HTTP_DEFAULTS.items() if k not in os.environ}, **(env or {})}
        self.artifact_location = artifact_location
        self._client: MlflowClient | None = None
        self._experiment_id: str | None = None

    @contextlib.contextmanager
    def session(self) -> Iterator[MlflowWriter]:
        """Writes inside this block reach the tracker; any failure becomes a :class:`TrackingError`."""
        with _environment(self.env):
            try:
                yield self
            except TrackingError:
                raise
            except Exception as exc:  # MLflow, requests and SQLAlchemy raise many types: all mean "not tracked"
                raise TrackingError(f"{type(exc).__name__}: {_short(exc)}") from exc

    @property
    def client(self) -> MlflowClient:
        if self._client is None:
            from mlflow.tracking import MlflowClient

            self._client = MlflowClient(tracking_uri=self.tracking_uri)
        return self._client

    def experiment_id(self) -> str:
        if self._experiment_id is None:
            from mlflow.exceptions import MlflowException

            found = self.client.get_experiment_by_name(self.experiment)
            if found is None:
                try:
                    self._experiment_id = self.client.create_experiment(
                        self.experiment, artifact_location=self.artifact_location
                    )
                except MlflowException:
                    # Another run of the job created it meanwhile.
                    found = self.client.get_experiment_by_name(self.experiment)
                    if found is None:
                        raise
            if found is not None:
                if found.lifecycle_stage == "deleted":
                    raise TrackingError(
                        f"MLflow experiment {self.experiment!r} is deleted: restore it (mlflow experiments restore) "
                        "or name another one in tracking.experiment"
                    )
                self._experiment_id = found.experiment_id
        assert self._experiment_id is not None
        return self._experiment_id

    def parent_run(self, who: RunIdentity) -> TrackedRun:
        """The MLflow run of this DAG run: found by its tag, else created with tags and params."""
        exp = self.experiment_id()
        runs = self.client.search_runs([exp], filter_string=f"tags.`{TAG_RUN_KEY}` = '{who.key}'", max_results=1)
        if runs:
            return TrackedRun.of(runs[0])
        run = self.client.create_run(exp, tags=who.tags(), run_name=who.run_id)
        run_id = str(run.info.run_id)
        self._params(run_id, who.params)
        return TrackedRun(run_id)

    def _params(self, run_id: str, params: Mapping[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in sorted(params.items())]
        for start in range(0, len(items), 100):
            self.client.log_batch(run_id, params=items[start : start + 100])

    def site_runs(self, parent: str, who: RunIdentity, sites: list[str]) -> dict[str, TrackedRun]:
        """Site -> child run under ``parent``; created for the sites that have none."""
        exp = self.experiment_id()
        found: dict[str, TrackedRun] = {}
        for run in self.client.search_runs([exp], filter_string=f"tags.`{TAG_PARENT}` = '{parent}'", max_results=1000):
            site = run.data.tags.get(TAG_SITE)
            if site and site not in found:
                found[site] = TrackedRun.of(run)
        for site in sites:
            if site not in found:
                tags = {TAG_PARENT: parent, TAG_SITE: site, "flare_airflow.job": who.job}
                found[site] = TrackedRun(str(self.client.create_run(exp, tags=tags, run_name=site).info.run_id))
        return found

    def log_points(self, run: TrackedRun, points: Points) -> list[str]:
        """Log the points ``run`` does not hold yet; returns the ones logged before with another value.

        A key's history is read only when a wanted step is at or below the highest step the run
        holds for it (a retried round, a publish filling gaps); otherwise every point is new.
        """
        from mlflow.entities import Metric

        logged = {
            key: {m.step: m.value for m in self.client.get_metric_history(run.run_id, key)}
            for key, steps in points.items()
            if key in run.latest and steps and min(steps) <= run.latest[key]
        }
        todo, differ = missing_points(points, logged)
        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, step) for key, step, value in sorted_steps(todo)]
        for start in range(0, len(metrics), BATCH):
            self.client.log_batch(run.run_id, metrics=metrics[start : start + BATCH])
        return differ

    def write(
        self,
        who: RunIdentity,
        run_points: Points,
        site_points: Mapping[str, Points],
        *,
        final: Mapping[str, str] | None = None,
        register_model: str | None = None,
    ) -> dict[str, Any]:
        """Write a run's points (and, with ``final``, its published model and FINISHED status; with
        ``register_model`` too, that model as a version of the registered model of that name).

        Returns the MLflow ids and what was already logged with another value (kept: MLflow cannot
        replace a point).
        """
        tracked = self.parent_run(who)
        parent = tracked.run_id
        differ = self.log_points(tracked, run_points)
        children = self.site_runs(parent, who, sorted(site_points)) if site_points else {}
        for site, points in sorted(site_points.items()):
            differ += [f"{site}: {d}" for d in self.log_points(children[site], points)]
        if final is not None:
            for key, value in sorted(final.items()):
                self.client.set_tag(parent, f"flare_airflow.final_model.{key}", value)
            for child in children.values():
                self.client.set_terminated(child.run_id, "FINISHED")
            self.client.set_terminated(parent, "FINISHED")
        version = None
        if final is not None and register_model is not None:
            version = self.register(register_model, parent, final)
        return {"experiment_id": self.experiment_id(), "run_id": parent, "differ": differ, "model_version": version}

    def register(self, name: str, parent: str, final: Mapping[str, str]) -> str:
        """The version of registered model ``name`` that holds this run's final model; created once.

        A re-run publish finds the version by its run id; a new DAG run adds a version.
        """
        from mlflow.exceptions import MlflowException

        try:
            self.client.create_registered_model(name, description="federated global models (flare-airflow)")
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        for version in self.client.search_model_versions(f"name = '{name}' and run_id = '{parent}'"):
            return str(version.version)
        tags = {"flare_airflow.sha256": final["sha256"]}
        created = self.client.create_model_version(name, source=final["uri"], run_id=parent, tags=tags)
        return str(created.version)


def _short(exc: BaseException) -> str:
    text = redact_uris(" ".join(str(exc).split()))
    return text[:800] + ("…" if len(text) > 800 else "")

"""The job's data watch: ``trigger.on_data.wait`` and a cron ``schedule`` as the fallback.

Airflow 3.3 gives the min_sites run (a partitioned-asset timetable with ``MinimumCount``) but
not the rest: its wait policies have no timeout, no timetable is both partitioned and cron, and
no public API clears the partitions a pending run has collected. So a small companion DAG,
``<job dag>_data_watch``, runs every few minutes (or on the cron); its one task reads what the
job's runs already trained on (each run's ``prepare`` records it), decides
(:func:`~flare_airflow.core.data_ready.decide_run`) and triggers the job's DAG with ``conf.sites``
-- the form's path. Every run's ``prepare`` then trains only on announcements no earlier run used,
whoever started it.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from airflow.sdk import BaseOperator, Context
from airflow.sdk.exceptions import AirflowFailException

from flare_airflow.core.config import JobConfig
from flare_airflow.core.data_ready import SITE_DATA_ASSET, announcement_id, decide_run, fresh_sites
from flare_airflow.core.errors import FlareAirflowError

ACTIVE_STATES = ("queued", "running")
_RUNS_LOOKED_AT = 100  # announcements older than the window never count: the last 100 runs cover it


class DataHistoryError(FlareAirflowError):
    """The REST API could not say what the job's runs trained on; the message says what to do."""


@dataclass
class DataHistory:
    """What the job's DAG runs already did with the sites' announcements, from the REST API."""

    events: list[dict[str, Any]] = field(default_factory=list)  # every announcement, newest first
    used: dict[tuple[str, str, str], str] = field(default_factory=dict)  # announcement -> run that trained on it
    last_run_at: dt.datetime | None = None
    active_run: str | None = None  # a run still queued or running


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


def _read(call: Callable[..., Any], path: str, what: str, **params: Any) -> Any:
    """``GET path`` as JSON; an answer >= 400 raises: an unread history must never look empty
    (the watch would decide on no data and start nothing, or the wrong run)."""
    resp = call("GET", path, params=params)
    if resp.status_code >= 400:
        raise DataHistoryError(f"cannot read {what} ({resp.status_code}: {resp.text[:200]})")
    return resp.json()


def data_history(
    call: Callable[..., Any], dag_id: str, prepare_task_id: str, *, skip_run: str | None = None
) -> DataHistory:
    """Read the announcements and, run by run, which of them ``prepare`` recorded as trained on.

    ``call(method, path, **kw)``: :func:`flare_airflow.hooks.pools.api_client`'s. ``skip_run``:
    the calling run, which is not "earlier".
    """
    history = DataHistory()
    runs = _read(
        call, f"/api/v2/dags/{dag_id}/dagRuns", f"the runs of {dag_id}", order_by="-run_after", limit=_RUNS_LOOKED_AT
    )
    for run in runs.get("dag_runs", []):
        run_id = run.get("dag_run_id")
        if run_id == skip_run or not isinstance(run_id, str):
            continue
        after = dt.datetime.fromisoformat(run["run_after"]) if run.get("run_after") else None
        if after is not None and (history.last_run_at is None or after > history.last_run_at):
            history.last_run_at = after
        if run.get("state") in ACTIVE_STATES and history.active_run is None:
            history.active_run = run_id
        xcom = call(
            "GET", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{prepare_task_id}/xcomEntries/return_value"
        )
        if xcom.status_code == 404:
            continue  # prepare did not finish: that run trained on nothing
        if xcom.status_code >= 400:
            raise DataHistoryError(f"cannot read what run {run_id} trained on ({xcom.status_code})")
        prepared = _json(xcom.json().get("value"))
        data = prepared.get("data") if isinstance(prepared, Mapping) else None
        for site, seen in (data or {}).items():
            if isinstance(seen, Mapping) and "reason" not in seen and seen.get("version") and seen.get("announced_at"):
                key = announcement_id(str(site), str(seen["version"]), str(seen["announced_at"]))
                history.used.setdefault(key, run_id)  # newest first: a re-run keeps its first user
    found = _read(call, "/api/v2/assets", "the site-data asset", name_pattern=SITE_DATA_ASSET, limit=10)
    ids = [a["id"] for a in found.get("assets", []) if a.get("name") == SITE_DATA_ASSET]
    if ids:
        events = _read(
            call, "/api/v2/assets/events", "the sites' announcements", asset_id=ids[0], limit=500, order_by="-timestamp"
        )
        for event in events.get("asset_events", []):
            history.events.append(
                {"partition_key": event.get("partition_key"), "extra": event.get("extra") or {},
                 "timestamp": event.get("timestamp")}
            )  # fmt: skip
    return history


def read_history(dag_id: str, prepare_task_id: str, *, skip_run: str | None = None) -> DataHistory:
    """:func:`data_history` through the ``flare_airflow_api`` connection."""
    from flare_airflow.hooks.pools import API_CONN_ID, api_client

    with api_client(API_CONN_ID, what=f"read what the runs of {dag_id} trained on", error=DataHistoryError) as call:
        return data_history(call, dag_id, prepare_task_id, skip_run=skip_run)


def fallback_since(schedule: str | None, now: dt.datetime) -> dt.datetime | None:
    """The start of the cron period that ended last: no run since then, and the fallback runs."""
    if schedule is None:
        return None
    from croniter import croniter

    from flare_airflow.core.config.job import _CRON_PRESETS

    ticks = croniter(_CRON_PRESETS.get(schedule, schedule), now)
    ticks.get_prev(dt.datetime)
    previous: dt.datetime = ticks.get_prev(dt.datetime)
    return previous


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def watch_interval(job: JobConfig) -> dt.timedelta | str:
    """How often the watch looks: a twelfth of the wait (10 s to 15 min), else on the cron itself."""
    assert job.on_data is not None
    wait = job.on_data.wait_seconds
    if wait is None:
        assert job.schedule is not None
        return job.schedule
    return dt.timedelta(seconds=min(max(wait // 12, 10), 900))


class DataWatchOperator(BaseOperator):
    """Start a run of ``watched_dag_id`` over the fresh sites when the wait expired or the fallback is due.

    Returns the decision (``sites``, ``why``, the ``run_id`` it started); the job's page shows ``why``.

    :param job: the job.
    :param watched_dag_id: the job's DAG.
    :param prepare_task_id: the id of the job DAG's ``prepare`` task.
    """

    ui_color = "#e8f0fe"

    def __init__(self, *, job: JobConfig, watched_dag_id: str, prepare_task_id: str = "prepare", **kwargs: Any):
        super().__init__(**kwargs)
        self.job = job
        self.watched_dag_id = watched_dag_id
        self.prepare_task_id = prepare_task_id

    def execute(self, context: Context) -> dict[str, Any]:
        from flare_airflow.hooks.pools import API_CONN_ID, api_client
        from flare_airflow.operators.data_ready import announcement_verifier

        on_data = self.job.on_data
        assert on_data is not None
        now = _now()
        try:
            with api_client(API_CONN_ID, what="watch the sites' data", error=DataHistoryError) as call:
                history = data_history(call, self.watched_dag_id, self.prepare_task_id)
                if history.active_run is not None:
                    why = f"run {history.active_run} of {self.watched_dag_id} has not finished: the watch waits for it"
                    self.log.info("%s", why)
                    return {"sites": [], "why": why}
                data = fresh_sites(
                    history.events, self.job.sites, window_seconds=on_data.window_seconds, now=now,
                    verify=announcement_verifier(self.log), used=history.used,
                )  # fmt: skip
                decision = decide_run(
                    data, min_sites=on_data.min_sites, quorum=self.job.min_clients, wait_seconds=on_data.wait_seconds,
                    now=now, fallback_since=fallback_since(self.job.schedule, now), last_run_at=history.last_run_at,
                )  # fmt: skip
                self.log.info("%s", decision.why)
                out: dict[str, Any] = {"sites": list(decision.sites), "why": decision.why}
                if decision.sites:
                    resp = call(
                        "POST", f"/api/v2/dags/{self.watched_dag_id}/dagRuns",
                        json={"logical_date": None, "conf": {"sites": list(decision.sites)}, "note": decision.why},
                    )  # fmt: skip
                    if resp.status_code >= 400:
                        raise DataHistoryError(
                            f"the Airflow API refused the run over {', '.join(decision.sites)} "
                            f"({resp.status_code}: {resp.text[:200]})"
                        )
                    out["run_id"] = resp.json().get("dag_run_id")
                return out
        except DataHistoryError as exc:
            raise AirflowFailException(f"the data watch of {self.watched_dag_id} cannot decide: {exc}") from None

"""What the Federated runs page shows for one run, computed from what Airflow's REST API returns
(task instances, XComs, the run) and from the run's ``metrics.json``. No Airflow import: the
FastAPI app fetches, this module shapes, :mod:`flare_airflow.ui.page` renders.

Per-round rows are :func:`flare_airflow.core.report.round_row` rows -- the same rows the publish
task writes into ``metrics.json`` -- so the page and the file cannot disagree: once a run is
published the page reads the file; while it runs it builds the rows of the finished rounds from
their aggregation summaries (XCom) with the same function.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from flare_airflow.core.report import TRAIN_LOSS_KEYS, round_row
from flare_airflow.core.tracking import mlflow_run_url

AGGREGATE_TASK = "global_model"  # the builder's name for a round's aggregation task
_AGGREGATE = re.compile(r"^(.*?)round_(\d+)\.global_model\Z")
FINISHED_RUN_STATES = frozenset({"success", "failed"})
FEDERATED_TAG = "federated-learning"


@dataclass
class SiteCell:
    """One site job (one site, one round): its task's state and what it sent."""

    task_id: str
    state: str  # the task's state, or "not counted" when it succeeded but the round rejected its update
    try_number: int = 0
    num_samples: int | None = None
    train_loss: float | None = None
    reason: str | None = None  # why it did not count / failed (from the round's summary)
    # The site's own privacy account of this update (its task's XCom ``privacy``): ε after this
    # round at its δ, and how many releases it counted, when its filters add noise.
    epsilon: float | None = None
    releases: int | None = None


@dataclass
class RunFailure:
    """A task of the run itself (prepare, publish, the verdict...) that failed or waits to retry."""

    task_id: str
    state: str
    try_number: int
    reason: str | None


# States of a run-level task that the page lists with its reason.
FAILURE_STATES = frozenset({"failed", "upstream_failed", "up_for_retry"})


@dataclass
class RoundView:
    round: int
    aggregate_task_id: str
    aggregate_state: str
    try_number: int = 0
    sites: dict[str, SiteCell] = field(default_factory=dict)
    valid: int | None = None  # updates counted (from the summary), None while not aggregated
    reason: str | None = None  # why the aggregation failed (its XCom ``failure``), e.g. no quorum
    epsilon: float | None = None  # the run's ε after this round (its summary's ``privacy``), None without noise
    strategy: str | None = None  # the strategy that aggregated the round (its summary's ``strategy``)


@dataclass
class RunView:
    dag_id: str
    run_id: str
    state: str
    sites: list[str]
    rounds: list[RoundView]
    rows: list[dict[str, Any]]  # report rows (core.report.round_row) of the aggregated rounds
    min_clients: int | None
    params: dict[str, Any]
    rows_from: str  # "metrics.json" or "xcom"
    failures: list[RunFailure] = field(default_factory=list)  # the run's own tasks that failed
    # The run's MLflow run (experiment_id, run_id, url or None) when the job tracks with MLflow.
    mlflow_run: dict[str, str | None] | None = None
    # The aggregation: the strategy's name (the latest aggregated round's) and the job's parameters for it.
    strategy: str | None = None
    strategy_params: dict[str, Any] = field(default_factory=dict)
    # Runs driven by the sites' data: site -> the data it trained on (version, samples,
    # announced_at) or why it sat the run out (reason); empty for other runs.
    site_data: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.state in FINISHED_RUN_STATES


def federated_prefix(task_ids: list[str]) -> str:
    """The task-id prefix of the job's tasks: ``""`` in a DAG from ``build_dag``, ``"<group>."``
    for a ``federated_task_group`` inside a DAG of your own (the first such group found)."""
    found = sorted(m.group(1) for t in task_ids if (m := _AGGREGATE.match(t)))
    return found[0] if found else ""


def task_layout(task_ids: list[str], prefix: str = "") -> tuple[list[int], list[str]]:
    """Rounds and sites from the task ids ``<prefix>round_<n>.<site>`` and ``<prefix>round_<n>.global_model``."""
    pattern = re.compile(rf"^{re.escape(prefix)}round_(\d+)\.([^.]+)\Z")
    rounds: set[int] = set()
    sites: list[str] = []
    for task_id in task_ids:
        m = pattern.match(task_id)
        if not m:
            continue
        rounds.add(int(m.group(1)))
        if m.group(2) != AGGREGATE_TASK and m.group(2) not in sites:
            sites.append(m.group(2))
    return sorted(rounds), sorted(sites)


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _epsilon(summary: Mapping[str, Any]) -> float | None:
    value = _mapping(summary.get("privacy")).get("epsilon")
    return float(value) if isinstance(value, int | float) else None


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _releases(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def train_loss(metrics: Mapping[str, Any] | None) -> float | None:
    for key in TRAIN_LOSS_KEYS:
        value = (metrics or {}).get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    return None


def build_run_view(
    dag_id: str,
    run: Mapping[str, Any],
    task_instances: Mapping[str, Mapping[str, Any]],
    xcoms: Mapping[str, Any],
    metrics: Mapping[str, Any] | None,
    failures: Mapping[str, str] | None = None,
    mlflow_ui: str | None = None,
) -> RunView:
    """The page's model of one run.

    ``task_instances``: task id -> the REST API's task instance (``state``, ``try_number``).
    ``xcoms``: task id -> that task's ``return_value`` XCom (absent when it has none).
    ``metrics``: the published ``metrics.json`` or None.
    ``failures``: task id -> the reason a failed task left in its XCom ``failure``.
    ``mlflow_ui``: ``[flare_airflow] mlflow_ui_url`` now (links to runs not tracked on a server).
    """
    failures = failures or {}
    prefix = federated_prefix(list(task_instances))
    rounds, sites = task_layout(list(task_instances), prefix)
    prepare = _mapping(xcoms.get(prefix + "prepare"))
    sat_out = {str(k): str(v) for k, v in _mapping(prepare.get("sat_out")).items()}
    requested = prepare.get("rounds") if isinstance(prepare.get("rounds"), int) else None
    summaries: dict[int, Mapping[str, Any]] = {}
    for r in rounds:
        summary = xcoms.get(f"{prefix}round_{r}.{AGGREGATE_TASK}")
        if isinstance(summary, Mapping) and summary.get("round") == r:
            summaries[r] = summary
    if metrics and isinstance(metrics.get("rounds"), list):
        rows = [dict(row) for row in metrics["rounds"]]
        rows_from = "metrics.json"
    else:
        rows = [round_row(summaries[r], len(sites)) for r in sorted(summaries)]
        rows_from = "xcom"
    views = []
    for r in rounds:
        summary = summaries.get(r, {})
        rejected = dict(summary.get("rejected") or {})
        agg_id = f"{prefix}round_{r}.{AGGREGATE_TASK}"
        view = RoundView(
            round=r,
            aggregate_task_id=agg_id,
            aggregate_state=str(task_instances.get(agg_id, {}).get("state") or "none"),
            try_number=int(task_instances.get(agg_id, {}).get("try_number") or 0),
            valid=len(summary["accepted"]) if isinstance(summary.get("accepted"), list) else None,
            reason=failures.get(agg_id),
            epsilon=_epsilon(summary),
            strategy=str(summary["strategy"]) if isinstance(summary.get("strategy"), str) else None,
        )
        site_metrics = dict(_mapping(summary.get("site_metrics")))  # sealed (a str) until opened
        for site in sites:
            task_id = f"{prefix}round_{r}.{site}"
            ti = task_instances.get(task_id, {})
            sent = _mapping(xcoms.get(task_id))
            state = str(ti.get("state") or "none")
            reason = rejected.get(site) or failures.get(task_id) or sat_out.get(site)
            if state == "success" and site in rejected:
                state = "not counted"
            samples = sent.get("num_samples")
            account = _mapping(sent.get("privacy"))
            view.sites[site] = SiteCell(
                task_id=task_id,
                state=state,
                try_number=int(ti.get("try_number") or 0),
                num_samples=samples if isinstance(samples, int) else None,
                train_loss=train_loss(sent.get("metrics")) if sent else train_loss(site_metrics.get(site)),
                reason=str(reason) if reason is not None else None,
                epsilon=_number(account.get("epsilon")),
                releases=_releases(account.get("releases")),
            )
        views.append(view)
    params = {
        "conf": dict(run.get("conf") or {}),
        "rounds": requested,
        "min_clients": prepare.get("min_clients"),
        "hparams": dict(prepare.get("hparams") or {}),
        "round 0 model": prepare.get("source"),
    }
    if prepare.get("budget_note"):
        params["privacy budget"] = prepare["budget_note"]
    in_rounds = re.compile(rf"^{re.escape(prefix)}round_\d+\.")
    run_failures = [
        RunFailure(
            task_id=task_id,
            state=str(ti.get("state")),
            try_number=int(ti.get("try_number") or 0),
            reason=failures.get(task_id),
        )
        for task_id, ti in sorted(task_instances.items())
        if ti.get("state") in FAILURE_STATES and not in_rounds.match(task_id)
    ]
    last = summaries[max(summaries)] if summaries else {}
    return RunView(
        dag_id=dag_id,
        run_id=str(run.get("dag_run_id") or run.get("run_id")),
        state=str(run.get("state") or "none"),
        sites=sites,
        rounds=views,
        rows=rows,
        min_clients=prepare.get("min_clients") if isinstance(prepare.get("min_clients"), int) else None,
        params=params,
        rows_from=rows_from,
        failures=run_failures,
        strategy=next((v.strategy for v in reversed(views) if v.strategy), None),
        strategy_params={str(k): v for k, v in _mapping(last.get("strategy_params")).items()},
        mlflow_run=_mlflow_run(
            mlflow_ui, _mapping(xcoms.get(prefix + "publish")).get("mlflow_run"), prepare.get("mlflow_run")
        ),
        site_data=_site_data(prepare, sat_out),
    )


def _site_data(prepare: Mapping[str, Any], sat_out: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """What each site trained on in this run (``prepare``'s ``data``), or why it sat it out."""
    data = _mapping(prepare.get("data"))
    if not data and not sat_out:
        return {}
    out = {str(site): dict(_mapping(value)) for site, value in data.items()}
    for site, reason in sat_out.items():
        out.setdefault(site, {})["reason"] = reason
    return out


def latest_announcements(events: list[Mapping[str, Any]], dag_id: str) -> dict[str, dict[str, Any]]:
    """Per site: its latest data announcement (version, samples, when) and the run of ``dag_id``
    that consumed it, if one did -- from the REST API's events of the site data asset."""
    out: dict[str, dict[str, Any]] = {}
    for event in sorted(events, key=lambda e: str(e.get("timestamp"))):
        site = event.get("partition_key")
        if not isinstance(site, str):
            continue
        extra = _mapping(event.get("extra"))
        runs = [r for r in event.get("created_dagruns") or [] if _mapping(r).get("dag_id") == dag_id]
        out[site] = {
            "version": extra.get("version"),
            "samples": extra.get("samples"),
            "announced_at": extra.get("announced_at") or event.get("timestamp"),
            "run_id": str(runs[-1].get("run_id")) if runs else None,
        }
    return out


def mark_used_by(latest: dict[str, dict[str, Any]], prepared: Any, run_id: str) -> None:
    """Name ``run_id`` as the consumer of each latest announcement its ``prepare`` trained on.

    A run the data watch (or the form) started consumed no asset event in Airflow's records; its
    ``prepare``'s ``data`` says which announcements it trained on (an entry with a ``reason`` did not).
    """
    data = _mapping(_mapping(prepared).get("data"))
    for site, announced in latest.items():
        seen = _mapping(data.get(site))
        if announced.get("run_id") or not seen or "reason" in seen:
            continue
        if (seen.get("version"), seen.get("announced_at")) == (announced.get("version"), announced.get("announced_at")):
            announced["run_id"] = run_id


def _mlflow_run(mlflow_ui: str | None, *candidates: Any) -> dict[str, str | None] | None:
    """The first well-formed MLflow link of the run's XComs (publish's, then prepare's), resolved now.

    A run tracked on a server links to that server's UI (its ``server``); any other (the embedded
    store) to ``mlflow_ui``, the deployment's ``[flare_airflow] mlflow_ui_url`` as set now -- also for
    links written before they were resolved here, whose stored ``url`` is the fallback. An XCom is
    any task's to write: only ids and an http(s) URL get onto the page.
    """
    for found in candidates:
        if not isinstance(found, Mapping):
            continue
        experiment, run = found.get("experiment_id"), found.get("run_id")
        if not (isinstance(experiment, str) and experiment and isinstance(run, str) and run):
            continue
        ids: dict[str, str | None] = {"experiment_id": experiment, "run_id": run}
        server = found.get("server")
        if isinstance(server, str) and server:
            url: Any = mlflow_run_url(server.rstrip("/"), experiment, run)
        elif mlflow_ui:
            url = mlflow_run_url(mlflow_ui.rstrip("/"), experiment, run)
        else:
            url = None if "server" in found else found.get("url")
        ok = isinstance(url, str) and url.startswith(("http://", "https://"))
        return {**ids, "url": url if ok else None}
    return None


@dataclass(frozen=True)
class Series:
    name: str
    points: list[tuple[int, float]]  # (round, value), one per round that has the value


@dataclass(frozen=True)
class Chart:
    key: str
    title: str
    y_label: str
    series: list[Series]
    reference: tuple[str, float] | None = None  # a horizontal line (name, value): the quorum
    integer_y: bool = False


def _points(rows: list[dict[str, Any]], value: Any) -> list[tuple[int, float]]:
    out = []
    for row in rows:
        v = value(row)
        if isinstance(v, int | float) and not isinstance(v, bool):
            out.append((int(row["round"]), float(v)))
    return out


def charts(view: RunView) -> list[Chart]:
    """The four per-round charts, one point per aggregated round."""
    rows = view.rows
    site_series = [
        Series(site, _points(rows, lambda row, s=site: train_loss((row.get("site_metrics") or {}).get(s))))
        for site in view.sites
    ]
    return [
        Chart(
            "accuracy",
            "Global model accuracy (held-out)",
            "accuracy",
            [Series("global accuracy", _points(rows, lambda row: (row.get("evaluation") or {}).get("accuracy")))],
        ),
        Chart(
            "loss",
            "Global model loss (held-out) and mean training loss",
            "loss",
            [
                Series("global loss", _points(rows, lambda row: (row.get("evaluation") or {}).get("loss"))),
                Series("mean train loss", _points(rows, lambda row: row.get("train_loss"))),
            ],
        ),
        Chart("site_loss", "Training loss per site", "train loss", site_series),
        Chart(
            "valid",
            "Valid updates per round",
            "updates",
            [Series("valid updates", _points(rows, lambda row: row.get("sites_valid")))],
            reference=("min_clients", float(view.min_clients)) if view.min_clients is not None else None,
            integer_y=True,
        ),
    ]

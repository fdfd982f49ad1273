"""Publishing a run: its final model, metrics, plot, the job's ``latest.json`` and its Asset."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from airflow.sdk import Asset, BaseOperator, Context
from airflow.sdk.exceptions import AirflowFailException

from flare_airflow.core.config import JobConfig
from flare_airflow.core.model import FLModel, atomic_write, read_artifact, write_artifact
from flare_airflow.core.page_paths import run_page_path
from flare_airflow.core.report import format_table, round_row
from flare_airflow.core.trust import TrustError
from flare_airflow.operators.common import (
    RunParamsError,
    failure_to_xcom,
    run_id_of,
    run_params,
    store_for,
    task_states,
)
from flare_airflow.operators.lineage import LineageMixin
from flare_airflow.operators.plots import plot_rounds
from flare_airflow.operators.tracking import track_publish
from flare_airflow.operators.trust import open_site_metrics
from flare_airflow.operators.verdict import resume_hint


def final_model_asset(job: JobConfig) -> Asset:
    """The Asset a successful run updates: downstream DAGs can be scheduled on it.

    Its identity is the job's alone (the URI is the name): where the job keeps its models is not
    part of it. Airflow keeps one active Asset per name and per URI, so an Asset whose URI was the
    store's ``latest.json`` became a second, inactive Asset with the same name when a job's
    ``store`` moved -- its events were lost, and ``publish`` failed before it ran. Each event's
    ``extra`` says where that run's model is (``model_uri``).
    """
    return Asset(name=f"flare_airflow.{job.job}.global_model")


class PublishOperator(LineageMixin, BaseOperator):
    """Publish a run: final model, metrics JSON, plot, the job's ``latest`` pointer and its Asset.

    Runs when no round failed (rounds skipped by the form are fine). Writes under
    ``<store>/<job>/<run>/final/`` and updates ``<store>/<job>/latest.json``, which warm starts read.
    """

    ui_color = "#c6dbef"

    def __init__(
        self,
        *,
        job: JobConfig,
        aggregate_task_ids: Sequence[str] = (),
        prepare_task_id: str | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("trigger_rule", "none_failed")
        kwargs.setdefault("outlets", [final_model_asset(job)])
        super().__init__(**kwargs)
        self.job = job
        self.aggregate_task_ids = list(aggregate_task_ids)
        self.prepare_task_id = prepare_task_id

    def _requested_rounds(self, context: Context) -> list[dict[str, Any]]:
        """The summaries of every round this run asked for, checked; refuses with what to clear or run.

        Publishing is the run's verdict, and a Clear in the UI can leave any mix of states behind
        (a skipped later round, a failed round re-run without its successors, a site re-run after
        its round was aggregated). So the final model is published only when every requested
        round's aggregation succeeded in this run, and each round's model was made of exactly the
        updates its site tasks hold now.
        """
        ti = context["ti"]
        try:
            rounds = run_params(context, self.job).rounds
        except RunParamsError as exc:
            # prepare failed on the same and no round ran. Failed, not skipped: publish is the
            # leaf that decides the run's state, and a skipped leaf would make the run a success.
            raise AirflowFailException(f"nothing published: invalid run parameters ({exc})") from None
        requested = self.aggregate_task_ids[:rounds]
        states = task_states(context, requested)
        summaries: list[dict[str, Any]] = []
        for r, task_id in enumerate(requested, start=1):
            summary = ti.xcom_pull(task_ids=task_id)
            state = states.get(task_id, "success")
            if state != "success" or not isinstance(summary, dict) or summary.get("round") != r:
                got = f"is {state or 'cleared, not run again'}" if state != "success" else "left no summary"
                raise AirflowFailException(
                    f"round {r} produced no global model in this run (its aggregation task {task_id} {got}); "
                    f"this run asked for {rounds} round(s), so publishing round {r - 1}'s model as final would be "
                    f"wrong; nothing published: {resume_hint(context, r)}"
                )
            self._check_sites_unchanged(context, task_id, summary)
            summaries.append(summary)
        if not summaries:
            raise AirflowFailException("this DAG has no rounds; nothing to publish")
        return summaries

    def _data_lineage(self, context: Context) -> dict[str, Any]:
        """What this run trained on: its sites and each one's data version (as ``prepare`` recorded
        it), so a published model can be traced to the data that made it."""
        prepared = context["ti"].xcom_pull(task_ids=self.prepare_task_id) if self.prepare_task_id else None
        if not isinstance(prepared, dict) or "participants" not in prepared:
            return {}
        data = prepared.get("data") or {}
        return {
            "participants": list(prepared["participants"]),
            "data_versions": {s: (data.get(s) or {}).get("version") for s in prepared["participants"]},
            "data": data,
            "sat_out": prepared.get("sat_out") or {},
        }

    def _check_sites_unchanged(self, context: Context, aggregate_task_id: str, summary: dict[str, Any]) -> None:
        """Refuse when a site task of the round ran again after the round was aggregated."""
        r, counted = summary["round"], summary.get("site_sha256")
        dag = getattr(self, "dag", None)
        aggregate = dag.get_task(aggregate_task_id) if dag is not None else None
        site_task_ids: dict[str, str] = dict(getattr(aggregate, "site_task_ids", None) or {})
        if not isinstance(counted, dict) or not site_task_ids:
            return  # a round aggregated without task ids (or by an older version): nothing to compare
        ti = context["ti"]
        now: dict[str, str] = {}
        for site, task_id in site_task_ids.items():
            update = ti.xcom_pull(task_ids=task_id)
            if isinstance(update, dict) and update.get("sha256"):
                now[site] = str(update["sha256"])
        changed = sorted(s for s in set(now) | set(counted) if now.get(s) != counted.get(s))
        if changed:
            raise AirflowFailException(
                f"round {r}'s global model is stale: site task(s) {', '.join(changed)} of round {r} ran again after "
                f"the round was aggregated, so the model does not reflect their current outcome; nothing "
                f"published: {resume_hint(context, r)}"
            )

    @failure_to_xcom
    def execute(self, context: Context) -> dict[str, Any]:
        summaries = self._requested_rounds(context)
        run_id = run_id_of(context)
        try:
            # Strict mode: each round's per-site metrics, sealed in XCom, for metrics.json and tracking.
            summaries = [open_site_metrics(s, job=self.job.job, run_id=run_id) for s in summaries]
        except TrustError as exc:
            raise AirflowFailException(f"nothing published: {exc}") from None
        rows = [round_row(s, len(self.job.sites)) for s in summaries]
        last = summaries[-1]
        store = store_for(self.job)
        params, record = read_artifact(store.resolve_uri(last["global_uri"]))
        if record.sha256 != last["sha256"]:
            raise AirflowFailException(
                f"{last['global_uri']} changed after round {last['round']} wrote it (sha256 {record.sha256[:12]}…, "
                f"recorded {str(last['sha256'])[:12]}…); nothing published: {resume_hint(context, last['round'])}"
            )
        final = store.final_dir(self.job.job, run_id)
        model_path = final / "model.safetensors"
        final_record = write_artifact(
            model_path,
            FLModel(params=params, metrics=last.get("evaluation", {}), meta={"round": last["round"], "run_id": run_id}),
        )
        report = {
            "job": self.job.job,
            "run_id": run_id,
            "rounds_completed": len(rows),
            "final_model": str(model_path),
            "sha256": final_record.sha256,
            "rounds": rows,
        }
        lineage = self._data_lineage(context)
        if lineage:
            report.update(lineage)
        note = run_params(context, self.job).budget_note
        epsilon = rows[-1].get("epsilon")
        if epsilon is not None or note:
            report["privacy"] = {
                "epsilon": epsilon,
                "releases": rows[-1].get("releases"),
                "delta": self.job.privacy.delta,
                "max_epsilon": self.job.privacy.max_epsilon,
                "note": note,
            }
        metrics_path = final / "metrics.json"
        atomic_write(metrics_path, json.dumps(report, indent=2, sort_keys=True).encode())
        plot_path = final / "metrics.png"
        atomic_write(plot_path, plot_rounds(rows, f"{self.job.job} — run {run_id}"))
        pointer = {
            "run_id": run_id,
            "model_uri": str(model_path),
            "sha256": final_record.sha256,
            "round": last["round"],
        }
        atomic_write(store.latest_pointer(self.job.job), json.dumps(pointer, sort_keys=True).encode())
        # The Asset's page lists this event: its extra leads back to the run's Federated runs page.
        page = run_page_path(context["ti"].dag_id, run_id, _ui_base())
        for asset in self.outlets:
            extra = {**pointer, "evaluation": last.get("evaluation", {}), "federated_run_page": page}
            if "privacy" in report:
                extra["privacy"] = report["privacy"]
            if lineage:
                extra["participants"] = lineage["participants"]
                extra["data_versions"] = lineage["data_versions"]
            context["outlet_events"][asset].extra = extra
        self.log.info("per-round results of %s:\n%s", run_id, format_table(rows))
        if note:
            self.log.warning("%s", note)
        self.log.info("final model: %s\nmetrics: %s\nplot: %s", model_path, metrics_path, plot_path)
        mlflow_run = track_publish(self.job, context, summaries, pointer, self.log)
        self.lineage_io = ([str(last["global_uri"])], [str(model_path)])
        outputs = {"final_model": str(model_path), "metrics": str(metrics_path), "plot": str(plot_path), **pointer}
        # The Federated runs page links the run to its MLflow run from here (or from prepare's).
        return {**outputs, "mlflow_run": mlflow_run} if mlflow_run else outputs


def _ui_base() -> str:
    """Where Airflow's UI is: ``[api] base_url`` whole when it names a host (the Asset page shows
    the event's extra as text: a whole URL can be opened from there, a path cannot), else its
    path (usually empty)."""
    from urllib.parse import urlparse

    from airflow.configuration import conf

    configured = (conf.get("api", "base_url", fallback="") or "").strip()
    parsed = urlparse(configured)
    if parsed.scheme in ("http", "https") and parsed.netloc:
        return configured.rstrip("/")
    return parsed.path.rstrip("/")

"""Run bookkeeping: preparing the initial global model, publishing the final one."""

from __future__ import annotations

import datetime
import io
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from airflow.sdk import Asset, BaseOperator, Context
from airflow.sdk.bases.skipmixin import SkipMixin
from airflow.sdk.exceptions import AirflowFailException

from flare_airflow.core.config import JobConfig, load_initial_model
from flare_airflow.core.data_ready import SITE_DATA_ASSET, fresh_sites
from flare_airflow.core.errors import ConfigError, FlareAirflowError
from flare_airflow.core.model import FLModel, Params, all_finite, atomic_write, read_artifact, write_artifact
from flare_airflow.core.page_paths import run_page_path
from flare_airflow.core.pools import PoolError, blocking, problems, required_pools
from flare_airflow.core.report import format_table, round_row
from flare_airflow.core.store import ModelStore
from flare_airflow.core.trust import TrustError
from flare_airflow.hooks.pools import live_pools_from_api
from flare_airflow.operators.common import (
    RunParamsError,
    failure_to_xcom,
    run_id_of,
    run_params,
    store_for,
    task_states,
)
from flare_airflow.operators.data_ready import announcement_verifier
from flare_airflow.operators.data_watch import read_history
from flare_airflow.operators.lineage import LineageMixin
from flare_airflow.operators.links import LINKS_KEY, abort_site_uploads, sealed_round_links
from flare_airflow.operators.sweep import SweepOperator
from flare_airflow.operators.tracking import track_publish, track_run_start
from flare_airflow.operators.trust import open_site_metrics, sign_global


def _resume_hint(context: Context, round_num: int) -> str:
    dag_id, run_id = context["ti"].dag_id, run_id_of(context)
    return (
        f"run `flare-airflow resume {dag_id} {run_id}` (or `--from-round {round_num}`), or in the UI clear "
        f"round_{round_num} (its site tasks and global_model) with 'Downstream' on and 'Only failed' off"
    )


def final_model_asset(job: JobConfig) -> Asset:
    """The Asset a successful run updates: downstream DAGs can be scheduled on it.

    Its identity is the job's alone (the URI is the name): where the job keeps its models is not
    part of it. Airflow keeps one active Asset per name and per URI, so an Asset whose URI was the
    store's ``latest.json`` became a second, inactive Asset with the same name when a job's
    ``store`` moved -- its events were lost, and ``publish`` failed before it ran. Each event's
    ``extra`` says where that run's model is (``model_uri``).
    """
    return Asset(name=f"flare_airflow.{job.job}.global_model")


class PrepareRunOperator(BaseOperator, SkipMixin):
    """Check the run's form values and write the round-0 global model.

    The round-0 model is the job's ``initial_model`` or, with ``warm_start``, the final model of
    the job's last successful run (verified against its recorded sha256). A run that asks for
    fewer rounds than the job has gets the later rounds' tasks skipped here, all at once: under
    the scheduler each skipped task would otherwise cost a task process of its own.
    """

    ui_color = "#e5e5ff"

    def __init__(self, *, job: JobConfig, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.job = job

    def _check_pools(self) -> None:
        try:
            fatal, drift = _pool_problems(self.job)
        except PoolError as exc:
            raise AirflowFailException(str(exc)) from None
        for message in drift:
            self.log.warning("GPU pools: %s", message)
        if fatal:
            raise AirflowFailException("this run could never finish:\n  " + "\n  ".join(fatal))

    @failure_to_xcom
    def execute(self, context: Context) -> dict[str, Any]:
        try:
            params = run_params(context, self.job)
        except RunParamsError as exc:
            raise AirflowFailException(f"invalid run parameters: {exc}") from None
        self._check_pools()
        mlflow_run = track_run_start(self.job, context, self.log)
        store = store_for(self.job)
        run_id = run_id_of(context)
        source = None
        model_params = None
        if params.warm_start:
            pointer = store.latest_pointer(self.job.job)
            if pointer.exists():
                try:
                    model_params, source = _warm_start(store, pointer)
                except FlareAirflowError as exc:
                    raise AirflowFailException(
                        f"warm start: {exc}; to start from initial_model instead, trigger with warm_start off "
                        f"or delete {pointer}"
                    ) from None
            else:
                self.log.warning(
                    "warm_start is on but job %s has no successful run yet; starting from initial_model", self.job.job
                )
        if model_params is None:
            try:
                model_params = load_initial_model(self.job)
            except ConfigError as exc:
                raise AirflowFailException(str(exc)) from None
            source = f"initial model {self.job.initial_model_path()}"
        bad = all_finite(model_params)
        if bad is not None:
            raise AirflowFailException(f"{source}: tensor {bad!r} has NaN or infinite values")
        target = store.global_model(self.job.job, run_id, 0)
        record = write_artifact(target, FLModel(params=model_params, meta={"source": source}))
        self.log.info("round 0 global model: %s (%s)", target, source)
        try:
            signed = sign_global(self.job.job, run_id, 0, record)
        except TrustError as exc:
            raise AirflowFailException(f"the round 0 global model cannot be signed: {exc}") from None
        links = sealed_round_links(self.job, store, run_id, 1, record.size, self.log)
        result = {
            # The job's name: what the central side's sealed values of this run are bound to.
            "job": self.job.job,
            "global_uri": str(target),
            "sha256": record.sha256,
            "signed": signed,
            "source": source,
            "rounds": params.rounds,
            "min_clients": params.min_clients,
            "hparams": params.hparams,
            # Round 1's store links, each sealed to its site's box key (none on a local store).
            **({LINKS_KEY: links} if links else {}),
        }
        if params.budget_note:
            result["budget_note"] = params.budget_note
            self.log.warning("%s", params.budget_note)
        if mlflow_run:
            result["mlflow_run"] = mlflow_run
        result.update(self._participants(context, params.sites, params.min_clients))
        self._skip_later_rounds(context, params.rounds, result)
        return result

    def _participants(self, context: Context, chosen: Sequence[str] | None, min_clients: int) -> dict[str, Any]:
        """The sites this run trains on, the data each trains on, and why the others sit it out.

        A run started by the sites' data trains on the sites whose announcement it consumed,
        proven, fresh and not used by an earlier run (:func:`~flare_airflow.core.data_ready.fresh_sites`);
        a run from the form (or from the data watch, :mod:`flare_airflow.operators.data_watch`) on
        the sites it names (``sites``), or all of them, recording the unused fresh data of each.
        """
        events = _data_events(context)
        if events is None and not chosen and self.job.on_data is None:
            return {}  # every site, as before data-driven runs: nothing to record
        if self.job.on_data is None:
            picked = list(chosen) if chosen else list(self.job.sites)
            sat_out = {s: "not chosen for this run (run parameter sites)" for s in self.job.sites if s not in picked}
            return {"participants": picked, "sat_out": sat_out, "data": {}}
        try:
            history = read_history(context["ti"].dag_id, self.task_id, skip_run=run_id_of(context))
        except FlareAirflowError as exc:
            raise AirflowFailException(f"the sites' data cannot be matched to earlier runs: {exc}") from None
        window = self.job.on_data.window_seconds
        data = fresh_sites(
            history.events if events is None else events, self.job.sites, window_seconds=window, now=_now(),
            verify=announcement_verifier(self.log), used=history.used,
        )  # fmt: skip
        if events is None:
            picked = list(chosen) if chosen else list(self.job.sites)
            sat_out = {s: "not chosen for this run (run parameter sites)" for s in self.job.sites if s not in picked}
            # A site chosen by hand trains whatever its data; only unused fresh data is recorded as trained on.
            return {"participants": picked, "sat_out": sat_out, "data": {s: data[s].to_dict() for s in picked}}
        picked = [s for s, d in data.items() if d.reason is None and (not chosen or s in chosen)]
        sat_out = {s: d.reason or "not chosen for this run (run parameter sites)" for s, d in data.items()
                   if s not in picked}  # fmt: skip
        for site, reason in sat_out.items():
            self.log.info("site %s sits this run out: %s", site, reason)
        if len(picked) < min_clients:
            raise AirflowFailException(
                f"only {len(picked)} site(s) have fresh, signed data ({', '.join(picked) or 'none'}), fewer than "
                f"min_clients {min_clients}: " + "; ".join(f"{s}: {r}" for s, r in sat_out.items())[:1500]
            )
        return {
            "participants": picked,
            "sat_out": sat_out,
            "data": {s: d.to_dict() for s, d in data.items()},
        }

    def _skip_later_rounds(self, context: Context, rounds: int, result: dict[str, Any]) -> None:
        """Skip, in one call, every task of the rounds beyond ``rounds`` and the tasks of the sites
        that sit the run out (the task itself succeeds)."""
        sat_out = set(result.get("sat_out") or ())
        later = [
            task
            for task in self.get_flat_relatives(upstream=False)
            if isinstance(round_num := getattr(task, "round_num", None), int)
            and (round_num > rounds or getattr(task, "site", None) in sat_out)
        ]
        if not later:
            return
        if rounds < self.job.rounds:
            self.log.info(
                "this run asked for %d of %d rounds: skipping rounds %d-%d",
                rounds,
                self.job.rounds,
                rounds + 1,
                self.job.rounds,
            )
        ti: Any = context["ti"]
        # skip() ends execute with an exception, so the return value is pushed here.
        ti.xcom_push(key="return_value", value=result)
        self.skip(ti=ti, tasks=later)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _data_events(context: Context) -> list[dict[str, Any]] | None:
    """The sites' announcements this run consumed, or None for a run not started by them."""
    events = context.get("triggering_asset_events") or {}
    found: list[dict[str, Any]] = []
    started_by_data = False
    for asset in list(events):
        if getattr(asset, "name", None) != SITE_DATA_ASSET:
            continue
        started_by_data = True
        for event in events[asset]:
            found.append(
                {"partition_key": event.partition_key, "extra": dict(event.extra or {}), "timestamp": event.timestamp}
            )
    return found if started_by_data else None


_POINTER_KEYS = {"run_id": str, "model_uri": str, "sha256": str, "round": int}


def parse_latest_pointer(data: bytes, where: str) -> dict[str, Any]:
    """The job's ``latest.json`` (written by :class:`PublishOperator`), checked key by key."""
    try:
        latest = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise FlareAirflowError(f"{where} is not valid JSON ({str(exc)[:100]})") from None
    if not isinstance(latest, dict):
        raise FlareAirflowError(f"{where} must hold a JSON object, got {type(latest).__name__}")
    for key, kind in _POINTER_KEYS.items():
        value = latest.get(key)
        if isinstance(value, bool) or not isinstance(value, kind):
            raise FlareAirflowError(
                f"{where}: {key!r} is {'missing' if key not in latest else 'not a ' + kind.__name__} "
                f"(expected keys: {', '.join(_POINTER_KEYS)})"
            )
    if not re.fullmatch(r"[0-9a-f]{64}", latest["sha256"]):
        raise FlareAirflowError(f"{where}: 'sha256' is not 64 hex digits")
    return latest


def _warm_start(store: ModelStore, pointer: Any) -> tuple[Params, str]:
    """The final model of the job's last successful run, verified against the pointer's sha256."""
    with pointer.open("rb") as fh:
        latest = parse_latest_pointer(fh.read(1 << 20), str(pointer))
    path = store.resolve_uri(latest["model_uri"])
    model_params, record = read_artifact(path)
    if record.sha256 != latest["sha256"]:
        raise FlareAirflowError(f"{path} changed since run {latest['run_id']} published it")
    return model_params, f"warm start from run {latest['run_id']} ({latest['model_uri']})"


def _pool_problems(job: JobConfig) -> tuple[list[str], list[str]]:
    required = required_pools(job)
    if not required or not job.check_pools:
        return [], []
    found = problems(required, live_pools_from_api(sorted(required)))
    fatal = blocking(found)
    return fatal, [m for m in found if m not in fatal]


def plot_rounds(rows: Sequence[dict[str, Any]], title: str) -> bytes:
    """PNG of global evaluation metrics and mean training loss per round."""
    # A bare Figure on the Agg canvas, not pyplot: no global figure registry or backend switch in
    # the worker, and ~0.3 s less to import.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rounds = [r["round"] for r in rows]
    fig = Figure(figsize=(10, 4))
    FigureCanvasAgg(fig)
    ax_acc, ax_loss = fig.subplots(1, 2)
    acc = [r["evaluation"].get("accuracy") for r in rows]
    if any(a is not None for a in acc):
        ax_acc.plot(rounds, acc, marker="o", label="global accuracy (held-out)")
    ax_acc.set_xlabel("round")
    ax_acc.set_ylabel("accuracy")
    ax_acc.set_ylim(0, 1)
    ax_acc.grid(alpha=0.3)
    ax_acc.legend(loc="lower right")
    ax_loss.plot(rounds, [r["train_loss"] for r in rows], marker="o", label="mean training loss (sites)")
    eval_loss = [r["evaluation"].get("loss") for r in rows]
    if any(v is not None for v in eval_loss):
        ax_loss.plot(rounds, eval_loss, marker="s", label="global loss (held-out)")
    ax_loss.set_xlabel("round")
    ax_loss.set_ylabel("loss")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend(loc="upper right")
    for ax in (ax_acc, ax_loss):
        ax.set_xticks(rounds)
    fig.suptitle(title)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


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
                    f"wrong; nothing published: {_resume_hint(context, r)}"
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
                f"published: {_resume_hint(context, r)}"
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
                f"recorded {str(last['sha256'])[:12]}…); nothing published: {_resume_hint(context, last['round'])}"
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


class RunVerdictOperator(BaseOperator):
    """The run's last word: succeeds only when ``publish`` published this run's model.

    The builder makes it the run's teardown with ``on_failure_fail_dagrun``, so it alone decides
    the run's state. Airflow marks a run green when its leaves succeeded *or were skipped*, and
    the UI's recovery paths leave skipped leaves behind: *Mark run as failed* skips every task that
    had not started, and a later *Clear* of the failed site tasks (without Downstream) re-runs them
    and nothing after them -- the run then ended green with no model. A teardown is neither skipped
    by *Mark run as failed* nor cleared away from its verdict by a Clear that does not reach it, so
    the run can only end green once publish succeeded. When it did not, the reason names the first
    round without a global model and what to clear (or the ``flare-airflow resume`` command).
    """

    ui_color = "#d9d9d9"

    def __init__(
        self,
        *,
        job: JobConfig,
        prepare_task_id: str,
        aggregate_task_ids: Sequence[str],
        publish_task_id: str,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.job = job
        self.prepare_task_id = prepare_task_id
        self.aggregate_task_ids = list(aggregate_task_ids)
        self.publish_task_id = publish_task_id

    @failure_to_xcom
    def execute(self, context: Context) -> dict[str, Any]:
        ti = context["ti"]
        # The run is over: an upload still open is one nobody completes (a site task run again
        # later is refused by the store and told to have new links minted).
        abort_site_uploads(self.job, run_id_of(context), self.log)
        states = task_states(context, [self.prepare_task_id, *self.aggregate_task_ids, self.publish_task_id])
        published = ti.xcom_pull(task_ids=self.publish_task_id)
        publish_state = states.get(self.publish_task_id, "success")
        if publish_state == "success" and isinstance(published, dict) and published.get("sha256"):
            self.log.info("published: round %s model, sha256 %s", published.get("round"), published["sha256"])
            return {"published": True, "round": published.get("round"), "sha256": published["sha256"]}
        raise AirflowFailException(self._reason(context, states, publish_state or "cleared, not run again"))

    def _reason(self, context: Context, states: Mapping[str, str | None], publish_state: str) -> str:
        ti = context["ti"]
        dag_id, run_id = ti.dag_id, run_id_of(context)
        resume = f"`flare-airflow resume {dag_id} {run_id}`"
        head = f"nothing published: task {self.publish_task_id} is {publish_state}"
        if states.get(self.prepare_task_id, "success") != "success":
            return (
                f"{head} because {self.prepare_task_id} is {states.get(self.prepare_task_id) or 'not run'}; "
                f"fix its cause (its log and reason), then run {resume}, or clear {self.prepare_task_id} with "
                "'Downstream' on and 'Only failed' off"
            )
        prepared = ti.xcom_pull(task_ids=self.prepare_task_id)
        rounds = prepared.get("rounds") if isinstance(prepared, dict) else None
        requested = self.aggregate_task_ids[: rounds if isinstance(rounds, int) else len(self.aggregate_task_ids)]
        for r, task_id in enumerate(requested, start=1):
            state = states.get(task_id, "success")
            if state != "success":
                return (
                    f"{head}; round {r} has no global model in this run ({task_id} is {state or 'cleared, not run'}); "
                    f"to finish the run: {_resume_hint(context, r)}"
                )
        return f"{head}; every requested round was aggregated: run {resume}, or clear {self.publish_task_id}"


class SweepPodsOperator(SweepOperator):
    """Delete every pod still labelled with this run in the namespaces of the job's k8s sites.

    The builder adds it as the run's teardown (for jobs with Kubernetes sites): it runs when every
    other task has finished, also when a round failed and ``publish`` did not run, and its own
    outcome does not change the run's. Such a pod belongs to a try whose worker was killed (the
    try after it deletes it; the last try has no one after it). Best effort: a cluster that cannot
    be reached is logged. A site that keeps pods for debugging keeps the finished ones.
    """

    sweep_doc = "Delete pods this run left behind."

    def execute(self, context: Context) -> list[str]:
        return self.sweep_site_pods(context)

    def sweep_site_pods(self, context: Context) -> list[str]:
        """The pods deleted, as ``namespace/name``."""
        specs = [s.launcher_spec.k8s for s in self.swept_sites().values()]
        if not specs:
            return []
        from flare_airflow.hooks.kubernetes import site_hook
        from flare_airflow.launchers.kubernetes import delete_site_pods, site_pods_selector

        selector = site_pods_selector(self.job.job, run_id_of(context))
        deleted: list[str] = []
        places = {
            (s.kubernetes_conn_id, s.in_cluster, s.config_file, s.cluster_context, s.namespace, s.keep_pods): s
            for s in specs
        }
        for (*_cluster, namespace, keep_pods), spec in sorted(places.items(), key=lambda item: str(item[0])):
            try:
                found = delete_site_pods(site_hook(spec).core_v1_client, namespace, selector, keep_finished=keep_pods)
            except Exception as exc:  # the Kubernetes client raises many types; the run's result stands
                self.log.warning("could not sweep the pods of this run in namespace %s: %s", namespace, exc)
                continue
            deleted += [f"{namespace}/{name}" for name in found]
        if deleted:
            self.log.warning("deleted pods this run left running: %s", ", ".join(deleted))
        return deleted

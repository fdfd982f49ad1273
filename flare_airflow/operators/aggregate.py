"""The per-round aggregation task: the job's strategy over the sites' updates, then evaluation of the result."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from airflow.sdk import BaseOperator, Context
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

from flare_airflow.core.aggregation.engine import aggregate_from_store
from flare_airflow.core.aggregation.round import previous_server_state, round_inputs
from flare_airflow.core.aggregation.round_output import round_summary, write_round
from flare_airflow.core.aggregation.strategies import StepContext
from flare_airflow.core.config import JobConfig
from flare_airflow.core.config.privacy import CENTRAL_NOISE_SECRET_VARIABLE
from flare_airflow.core.errors import FlareAirflowError, QuorumNotReached, RoundInputError, RoundWriteError
from flare_airflow.core.model import MAX_METRICS, WritablePath, read_artifact
from flare_airflow.core.privacy.central import central_noise_key
from flare_airflow.core.privacy.secret import weak_secret_problem
from flare_airflow.core.spec import JobReturnCode
from flare_airflow.core.store import ModelStore, record_path
from flare_airflow.core.trust import TrustError
from flare_airflow.launchers.process import ProcessJobHandle, ProcessLauncher
from flare_airflow.operators.common import (
    FAILURE_XCOM_KEY,
    FINISHED_STATES,
    RunParamsError,
    failure_to_xcom,
    run_id_of,
    run_params,
    sat_out_sites,
    store_for,
    task_states,
)
from flare_airflow.operators.lineage import LineageMixin
from flare_airflow.operators.links import LINKS_KEY, abort_site_uploads, sealed_round_links
from flare_airflow.operators.site_steps import make_evaluation_run, produced_sha256
from flare_airflow.operators.staging import staged
from flare_airflow.operators.tracking import track_round
from flare_airflow.operators.trust import open_reports, seal_site_metrics, sign_global, verify_updates
from flare_airflow.site_task.runner import run_site


def central_noise_secret(round_num: int) -> bytes:
    """The run's central-DP noise secret, resolved on this (the aggregation's) worker from the Airflow
    variable ``flare_central_noise_secret`` and masked in logs; never in XCom, argv or a log line.

    The server keeps it, so the central noise of (job, run, round) is keyed from it
    (:func:`~flare_airflow.core.privacy.central.central_noise_key`) and a retried aggregation
    releases the same model instead of spending the budget twice. Missing, the round fails saying
    how to create it.
    """
    from airflow.sdk import Variable
    from airflow.sdk.log import mask_secret

    name = CENTRAL_NOISE_SECRET_VARIABLE
    value = Variable.get(name, default=None)
    if not value:
        raise AirflowFailException(
            f"round {round_num} not aggregated: the job sets privacy.central, whose noise is keyed by the run's "
            f"secret in the Airflow variable {name!r}, which the aggregation's worker does not have; create it "
            f"there (airflow variables set {name} <64 random hex digits>, a secrets backend, or "
            f"AIRFLOW_VAR_{name.upper()}), keep it for the run's lifetime (a retried round must draw the same "
            "noise), use another value than the sites' flare_noise_secret, then clear this task"
        )
    mask_secret(str(value), name)
    problem = weak_secret_problem(str(value), name, at_site=False)
    if problem is not None:
        raise AirflowFailException(f"round {round_num} not aggregated: {problem}")
    return str(value).encode()


class AggregateOperator(LineageMixin, BaseOperator):
    """Combine one round's site updates into the next global model (the job's ``aggregator``).

    Runs when all of the round's site tasks are done, whatever their state (trigger rule
    ``all_done``): a site that failed, was killed or sent a bad update simply does not count. The
    round fails -- and the global model is not written -- when fewer than ``min_clients`` valid
    updates arrived; the error names every failed site and why. With ``job.evaluate`` the new
    global model is then evaluated by the trainer script (task ``evaluate``) on this worker.

    Returns (XCom) the round's summary: accepted and rejected sites, sample-weighted site metrics,
    the evaluation metrics, and the global model's URI and sha256.
    """

    ui_color = "#fde0c5"

    def __init__(
        self,
        *,
        job: JobConfig,
        round_num: int,
        site_task_ids: dict[str, str] | None = None,
        global_task_id: str | None = None,
        prepare_task_id: str | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("trigger_rule", "all_done")
        super().__init__(**kwargs)
        self.job = job
        self.round_num = round_num
        self.site_task_ids = dict(site_task_ids or {})
        self.global_task_id = global_task_id
        self.prepare_task_id = prepare_task_id
        self._handle: ProcessJobHandle | None = None
        # Site -> its XCom summary with the sealed report opened (set when the updates are checked).
        self._reports: dict[str, Any] = {}

    def _track(self, handle: ProcessJobHandle) -> None:
        self._handle = handle

    def on_kill(self) -> None:
        if self._handle is not None:
            self._handle.terminate()

    @failure_to_xcom
    def execute(self, context: Context) -> dict[str, Any]:
        job, r = self.job, self.round_num
        try:
            params = run_params(context, job)
        except RunParamsError as exc:
            # prepare failed on the same and nothing of this round ran: not a second failure.
            raise AirflowSkipException(f"round {r} not aggregated: invalid run parameters ({exc})") from None
        if r > params.rounds:
            raise AirflowSkipException(f"round {r} skipped: this run asked for {params.rounds} rounds")
        store = store_for(job)
        run_id = run_id_of(context)
        global_in = store.global_model(job.job, run_id, r - 1)
        if not record_path(global_in).exists():
            raise AirflowSkipException(
                f"round {r} not aggregated: round {r - 1} produced no global model (see the failed task before it)"
            )
        try:
            global_params, global_record = read_artifact(global_in)
        except FlareAirflowError as exc:
            raise AirflowFailException(f"round {r}: the input global model is unusable: {exc}") from None
        expected = produced_sha256(context, self.global_task_id)
        if expected is not None and global_record.sha256 != expected:
            raise AirflowFailException(
                f"round {r}: the input global model {global_in} was replaced after round {r - 1} published it "
                f"(sha256 {global_record.sha256[:12]}…, published {expected[:12]}…); clear round {r - 1} to rebuild it"
            )
        sat_out = sat_out_sites(context, self.prepare_task_id)
        self._check_sites_done(context, params.rounds, sat_out)
        accepted, accepted_blake3, refused, vouched = self._accepted(context, run_id)
        updates = round_inputs(
            store, job.job, run_id, r, sorted(job.sites),
            sat_out=sat_out, refused=refused, accepted=accepted,
            task_failure=lambda site: self._task_failure(context, site),
        )  # fmt: skip
        strategy = job.round_strategy(lambda: central_noise_key(central_noise_secret(r), job.job, run_id, r))
        state, state_out = self._server_state(context, store, run_id) if strategy.stateful else ({}, None)
        try:
            outcome, new_state = aggregate_from_store(
                strategy,
                global_params,
                updates,
                min_clients=params.min_clients,
                site_weights=job.site_weights(),
                accepted_sha256=accepted,
                accepted_blake3=accepted_blake3,
                state=state,
                context=StepContext(job=job.job, run_id=run_id, round=r),
                consume_state=True,  # just read from the store for this try: written over, not copied
            )
        except QuorumNotReached as exc:
            raise AirflowFailException(f"round {r} failed: {exc}") from None
        for site, reason in sorted(outcome.rejected.items()):
            self.log.warning("round %d: site %s does not count: %s", r, site, reason)
        if outcome.metrics_dropped:
            self.log.warning(
                "round %d: the sites reported %d metric names in all, more than the %d a round keeps; left out of "
                "the round's means (each site's own metrics are kept): %s",
                r, len(outcome.metrics) + len(outcome.metrics_dropped), MAX_METRICS, outcome.metrics_dropped[:20],
            )  # fmt: skip
        try:
            written = write_round(
                store, job.job, run_id, r, outcome,
                strategy=strategy.name,
                state=(state_out, new_state) if state_out is not None else None,
                central_dp=job.privacy.central is not None,
                accepted_sha256=accepted,
            )  # fmt: skip
        except (RoundWriteError, RoundInputError) as exc:
            raise AirflowFailException(str(exc)) from None
        del global_params, outcome.params, new_state
        try:
            signed = sign_global(job.job, run_id, r, written.record)
        except TrustError as exc:
            raise AirflowFailException(f"round {r}: the global model cannot be signed: {exc}") from None
        links = (
            sealed_round_links(job, store, run_id, r + 1, written.record.size, self.log) if r < params.rounds else None
        )
        # The round is read and its model written: every site task of it is done (checked above),
        # so an upload still open is one nobody completes.
        abort_site_uploads(job, run_id, self.log, store=store, round_num=r)
        global_out = written.global_model
        evaluation = self._evaluate(context, str(global_out)) if job.evaluate else {}
        summary = round_summary(
            written,
            outcome,
            round_num=r,
            strategy=strategy.name,
            strategy_params=job.aggregator.model_dump(mode="json", exclude_none=True, exclude={"name"}),
            site_sha256=vouched if accepted is not None else None,
            signed=signed,
            links={LINKS_KEY: links} if links else None,
            evaluation=evaluation,
            privacy=job.privacy.account(r, self._site_releases(context), written.central_releases),
        )
        self.log.info(
            "round %d: %d/%d sites counted %s by %s%s, metrics %s, evaluation %s",
            r, len(outcome.accepted), len(job.sites), summary["accepted"], strategy.name,
            f" (combined {outcome.selected})" if outcome.selected is not None else "",
            outcome.metrics, summary["evaluation"],
        )  # fmt: skip
        track_round(job, context, summary, self.log)
        self.lineage_io = (
            [str(store.site_update(job.job, run_id, r, s)) for s in summary["accepted"]],
            [str(global_out)],
        )
        return seal_site_metrics(summary, job=job.job, run_id=run_id)

    def _server_state(self, context: Context, store: ModelStore, run_id: str) -> tuple[dict[str, Any], WritablePath]:
        """The previous round's server state, checked against the digests the previous aggregation
        published (its XCom), and where this round's goes."""
        r = self.round_num
        summary = context["ti"].xcom_pull(task_ids=self.global_task_id) if self.global_task_id and r > 1 else None
        published = summary if isinstance(summary, dict) else {}
        try:
            return previous_server_state(
                store,
                self.job.job,
                run_id,
                r,
                strategy=self.job.aggregator.name,
                published_sha256=published.get("state_sha256"),
                published_blake3=published.get("state_blake3"),
            )
        except RoundInputError as exc:
            raise AirflowFailException(str(exc)) from None

    def _check_sites_done(self, context: Context, rounds: int, sat_out: Mapping[str, str]) -> None:
        """Refuse to aggregate fewer sites than the round could count.

        Every site task of the round must have finished and have run: a site task that is still
        to run (cleared on its own, or a Clear/Mark that reached this task but not its sites) or
        that was skipped in a requested round (``Mark run as failed`` skips tasks that had not
        started) would otherwise be left out of the round without a word.
        """
        states = task_states(context, list(self.site_task_ids.values()))
        if not states:
            return
        r = self.round_num
        site_of = {task_id: site for site, task_id in self.site_task_ids.items()}
        waiting = {site_of[t]: s or "cleared" for t, s in states.items() if s not in FINISHED_STATES}
        skipped = sorted(site_of[t] for t, s in states.items() if s == "skipped" and site_of[t] not in sat_out)
        fix = (
            f"clear round {r}'s site tasks together with this task and everything downstream "
            f"('Only failed' off), or run `flare-airflow resume {context['ti'].dag_id} {run_id_of(context)} "
            f"--from-round {r}`"
        )
        if waiting:
            found = ", ".join(f"{site} ({state})" for site, state in sorted(waiting.items()))
            raise AirflowFailException(f"round {r} not aggregated: site task(s) {found} have not finished; {fix}")
        if skipped:
            raise AirflowFailException(
                f"round {r} not aggregated: site task(s) {', '.join(skipped)} were skipped and never ran, though "
                f"this run asked for {rounds} rounds (e.g. 'Mark run as failed' skips tasks that had not started); "
                f"{fix}"
            )

    def _accepted(
        self, context: Context, run_id: str
    ) -> tuple[dict[str, str] | None, dict[str, str] | None, dict[str, str], dict[str, str]]:
        """Site -> sha256 and site -> BLAKE3 of the update each site task accepted and signed (its
        XCom, verified against the site's signature; BLAKE3 where it verified one), site -> why its
        record was refused, and site -> the sha256 each site task's XCom names, refused or not
        (what publish compares to see whether a site task ran again); (None, None, {}, {}) without task ids."""
        if not self.site_task_ids:
            return None, None, {}, {}
        ti = context["ti"]
        sealed = {site: ti.xcom_pull(task_ids=task_id) for site, task_id in self.site_task_ids.items()}
        # Sites seal their counts, metrics and signed records to the aggregation (XCom is every site's to read).
        summaries, unopened = open_reports(sealed, job=self.job.job, run_id=run_id, round_num=self.round_num)
        self._reports = summaries
        accepted, blake3, refused = verify_updates(
            summaries, job=self.job.job, run_id=run_id, round_num=self.round_num, log=self.log
        )
        refused.update(unopened)
        vouched = {s: str(v["sha256"]) for s, v in sealed.items() if isinstance(v, dict) and v.get("sha256")}
        return accepted, {site: digest for site, digest in blake3.items() if digest}, refused, vouched

    def _site_releases(self, context: Context) -> dict[str, int]:
        """Site -> the distinct noised releases its ledger charged in this run (its task's report)."""
        releases: dict[str, int] = {}
        for site, task_id in self.site_task_ids.items():
            summary = self._reports.get(site) if site in self._reports else context["ti"].xcom_pull(task_ids=task_id)
            privacy = summary.get("privacy") if isinstance(summary, dict) else None
            if isinstance(privacy, dict) and isinstance(privacy.get("releases"), int):
                releases[site] = privacy["releases"]
        return releases

    def _task_failure(self, context: Context, site: str) -> str | None:
        """The reason a site task put in XCom when it failed (the store may not have taken it)."""
        task_id = self.site_task_ids.get(site)
        if task_id is None:
            return None
        reason = context["ti"].xcom_pull(task_ids=task_id, key=FAILURE_XCOM_KEY)
        return str(reason) if reason else None

    def _evaluate(self, context: Context, global_uri: str) -> dict[str, float]:
        run = make_evaluation_run(self.job, self.round_num, context, global_model=global_uri)

        def sink(line: str) -> None:
            print(line, file=sys.stdout, flush=True)

        with staged(run, store_for(self.job)) as local:
            rc, result = run_site(local, ProcessLauncher(sink=sink), handle_signals=False, on_launch=self._track)
        self._handle = None
        if rc is not JobReturnCode.SUCCESS or not isinstance(result, dict):
            raise FlareAirflowError(f"evaluation of the round {self.round_num} global model failed: {result}")
        return dict(result["metrics"])

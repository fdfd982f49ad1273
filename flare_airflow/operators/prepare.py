"""Preparing a run: its form values, its GPU pools, its participants and the round-0 global model."""

from __future__ import annotations

from typing import Any

from airflow.sdk import BaseOperator, Context
from airflow.sdk.bases.skipmixin import SkipMixin
from airflow.sdk.exceptions import AirflowFailException

from flare_airflow.core.config import JobConfig, load_initial_model
from flare_airflow.core.errors import ConfigError, FlareAirflowError
from flare_airflow.core.latest import warm_start_model
from flare_airflow.core.model import FLModel, all_finite, write_artifact
from flare_airflow.core.pools import PoolError, blocking, problems, required_pools
from flare_airflow.core.trust import TrustError
from flare_airflow.hooks.pools import live_pools_from_api
from flare_airflow.operators.common import (
    RunParamsError,
    failure_to_xcom,
    run_id_of,
    run_params,
    store_for,
)
from flare_airflow.operators.links import LINKS_KEY, sealed_round_links
from flare_airflow.operators.participants import run_participants
from flare_airflow.operators.tracking import track_run_start
from flare_airflow.operators.trust import sign_global


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
                    model_params, source = warm_start_model(store, pointer)
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
        result.update(
            run_participants(self.job, context, params.sites, params.min_clients, task_id=self.task_id, log=self.log)
        )
        self._skip_later_rounds(context, params.rounds, result)
        return result

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


def _pool_problems(job: JobConfig) -> tuple[list[str], list[str]]:
    required = required_pools(job)
    if not required or not job.check_pools:
        return [], []
    found = problems(required, live_pools_from_api(sorted(required)))
    fatal = blocking(found)
    return fatal, [m for m in found if m not in fatal]

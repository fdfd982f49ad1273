"""The run's last word: whether it published, and if not what to clear or resume."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from airflow.sdk import BaseOperator, Context
from airflow.sdk.exceptions import AirflowFailException

from flare_airflow.core.config import JobConfig
from flare_airflow.operators.common import (
    failure_to_xcom,
    run_id_of,
    task_states,
)
from flare_airflow.operators.links import abort_site_uploads


def resume_hint(context: Context, round_num: int) -> str:
    """What to run or clear to finish a run from round ``round_num``."""
    dag_id, run_id = context["ti"].dag_id, run_id_of(context)
    return (
        f"run `flare-airflow resume {dag_id} {run_id}` (or `--from-round {round_num}`), or in the UI clear "
        f"round_{round_num} (its site tasks and global_model) with 'Downstream' on and 'Only failed' off"
    )


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
                    f"to finish the run: {resume_hint(context, r)}"
                )
        return f"{head}; every requested round was aggregated: run {resume}, or clear {self.publish_task_id}"

"""A site job that runs elsewhere (a pod, a SLURM job): what its site task does around the launch.

Process sites do the same inside the site runner (:func:`flare_airflow.site_task.runner.run_site`);
pod and SLURM site tasks launch through a backend and call these two steps themselves.
"""

from __future__ import annotations

from typing import Any

from airflow.sdk import Context
from airflow.sdk.bases.xcom import BaseXCom

from flare_airflow.core.errors import FlareAirflowError
from flare_airflow.core.spec import JobHandleSpec, JobReturnCode
from flare_airflow.core.store import path_from_uri
from flare_airflow.operators.site_steps import noise_secret_for, site_failed
from flare_airflow.site_task.checks import check_result, clear_outputs, write_failure
from flare_airflow.site_task.spec import SiteRun
from flare_airflow.site_task.tries import Superseded, claim_try


def claim_and_clear(run: SiteRun) -> None:
    """Before the launch: claim this try (an earlier try can no longer publish after it), then clear
    the site's published update and failure record of this round."""
    if run.staging:
        claim_try(run.staging)
    clear_outputs(path_from_uri(run.output))


def accept_update(context: Context, site: str, round_num: int, run: SiteRun) -> dict[str, Any]:
    """After a successful job: check the update the trainer sent and publish it, or fail the task.

    The summary is pushed as the task's return value: the aggregation counts exactly the updates
    whose site task returned one.
    """
    output = path_from_uri(run.output)
    try:
        summary = check_result(run, output, noise_secret_for(run))
    except Superseded as exc:  # the published update is the later try's: leave it
        raise site_failed(context, site, round_num, f"{exc} [ABORTED]") from None
    except FlareAirflowError as exc:
        clear_outputs(output)
        write_failure(output, JobReturnCode.EXECUTION_ERROR, str(exc))
        raise site_failed(context, site, round_num, str(exc)) from None
    context["ti"].xcom_push(key=BaseXCom.XCOM_RETURN_KEY, value=summary)
    return summary


LOG_LINES = 10


def last_lines(handle: JobHandleSpec, count: int = LOG_LINES) -> str:
    """The job's last non-empty log lines (a pod's log; a SLURM job's reason already has its own)."""
    try:
        text = handle.logs()
    except Exception as exc:  # a missing log must not hide the job's reason
        return f"(its log could not be read: {type(exc).__name__})"
    lines = [line for line in text.splitlines() if line.strip()][-count:]
    return " | ".join(line if len(line) <= 300 else line[:299] + "…" for line in lines)

"""A site job that runs elsewhere (a pod, a SLURM job, a container): what its watcher does around it.

Before the launch, claim and clear; after it, accept the update or record the failure -- one
decision for every watcher (the site-task lifecycle and the sensor). Process sites do the same
inside the site runner (:func:`flare_airflow.site_task.runner.run_site`).
"""

from __future__ import annotations

from typing import Any

from airflow.sdk import Context
from airflow.sdk.bases.xcom import BaseXCom

from flare_airflow.core.errors import FlareAirflowError
from flare_airflow.core.failure_record import write_failure
from flare_airflow.core.spec import JobHandleSpec, JobReturnCode
from flare_airflow.core.store import path_from_uri
from flare_airflow.operators.site_steps import SiteJobFailed, noise_secret_for, site_failed
from flare_airflow.site_task.checks import check_result, clear_outputs
from flare_airflow.site_task.spec import SiteRun
from flare_airflow.site_task.tries import Superseded, claim_try

#: What a site task returns as XCom: the published update's summary (never weights).
Summary = dict[str, Any]


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


def record_site_failure(
    context: Context, run: SiteRun | None, site: str, round_num: int, rc: JobReturnCode, reason: str
) -> SiteJobFailed:
    """A site job's failure, recorded once for every watcher (the site task, the sensor): in the
    site's failure record (when its run is known) and in XCom; the returned error names both."""
    if run is not None:
        write_failure(path_from_uri(run.output), rc, reason)
    return site_failed(context, site, round_num, f"{reason} [{rc.name}]")


def finish_site_job(
    context: Context,
    run: SiteRun,
    site: str,
    round_num: int,
    rc: JobReturnCode,
    *,
    handle: object = None,
    reason: str | None = None,
) -> Summary:
    """Accept the update of a site job that succeeded, or raise its recorded failure.

    A launcher spec's handle gives the job's own reason and last log lines; a job that has not
    ended yet is ended first (it must not outlive its watcher's decision), and a return code of
    "still running" counts as an EXECUTION_ERROR.
    """
    if rc is JobReturnCode.SUCCESS:
        return accept_update(context, site, round_num, run)
    if isinstance(handle, JobHandleSpec):
        if not handle.state.finished:
            handle.terminate()
        reason = reason or handle.reason or handle.state.value
        tail = last_lines(handle)
        if tail:
            reason += f"; its last log lines: {tail}"
    rc = rc if rc is not JobReturnCode.UNKNOWN else JobReturnCode.EXECUTION_ERROR
    raise record_site_failure(context, run, site, round_num, rc, reason or rc.name)


LOG_LINES = 10


def last_lines(handle: JobHandleSpec, count: int = LOG_LINES) -> str:
    """The job's last non-empty log lines (a pod's log; a SLURM job's reason already has its own)."""
    try:
        text = handle.logs()
    except Exception as exc:  # a missing log must not hide the job's reason
        return f"(its log could not be read: {type(exc).__name__})"
    lines = [line for line in text.splitlines() if line.strip()][-count:]
    return " | ".join(line if len(line) <= 300 else line[:299] + "…" for line in lines)

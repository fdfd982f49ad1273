"""The site-task lifecycle, once: what every fused site task does around its backend's job.

astronomer-cosmos's shape (``AbstractDbtBase`` mixed into each execution mode's operator): the
base owns the steps, in order -- may-run check, site policy, the site run, secrets, claim and
clear, earlier tries, launch, watch, accept or fail -- and a backend's operator fills two hooks,
:meth:`SiteTaskLifecycle.launch` and :meth:`SiteTaskLifecycle.watch`. Every failure leaves the
reason with its return code in the site's failure record (where the aggregation reads it) and in
XCom; a job is never left running when the task ends, whichever way it ends.

The container site task is built on it; the process, pod and SLURM tasks still take the same
steps in their own code (docs/architecture.md says which).
"""

from __future__ import annotations

import abc
from typing import Any

from airflow.sdk import Context

from flare_airflow.core.config import JobConfig
from flare_airflow.core.errors import FlareAirflowError, StoreError
from flare_airflow.core.spec import JobHandleSpec, JobIdentity, JobLauncherSpec, JobReturnCode
from flare_airflow.core.store import path_from_uri
from flare_airflow.launchers.errors import LaunchError
from flare_airflow.operators.common import store_for
from flare_airflow.operators.site import (
    SiteJobFailed,
    check_site_task_may_run,
    job_at_site,
    make_site_run,
    resolve_secret_env,
    site_failed,
)
from flare_airflow.operators.site_outputs import accept_update, claim_and_clear, last_lines
from flare_airflow.operators.staging import check_connection, staged
from flare_airflow.site_task.checks import write_failure
from flare_airflow.site_task.spec import SiteRun


class SiteTaskLifecycle(abc.ABC):
    """The steps of one site's task of one round; mixed into a backend's operator (first base).

    The operator sets ``job``, ``site``, ``round_num`` and ``global_task_id`` and provides ``log``
    (``BaseOperator`` does). Hooks: :meth:`launcher` (the site's launcher on this worker),
    :meth:`argv` (the trainer's argv where the site runs it); :meth:`launch` and :meth:`watch`
    have defaults that go through the launcher spec.
    """

    job: JobConfig
    site: str
    round_num: int
    global_task_id: str | None
    log: Any
    _handle: JobHandleSpec | None = None

    @abc.abstractmethod
    def launcher(self, try_number: int, secrets: dict[str, str]) -> JobLauncherSpec:
        """The site's launcher on this worker (its secrets' values hidden from every line it shows)."""

    @abc.abstractmethod
    def argv(self) -> list[str]:
        """The trainer's exact argv where the site runs it."""

    def launch(
        self, launcher: JobLauncherSpec, run: SiteRun, try_number: int, secrets: dict[str, str]
    ) -> JobHandleSpec:
        """Start the site job; its handle."""
        return launcher.launch_job(run.site_job(), {"try_number": try_number, "secrets": secrets})

    def watch(self, handle: JobHandleSpec) -> JobReturnCode:
        """Wait for the job to end; its return code."""
        return handle.wait()

    # ------------------------------------------------------------------ the steps, in order

    def execute(self, context: Context) -> Any:
        check_site_task_may_run(context, self.job, self.site, self.round_num)
        self.job = job_at_site(self.job, self.site, context, self.round_num)
        try_number = int(getattr(context.get("ti"), "try_number", None) or 1)
        run = make_site_run(
            self.job, self.site, self.round_num, context, argv=self.argv(), global_task_id=self.global_task_id
        )
        store = store_for(self.job)
        try:
            check_connection(store, self.job.store_conn_id)
        except StoreError as exc:
            raise site_failed(context, self.site, self.round_num, f"{exc} [INFRASTRUCTURE_ERROR]") from None
        with staged(run, store) as local:
            summary = self._run_job(context, local, try_number)
        summary["uri"] = run.output  # the update's place in the store, not a staged local copy
        return summary

    def _fail(self, context: Context, run: SiteRun, rc: JobReturnCode, reason: str) -> SiteJobFailed:
        write_failure(path_from_uri(run.output), rc, reason)
        return site_failed(context, self.site, self.round_num, f"{reason} [{rc.name}]")

    def _run_job(self, context: Context, run: SiteRun, try_number: int) -> dict[str, Any]:
        claim_and_clear(run)
        try:
            secrets = resolve_secret_env(self.job, self.site)
        except SiteJobFailed as exc:
            raise self._fail(context, run, JobReturnCode.CONFIG_ERROR, str(exc)) from None
        identity = JobIdentity.of(run.site_job(), try_number)
        try:
            launcher = self.launcher(try_number, secrets)
            ended = launcher.terminate_earlier_tries(identity)
            if ended:
                self.log.info("site job %s: ended the jobs of earlier tries: %s", identity.label, ", ".join(ended))
            self._handle = self.launch(launcher, run, try_number, secrets)
        except LaunchError as exc:
            raise self._fail(context, run, exc.return_code, str(exc)) from None
        except FlareAirflowError as exc:
            raise self._fail(context, run, JobReturnCode.CONFIG_ERROR, str(exc)) from None
        except Exception as exc:  # the backend could not be reached or refused the call: nothing runs
            detail = " ".join(str(exc).split())[:500] or type(exc).__name__
            raise self._fail(context, run, JobReturnCode.INFRASTRUCTURE_ERROR, f"cannot launch: {detail}") from None
        handle = self._handle
        self.log.info("site job %s launched: %s", identity.label, handle.where())
        try:
            rc = self.watch(handle)
        except BaseException:
            # Killed (SIGTERM -> on_kill), timed out or interrupted while waiting: the job must not outlive us.
            handle.terminate()
            raise
        if rc is not JobReturnCode.SUCCESS:
            if not handle.state.finished:
                handle.terminate()
            reason = handle.reason or handle.state.value
            tail = last_lines(handle)
            if tail:
                reason += f"; its last log lines: {tail}"
            raise self._fail(
                context, run, rc if rc is not JobReturnCode.UNKNOWN else JobReturnCode.EXECUTION_ERROR, reason
            )
        return accept_update(context, self.site, self.round_num, run)

    def on_kill(self) -> None:
        if self._handle is not None:
            self.log.info("task killed: ending site job %s", self._handle.where())
            self._handle.terminate()

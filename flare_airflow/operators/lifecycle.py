"""The site-task lifecycle, once: what every site task does around its backend's job.

astronomer-cosmos's shape (``AbstractDbtBase`` mixed into each execution mode's operator): the
base owns the steps, in order -- may-run check, site policy, the site run, secrets, claim and
clear, earlier tries, launch, watch, accept or fail -- and a backend's operator fills two hooks,
:meth:`SiteTaskLifecycle.launch` and :meth:`SiteTaskLifecycle.watch` (keyword-only, as the cncf
provider's pod callbacks). Every failure leaves the reason with its return code in the site's
failure record (where the aggregation reads it) and in XCom; a job is never left running when
the task ends, whichever way it ends.

Every site task is built on it: the process task (:mod:`~flare_airflow.operators.site`), the pod
task (:mod:`~flare_airflow.operators.pod`), the SLURM task (:mod:`~flare_airflow.operators.slurm`),
the container task (:mod:`~flare_airflow.operators.container`) and the launch of the launch +
sensor pair (:mod:`~flare_airflow.operators.site_job`, whose watch hands the job to the sensor).
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

from airflow.sdk import Context
from airflow.sdk.exceptions import AirflowException

from flare_airflow.core.config import JobConfig
from flare_airflow.core.errors import FlareAirflowError, StoreError
from flare_airflow.core.spec import JobHandleSpec, JobIdentity, JobLauncherSpec, JobReturnCode
from flare_airflow.core.store import path_from_uri
from flare_airflow.launchers.errors import LaunchError
from flare_airflow.operators.common import store_for
from flare_airflow.operators.links import site_links
from flare_airflow.operators.site_outputs import accept_update, claim_and_clear, last_lines
from flare_airflow.operators.site_steps import (
    SiteJobFailed,
    check_site_budget,
    check_site_task_may_run,
    job_at_site,
    make_site_run,
    resolve_secret_env,
    site_failed,
    site_launcher,
    try_number_of,
)
from flare_airflow.operators.staging import check_connection, is_local, staged
from flare_airflow.site_task.checks import write_failure
from flare_airflow.site_task.spec import SiteRun


class SiteTaskLifecycle(abc.ABC):
    """The steps of one site's task of one round; mixed into a backend's operator (first base).

    The operator sets ``job``, ``site``, ``round_num`` and ``global_task_id`` and provides ``log``
    (``BaseOperator`` does). It fills :meth:`argv` and, where the launcher spec's defaults do not
    fit, :meth:`launch` and :meth:`watch`; the other steps are methods too, overridden only where
    a backend really differs (each override says why).
    """

    job: JobConfig
    site: str
    round_num: int
    global_task_id: str | None
    log: Any
    # The running job, for on_kill (whatever the backend's launch returned).
    _handle: Any = None

    #: The job sees the model store through a local copy staged on this worker (process and
    #: container jobs read the worker's files); a pod or a SLURM job reaches the store itself.
    stages_store: ClassVar[bool] = True

    # ------------------------------------------------------------------ the backend's hooks

    @abc.abstractmethod
    def argv(self) -> list[str]:
        """The trainer's exact argv where the site runs it."""

    def launcher(self, *, try_number: int, secrets: Mapping[str, str]) -> JobLauncherSpec | None:
        """The site's launcher on this worker, from its backend's registry entry; its secrets'
        values are hidden from every line it shows. ``None``: the backend launches without one."""
        return site_launcher(
            self.job, self.site, try_number=try_number, sink=lambda line: self.log.info("%s", line),
            hidden=list(secrets.values()),
        )  # fmt: skip

    def launch(
        self,
        *,
        context: Context,
        run: SiteRun,
        launcher: JobLauncherSpec | None,
        try_number: int,
        secrets: Mapping[str, str],
    ) -> Any:
        """Start the site job; what :meth:`watch` follows (by default the launcher spec's handle)."""
        assert launcher is not None, "a backend without a launcher fills launch itself"
        handle = launcher.launch_job(run.site_job(), {"try_number": try_number, "secrets": dict(secrets)})
        self.log.info("site job %s launched: %s", JobIdentity.of(run.site_job(), try_number).label, handle.where())
        return handle

    def watch(self, *, context: Context, run: SiteRun, handle: Any) -> Any:
        """Wait for the job to end, then accept or fail (:meth:`finish`); the task's XCom.

        By default the handle's own ``wait`` in the worker. A deferrable backend defers here
        instead and calls :meth:`finish` from the method the triggerer resumes.
        """
        try:
            rc = handle.wait()
        except BaseException:
            # Killed (SIGTERM -> on_kill), timed out or interrupted while waiting: the job must not outlive us.
            handle.terminate()
            raise
        return self.finish(context, run, rc, handle=handle)

    def reattach(self, *, launcher: JobLauncherSpec | None, identity: JobIdentity) -> Any:
        """This try's job when it was launched already (then nothing is cleared or launched);
        a site task's own job never is: it ends with the task."""
        return None

    # ------------------------------------------------------------------ the steps, in order

    def execute(self, context: Context) -> Any:
        self.check_may_run(context)
        self.apply_site_policy(context)
        run = self.site_run(context)
        if not self.stages_store:
            return self.run_site_job(context, run)
        store = store_for(self.job)
        # The round's store links the central side sealed to this site: then no store connection here.
        links = site_links(context, self.job, self.site, self.round_num, self.global_task_id)
        try:
            if links is None:
                check_connection(store, self.job.store_conn_id)
        except StoreError as exc:
            raise site_failed(context, self.site, self.round_num, f"{exc} [INFRASTRUCTURE_ERROR]") from None
        try:
            with staged(run, store, links) as local:
                summary = self.run_site_job(context, local)
        except (AirflowException, KeyboardInterrupt, SystemExit):
            raise
        except Exception as exc:
            if is_local(store):
                raise
            # Reading the global model or uploading the update: a wrong or missing credential, a
            # bucket that is not there, the endpoint unreachable. The site fails, the round holds.
            detail = " ".join(str(exc).split())[:400] or type(exc).__name__
            via = "its store links" if links else f"connection {self.job.store_conn_id or 'default'!r}"
            fix = (
                "check the store's endpoint is reachable from this worker; refused links: clear the task that "
                "published this round's global model to mint new ones"
                if links
                else "check the connection's credentials and endpoint on the site's worker"
            )
            reason = (
                f"the model store {store.root} could not be used from this worker ({via}): "
                f"{type(exc).__name__}: {detail}; {fix} [INFRASTRUCTURE_ERROR]"
            )
            raise site_failed(context, self.site, self.round_num, reason) from None
        if isinstance(summary, dict) and "uri" in summary:
            summary["uri"] = run.output  # the update's place in the store, not a staged local copy
        return summary

    def check_may_run(self, context: Context) -> None:
        """Skip a round beyond the run's ``rounds``; refuse a task whose round was aggregated."""
        check_site_task_may_run(context, self.job, self.site, self.round_num)

    def apply_site_policy(self, context: Context) -> None:
        """The job as this worker's site policy makes it (read at run time, on the site's worker)."""
        self.job = job_at_site(self.job, self.site, context, self.round_num)

    def site_run(self, context: Context) -> SiteRun:
        """The site job of (run, round, site, try): identity, Client API paths, devices."""
        return make_site_run(
            self.job, self.site, self.round_num, context, argv=self.argv(), global_task_id=self.global_task_id
        )

    def site_secrets(self, context: Context, run: SiteRun) -> dict[str, str]:
        """The site's ``secret_env`` resolved on this worker (a CONFIG_ERROR when one cannot be)."""
        try:
            return resolve_secret_env(self.job, self.site)
        except SiteJobFailed as exc:
            raise self.fail(context, run, JobReturnCode.CONFIG_ERROR, str(exc)) from None

    def check_privacy_budget(self, context: Context, run: SiteRun) -> None:
        """Refuse, before anything is launched, a release that would cross the site's budget."""
        try:
            check_site_budget(run)
        except SiteJobFailed as exc:
            raise self.fail(context, run, JobReturnCode.CONFIG_ERROR, str(exc)) from None

    def claim(self, run: SiteRun) -> None:
        """Claim this try and clear the site's previous result of this round."""
        claim_and_clear(run)

    def end_earlier_tries(
        self, *, context: Context, launcher: JobLauncherSpec | None, identity: JobIdentity
    ) -> list[str]:
        """End the jobs of this site job's earlier tries (found by identity): a try whose worker
        was killed left its job running, unwatched."""
        if launcher is None or identity.try_number <= 1:
            return []
        ended = launcher.terminate_earlier_tries(identity)
        if ended:
            self.log.info("site job %s: ended the jobs of earlier tries: %s", identity.label, ", ".join(ended))
        return ended

    def run_site_job(self, context: Context, run: SiteRun) -> Any:
        """Secrets, claim and clear, earlier tries, launch, watch -- with ``run`` staged or not."""
        try_number = try_number_of(context)
        secrets = self.site_secrets(context, run)
        identity = JobIdentity.of(run.site_job(), try_number)
        with self.launch_errors(context, run):
            launcher = self.launcher(try_number=try_number, secrets=secrets)
            handle = self.reattach(launcher=launcher, identity=identity)
        if handle is None:
            self.check_privacy_budget(context, run)
            self.claim(run)
            with self.launch_errors(context, run):
                self.end_earlier_tries(context=context, launcher=launcher, identity=identity)
                handle = self.launch(
                    context=context, run=run, launcher=launcher, try_number=try_number, secrets=secrets
                )
        self._handle = handle
        return self.watch(context=context, run=run, handle=handle)

    @contextlib.contextmanager
    def launch_errors(self, context: Context, run: SiteRun) -> Iterator[None]:
        """What stops a launch becomes the site's failure with its return code: nothing runs.

        A failure already named (``SiteJobFailed``) and Airflow's own control flow (skip, defer,
        interruption) pass through; a backend that could not be reached or refused the call is an
        INFRASTRUCTURE_ERROR.
        """
        try:
            yield
        except AirflowException:
            raise
        except LaunchError as exc:
            raise self.fail(context, run, exc.return_code, str(exc)) from None
        except FlareAirflowError as exc:
            raise self.fail(context, run, JobReturnCode.CONFIG_ERROR, str(exc)) from None
        except Exception as exc:
            detail = " ".join(str(exc).split())[:500] or type(exc).__name__
            raise self.fail(context, run, JobReturnCode.INFRASTRUCTURE_ERROR, f"cannot launch: {detail}") from None

    def finish(
        self, context: Context, run: SiteRun, rc: JobReturnCode, *, handle: Any = None, reason: str | None = None
    ) -> dict[str, Any]:
        """Accept the update of a job that succeeded, or fail with the job's reason and last lines."""
        if rc is JobReturnCode.SUCCESS:
            return accept_update(context, self.site, self.round_num, run)
        if isinstance(handle, JobHandleSpec):
            if not handle.state.finished:
                handle.terminate()
            reason = reason or handle.reason or handle.state.value
            tail = last_lines(handle)
            if tail:
                reason += f"; its last log lines: {tail}"
        raise self.fail(
            context, run, rc if rc is not JobReturnCode.UNKNOWN else JobReturnCode.EXECUTION_ERROR, reason or rc.name
        )

    def fail(self, context: Context, run: SiteRun, rc: JobReturnCode, reason: str) -> SiteJobFailed:
        """The site's failure: in its failure record, in XCom and in the returned exception."""
        write_failure(path_from_uri(run.output), rc, reason)
        return site_failed(context, self.site, self.round_num, f"{reason} [{rc.name}]")

    def on_kill(self) -> None:
        if isinstance(self._handle, JobHandleSpec):
            self.log.info("task killed: ending site job %s", self._handle.where())
            self._handle.terminate()

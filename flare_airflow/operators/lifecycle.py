"""The site-task lifecycle, once: what every site task does around its backend's job.

astronomer-cosmos's shape (``AbstractDbtBase`` mixed into each execution mode's operator): the
base owns the steps, in order -- may-run check, site policy, the site run, secrets, claim and
clear, earlier tries, launch, watch (in the worker or deferred to the triggerer), resume, accept
or fail -- and a backend's operator fills hooks (keyword-only, as the cncf provider's pod
callbacks): :meth:`SiteTaskLifecycle.argv`, :meth:`~SiteTaskLifecycle.launch`, and
:meth:`~SiteTaskLifecycle.trigger` where its job is watched by a trigger. Every failure leaves the
reason with its return code in the site's failure record (where the aggregation reads it) and in
XCom; a job is never left running when the task ends, whichever way it ends.

The lifecycle is generic over the backend's handle ``H`` (what :meth:`~SiteTaskLifecycle.launch`
returns and every later step is handed) and needs of the operator it is mixed into only
:class:`SiteTaskHost` (any ``BaseOperator``); ``tests/unit/operators/test_lifecycle.py`` runs it
against a fake backend and a fake host. A job that runs beyond the worker but shares a folder with
it (a pod site with store links) is staged there by the steps of
:class:`~flare_airflow.operators.shared_links.SharedLinksSteps`, which the lifecycle mixes in.

Every site task is built on it: the process task (:mod:`~flare_airflow.operators.site`), the pod
task (:mod:`~flare_airflow.operators.pod`), the SLURM task (:mod:`~flare_airflow.operators.slurm`),
the container task (:mod:`~flare_airflow.operators.container`) and the launch of the launch +
sensor pair (:mod:`~flare_airflow.operators.site_job`, whose watch hands the job to the sensor,
which ends it with the same :func:`~flare_airflow.operators.site_outputs.finish_site_job`).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import time
from collections.abc import Iterator, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, Generic, NoReturn, Protocol, TypeVar, cast, runtime_checkable

from airflow.sdk import Context
from airflow.sdk.exceptions import AirflowException, AirflowSkipException, TaskDeferred

from flare_airflow.core.config import JobConfig
from flare_airflow.core.errors import FlareAirflowError, StoreError
from flare_airflow.core.spec import JobHandleSpec, JobIdentity, JobLauncherSpec, JobReturnCode
from flare_airflow.launchers.errors import LaunchError
from flare_airflow.operators.common import store_for
from flare_airflow.operators.links import site_links
from flare_airflow.operators.shared_links import SharedLinksSteps
from flare_airflow.operators.site_outputs import Summary, claim_and_clear, finish_site_job, record_site_failure
from flare_airflow.operators.site_steps import (
    SiteJobFailed,
    check_site_budget,
    check_site_task_may_run,
    job_at_site,
    make_site_run,
    resolve_secret_env,
    site_failed,
    site_launcher,
    site_task_defaults,
    try_number_of,
)
from flare_airflow.operators.staging import check_connection, is_local, staged, unusable_store
from flare_airflow.site_task.checks import GlobalModelUnusable, check_global_model
from flare_airflow.site_task.spec import SiteRun

if TYPE_CHECKING:
    from airflow.sdk.types import Logger
    from airflow.triggers.base import BaseTrigger

#: The backend's handle of a launched site job: a launcher spec's ``JobHandleSpec``, a pod, or
#: ``None`` for a job that is the task's own process.
H = TypeVar("H")

#: A trigger's event payload (JSON: ``status``, ``reason``, ``return_code`` and the backend's own keys).
WatchEvent = dict[str, Any]


@runtime_checkable
class SiteTaskHost(Protocol):
    """What the lifecycle asks of the operator it is mixed into; every ``BaseOperator`` has it."""

    task_id: str
    execution_timeout: timedelta | None

    @property
    def log(self) -> Logger: ...

    def defer(
        self,
        *,
        trigger: BaseTrigger,
        method_name: str,
        kwargs: dict[str, Any] | None = None,
        timeout: timedelta | int | float | None = None,
    ) -> NoReturn: ...


class SiteTaskLifecycle(SharedLinksSteps, abc.ABC, Generic[H]):
    """The steps of one site's task of one round; mixed into a backend's operator (first base).

    The operator is a :class:`SiteTaskHost` (``BaseOperator`` is). It fills :meth:`argv` and,
    where the launcher spec's defaults do not fit, :meth:`launch`, :meth:`trigger` (a job watched
    by a trigger: deferred to the triggerer when ``deferrable``, else run in the worker; both end
    in :meth:`resume`), :meth:`on_event` and :meth:`end_job`; the other steps are methods too,
    overridden only where a backend really differs (each override says why).

    :param job: the validated job.
    :param site: the site (a key of ``job.sites``).
    :param round_num: the round, 1-based; rounds beyond the run's ``rounds`` are skipped.
    :param global_task_id: the task whose XCom names the input global model's sha256 (set by the builder).

    Every other keyword goes to the operator's own base class, after the site's defaults (pool,
    queue, executor, retries, timeout) were filled in.
    """

    #: The Rendered Templates tab's fields every site task shows: which site job this is.
    site_template_fields: ClassVar[tuple[str, ...]] = ("job_name", "site", "round_num")

    #: The job sees the model store through a local copy staged on this worker (process and
    #: container jobs read the worker's files); a pod or a SLURM job reaches the store itself.
    stages_store: ClassVar[bool] = True

    #: The site's own runner checks the input global model against its record before the trainer
    #: starts (a process site); every other backend's job runs the trainer itself, so the worker
    #: checks the copy it staged before the launch (:meth:`check_input`).
    runner_checks_input: ClassVar[bool] = False

    #: The method a deferred watch resumes in (the pod task keeps the stock operator's name).
    resume_method: ClassVar[str] = "resume"

    #: Watch in the triggerer (a backend with a :meth:`trigger`); set by the operator.
    deferrable: bool = False

    # The running job, for on_kill (whatever the backend's launch returned).
    _handle: H | None = None
    # This process's site run (site_run); a backend whose site policy changes the job resets it.
    _run: SiteRun | None = None

    def __init__(
        self, *, job: JobConfig, site: str, round_num: int, global_task_id: str | None = None, **kwargs: Any
    ) -> None:
        if not callable(getattr(type(self), "defer", None)):  # before the base class sees the site's defaults
            raise TypeError(f"{type(self).__name__} mixes in SiteTaskLifecycle without an operator (SiteTaskHost)")
        site_task_defaults(job, site, kwargs)
        super().__init__(**kwargs)
        if not isinstance(self, SiteTaskHost):
            raise TypeError(f"{type(self).__name__} mixes in SiteTaskLifecycle without an operator (SiteTaskHost)")
        self.job = job
        self.job_name = job.job
        self.site = site
        self.round_num = round_num
        self.global_task_id = global_task_id

    @property
    def host(self) -> SiteTaskHost:
        """This task as the operator it is (checked in ``__init__``)."""
        return cast(SiteTaskHost, self)

    # ------------------------------------------------------------------ the backend's hooks

    @abc.abstractmethod
    def argv(self) -> list[str]:
        """The trainer's exact argv where the site runs it."""

    def launcher(self, *, try_number: int, secrets: Mapping[str, str]) -> JobLauncherSpec | None:
        """The site's launcher on this worker, from its backend's registry entry; its secrets'
        values are hidden from every line it shows. ``None``: the backend launches without one."""
        return site_launcher(
            self.job, self.site, try_number=try_number, sink=lambda line: self.host.log.info("%s", line),
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
    ) -> H:
        """Start the site job; what :meth:`watch` follows (by default the launcher spec's handle)."""
        if launcher is None:
            raise NotImplementedError(f"{type(self).__name__} launches without a launcher: it fills launch itself")
        handle = launcher.launch_job(run.site_job(), {"try_number": try_number, "secrets": dict(secrets)})
        self.host.log.info("site job %s launched: %s", JobIdentity.of(run.site_job(), try_number).label, handle.where())
        return cast(H, handle)  # a backend with a launcher spec is generic over its JobHandleSpec

    def trigger(self, *, context: Context, run: SiteRun, handle: H) -> BaseTrigger | None:
        """The trigger that watches the job (the same one deferred or in the worker, so both modes
        share one state table); ``None``: the handle's own ``wait`` in the worker."""
        return None

    def defer_watch(self, *, context: Context, trigger: BaseTrigger) -> None:
        """Hand the watch to the triggerer; it resumes in :attr:`resume_method`. The deferral's
        timeout is the execution deadline plus a minute: the trigger enforces the deadline itself
        and ends the job, which Airflow's own timeout of a deferred task gives no chance to."""
        self.host.defer(trigger=trigger, method_name=self.resume_method, timeout=self.defer_timeout(context))

    def on_event(self, *, context: Context, run: SiteRun, event: WatchEvent) -> Summary:
        """The trigger's event: accept, or end what may still run and fail with its return code."""
        status = event.get("status")
        if status == "success":
            return self.finish(context, run, JobReturnCode.SUCCESS)
        if status in ("error", "timeout"):
            self.end_watched_job(event)  # it may still run: it must not outlive the task
        rc = JobReturnCode(int(event.get("return_code", int(JobReturnCode.EXECUTION_ERROR))))
        return self.finish(context, run, rc, reason=str(event.get("reason") or status))

    def end_watched_job(self, event: WatchEvent) -> None:
        """End the job a trigger's event names (a resumed task holds no handle)."""

    def end_job(self, handle: H) -> None:
        """End a job this task launched (killed, timed out, interrupted, or a failed watch)."""
        if isinstance(handle, JobHandleSpec):
            handle.terminate()

    def reattach(self, *, launcher: JobLauncherSpec | None, identity: JobIdentity) -> H | None:
        """This try's job when it was launched already (then nothing is cleared or launched);
        a site task's own job never is: it ends with the task."""
        return None

    # ------------------------------------------------------------------ the steps, in order

    def execute(self, context: Context) -> Any:
        self.check_may_run(context)
        self.apply_site_policy(context)
        run = self.site_run(context)
        if not self.stages_store:
            shared = self.shared_staging(context, run, resumed=False)
            if shared is None:
                return self.run_site_job(context, run)
            return self.through_shared(context, run, shared, lambda: self.run_site_job(context, shared.local))
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
            reason = unusable_store(store, exc, through_links=links is not None, conn_id=self.job.store_conn_id)
            raise site_failed(context, self.site, self.round_num, reason) from None  # the round holds
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
        """The site job of (run, round, site, try): identity, Client API paths, devices. Made once
        per process, after the site policy: the launch, the job's watch and its resume share it."""
        if self._run is None:
            self._run = make_site_run(
                self.job, self.site, self.round_num, context, argv=self.argv(), global_task_id=self.global_task_id
            )
        return self._run

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
            self.host.log.info("site job %s: ended the jobs of earlier tries: %s", identity.label, ", ".join(ended))
        return ended

    def run_site_job(self, context: Context, run: SiteRun) -> Any:
        """Secrets, claim and clear, earlier tries, launch, watch -- with ``run`` staged or not."""
        try_number = try_number_of(context)
        secrets = self.site_secrets(context, run)
        identity = JobIdentity.of(run.site_job(), try_number)
        with self.launch_errors(context, run):
            launcher = self.launcher(try_number=try_number, secrets=secrets)
            found = self.reattach(launcher=launcher, identity=identity)
        if found is None:
            self.check_privacy_budget(context, run)
            self.check_input(context, run)
            self.claim(run)
            with self.launch_errors(context, run):
                self.end_earlier_tries(context=context, launcher=launcher, identity=identity)
                handle = self.launch(
                    context=context, run=run, launcher=launcher, try_number=try_number, secrets=secrets
                )
        else:
            handle = found
        self._handle = handle
        return self.watch(context=context, run=run, handle=handle)

    def check_input(self, context: Context, run: SiteRun) -> None:
        """Before a job that runs the trainer itself (not the site's runner): the input global model
        this worker staged -- the store's copy, or the one staged through links in a shared folder --
        against its record and the digest its producer signed. A replaced model never reaches a
        trainer (a trainer off the Client API would otherwise train on it); the site fails with the
        reason (INFRASTRUCTURE_ERROR, as the runner says it). A job that reaches the store itself
        (a pod or a cluster job on the store) is left to the Client API: nothing is staged here."""
        if self.runner_checks_input or not (self.stages_store or self._shared is not None):
            return
        try:
            check_global_model(run)
        except GlobalModelUnusable as exc:
            raise self.fail(context, run, JobReturnCode.INFRASTRUCTURE_ERROR, str(exc)) from None

    def watch(self, *, context: Context, run: SiteRun, handle: H) -> Any:
        """Wait for the job to end, then accept or fail; the task's XCom.

        With a :meth:`trigger`: deferred to the triggerer when ``deferrable`` (resumed in
        :meth:`resume`), else the same trigger run here. Without one: the handle's own ``wait``.
        Whatever stops the watch before its decision (killed, timed out, interrupted, the
        deferral refused) ends the job first.
        """
        try:
            trigger = self.trigger(context=context, run=run, handle=handle)
            if trigger is None:
                if not isinstance(handle, JobHandleSpec):
                    raise NotImplementedError(f"{type(self).__name__}: a job without a trigger is a JobHandleSpec")
                rc = handle.wait()
            else:
                if self.deferrable:
                    self.defer_watch(context=context, trigger=trigger)
                event = self.run_trigger_here(trigger)
        except (TaskDeferred, AirflowSkipException):
            raise
        except BaseException:
            self.end_job(handle)
            raise
        if trigger is None:
            return self.finish(context, run, rc, handle=handle)
        if event.get("status") == "error":
            # No triggerer to hand the watch back to: the job cannot be followed, so it ends here.
            event = {**event, "status": "timeout"}
        return self.resume(context, event)

    def run_trigger_here(self, trigger: BaseTrigger) -> WatchEvent:
        """The trigger's first event, waited for in this worker."""

        async def first_event() -> WatchEvent:
            async for event in trigger.run():
                return dict(event.payload)
            return {
                "status": "error",
                "return_code": int(JobReturnCode.INFRASTRUCTURE_ERROR),
                "reason": f"{type(trigger).__name__} ended without an event",
            }

        return asyncio.run(first_event())

    def resume(self, context: Context, event: WatchEvent) -> Summary:
        """Where a watch ends (from the triggerer, or this worker): the event decides.

        A task resumed from the triggerer is a new process that parsed the DAG afresh: the site
        policy and the site run are made again before the backend reads the event.
        """
        self.apply_site_policy(context)
        run = self.site_run(context)
        try:
            shared = self.shared_staging(context, run, resumed=True)
        except BaseException:
            self.end_watched_job(event)  # its result cannot be collected here: it must not outlive the task
            raise
        if shared is None:
            return self.on_event(context=context, run=run, event=event)
        return self.through_shared(
            context, run, shared, lambda: self.on_event(context=context, run=shared.local, event=event)
        )

    def execution_deadline(self, context: Context | None) -> float | None:
        """When the task's ``execution_timeout`` ends (epoch seconds), counted from its start."""
        start = getattr(context["ti"], "start_date", None) if context else None
        timeout = self.host.execution_timeout
        if timeout is None or start is None:
            return None
        return float(start.timestamp() + timeout.total_seconds())

    def defer_timeout(self, context: Context | None) -> timedelta | None:
        deadline = self.execution_deadline(context)
        return None if deadline is None else timedelta(seconds=max(0.0, deadline - time.time()) + 60)

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
        self, context: Context, run: SiteRun, rc: JobReturnCode, *, handle: H | None = None, reason: str | None = None
    ) -> Summary:
        """Accept the update of a job that succeeded, or fail with the job's reason and last lines."""
        return finish_site_job(context, run, self.site, self.round_num, rc, handle=handle, reason=reason)

    def fail(self, context: Context, run: SiteRun, rc: JobReturnCode, reason: str) -> SiteJobFailed:
        """The site's failure: in its failure record, in XCom and in the returned exception."""
        return record_site_failure(context, run, self.site, self.round_num, rc, reason)

    def on_kill(self) -> None:
        if self._handle is not None:
            self.host.log.info("task killed: ending site job %s of %s", self.site, self.host.task_id)
            self.end_job(self._handle)
        self.end_shared_on_kill()

"""Site job task for SLURM sites: the site job is one batch job on the site's cluster.

The job is submitted by :class:`flare_airflow.launchers.slurm.SlurmLauncher` (the one script and
``sbatch`` builder) from this worker or through the site's SSH connection, then watched by
:class:`flare_airflow.triggers.slurm_state.SlurmJobTrigger` -- in the triggerer when deferrable
(``[operators] default_deferrable``, or ``deferrable=``), in the worker otherwise; both modes run
the same trigger, so they share one state table. Around the job, the same steps as a Kubernetes
site's task: claim the try and clear the site's previous result before submitting, and check and
publish what the trainer sent after it succeeded (:mod:`flare_airflow.site_task`).

A job never outlives its task: a later try cancels the jobs of earlier tries (found by name) before
submitting; ``on_kill`` (sync mode), the trigger's ``on_kill`` (deferred: marked failed, cleared),
an execution timeout, a pending timeout and every failure path ``scancel`` it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from airflow.providers.common.compat.sdk import conf
from airflow.sdk import BaseOperator, Context

from flare_airflow.core.config import JobConfig, SlurmLaunchSpec
from flare_airflow.core.spec import JobIdentity, JobLauncherSpec, SiteJob
from flare_airflow.hooks.slurm import slurm_commands
from flare_airflow.launchers.errors import LaunchError
from flare_airflow.launchers.slurm import (
    SlurmCommandError,
    SlurmJobHandle,
    SlurmLauncher,
    cancel,
    list_jobs,
    site_job_prefix,
)
from flare_airflow.launchers.trainer import output_prefix, trainer_argv
from flare_airflow.operators.lifecycle import SiteTaskLifecycle
from flare_airflow.operators.sweep import SweepOperator
from flare_airflow.site_task.spec import SiteRun
from flare_airflow.triggers.slurm_state import SlurmJobTrigger


def slurm_launcher(
    job: JobConfig, site: str, *, try_number: int, sink: Callable[[str], None] | None, hidden: Sequence[str]
) -> SlurmLauncher:
    """A SLURM site's launcher: local commands or the site's SSH connection."""
    spec = job.sites[site]
    slurm = spec.launcher_spec.slurm
    return SlurmLauncher(
        slurm, spec.resource_spec, commands=slurm_commands(slurm), try_number=try_number, sink=sink, hidden=hidden
    )


def slurm_trigger(job: JobConfig, site: str, handle: Any, round_num: int) -> SlurmJobTrigger:
    """A SLURM site job's deferrable watch for the sensor: the fused SLURM task's own trigger."""
    return SlurmJobTrigger.for_job(
        job.sites[site].launcher_spec.slurm,
        handle.submitted,
        offset=handle.output.offset,  # the lines before it are in the task log already
        prefix=f"[{site} r{round_num}] ",
        cancel_on_kill=False,
    )


class SiteSlurmOperator(SiteTaskLifecycle[SlurmJobHandle], BaseOperator):
    """Train one site for one round as a SLURM batch job.

    The lifecycle's arguments (:class:`~flare_airflow.operators.lifecycle.SiteTaskLifecycle`), and

    :param deferrable: wait in the triggerer (``True``) or in the worker; by default what
        ``[operators] default_deferrable`` says.

    Returns (XCom) the update's URI, sha256, sample count and metrics; never weights.
    """

    ui_color = "#b8e0d2"
    # The Rendered Templates tab: which site job this is, and where it is submitted. The job's
    # environment (secrets resolved per try) is never a template field.
    template_fields: Sequence[str] = (
        *SiteTaskLifecycle.site_template_fields, "connection", "partition", "account", "qos",
    )  # fmt: skip
    stages_store = False  # the cluster's nodes reach the store themselves

    def __init__(
        self,
        *,
        deferrable: bool = conf.getboolean("operators", "default_deferrable", fallback=False),
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        spec = self.spec
        self.deferrable = deferrable
        self.connection = spec.connection
        self.partition = spec.partition
        self.account = spec.account
        self.qos = spec.qos

    @property
    def spec(self) -> SlurmLaunchSpec:
        return self.job.sites[self.site].launcher_spec.slurm

    def argv(self) -> list[str]:
        return trainer_argv(self.job, cluster=self.spec)

    def end_earlier_tries(
        self, *, context: Context, launcher: JobLauncherSpec | None, identity: JobIdentity
    ) -> list[str]:
        assert isinstance(launcher, SlurmLauncher)
        try:
            return self.cancel_earlier_tries(launcher.commands, identity.site_job(), identity.try_number)
        except SlurmCommandError as exc:  # nothing was submitted: the site's cluster cannot be asked
            raise LaunchError(str(exc)) from None

    def launch(
        self,
        *,
        context: Context,
        run: SiteRun,
        launcher: JobLauncherSpec | None,
        try_number: int,
        secrets: Mapping[str, str],
    ) -> SlurmJobHandle:
        handle: SlurmJobHandle = super().launch(
            context=context, run=run, launcher=launcher, try_number=try_number, secrets=secrets
        )
        submitted = handle.submitted
        self.log.info(
            "site %s round %d: SLURM job %s (%s) submitted%s; output %s",
            self.site,
            self.round_num,
            submitted.job_id,
            submitted.name,
            f" through {self.connection}" if self.spec.ssh_conn_id else "",
            submitted.output,
        )
        return handle

    def trigger(self, *, context: Context, run: SiteRun, handle: SlurmJobHandle) -> SlurmJobTrigger:
        """The job's trigger; in the worker (not deferrable) its output streams into the task log."""
        trigger = SlurmJobTrigger.for_job(
            self.spec,
            handle.submitted,
            prefix=output_prefix(run.site_job()),
            execution_deadline=self.execution_deadline(context),
        )
        if not self.deferrable:
            trigger.stream_to(lambda line: self.log.info("%s", line))
        return trigger

    def cancel_earlier_tries(self, commands: Any, run: SiteRun | SiteJob, try_number: int) -> list[str]:
        """Cancel this site job's jobs of earlier tries (found by name) before this try submits its
        own: a try whose worker was killed left its job queued or running, unwatched. Returns their ids."""
        if try_number <= 1:
            return []
        identity = JobIdentity(self.job.job, run.run_id, self.round_num, self.site, try_number)
        cancelled = SlurmLauncher(self.spec, commands=commands).terminate_earlier_tries(identity)
        if cancelled:
            self.log.info(
                "site %s round %d try %d: cancelled the SLURM jobs of earlier tries: %s",
                self.site,
                self.round_num,
                try_number,
                ", ".join(cancelled),
            )
        return [entry.split(" ", 1)[0] for entry in cancelled]

    def _cancel_quietly(self, job_id: str) -> None:
        try:
            cancel(slurm_commands(self.spec), [job_id])
        except SlurmCommandError as exc:  # the original error matters more; say why the job may remain
            self.log.warning("could not cancel SLURM job %s: %s", job_id, exc)

    def end_job(self, handle: SlurmJobHandle) -> None:
        self.log.info("ending SLURM job %s", handle.job_id)
        self._cancel_quietly(handle.job_id)

    def end_watched_job(self, event: dict[str, Any]) -> None:
        if event.get("job_id"):
            self._cancel_quietly(str(event["job_id"]))

    def on_event(self, *, context: Context, run: SiteRun, event: dict[str, Any]) -> dict[str, Any]:
        self.log.info(
            "site %s round %d SLURM job %s: %s (%s)",
            self.site, self.round_num, event.get("job_id"), event.get("status"), event.get("native"),
        )  # fmt: skip
        return super().on_event(context=context, run=run, event=event)


class SweepSlurmJobsOperator(SweepOperator):
    """Cancel every SLURM job of this run still queued or running, on every SLURM site's cluster.

    The builder adds it as the run's teardown (for jobs with SLURM sites), as ``sweep_pods`` for
    Kubernetes sites. Such a job belongs to a try that can no longer cancel it: a task marked
    failed while deferred before the triggerer started its trigger, or a killed worker's try that
    was the last one. Jobs are found by name (every round and site of this run); best effort: a
    cluster that cannot be reached is logged and the run's result stands.
    """

    sweep_doc = "Cancel SLURM jobs this run left queued or running."

    def execute(self, context: Context) -> list[str]:
        return self.sweep_site_jobs(context)

    def sweep_site_jobs(self, context: Context) -> list[str]:
        """The jobs cancelled, as ``<connection>:<job id> (<name>)``."""
        from flare_airflow.operators.common import run_id_of

        run_id = run_id_of(context)
        by_connection: dict[str, list[str]] = {}
        for site, spec in self.swept_sites().items():
            prefixes = by_connection.setdefault(spec.launcher_spec.slurm.connection, [])
            prefixes += [site_job_prefix(self.job.job, run_id, r, site) for r in range(1, self.job.rounds + 1)]
        cancelled: list[str] = []
        for connection, prefixes in sorted(by_connection.items()):
            commands = slurm_commands(connection)
            try:
                found = [(i, n) for i, n, _ in list_jobs(commands, "fl-") if n.startswith(tuple(prefixes))]
                cancel(commands, [i for i, _ in found])
            except SlurmCommandError as exc:
                self.log.warning("could not sweep the SLURM jobs of this run through %s: %s", connection, exc)
                continue
            cancelled += [f"{connection}:{job_id} ({name})" for job_id, name in found]
        if cancelled:
            self.log.warning("cancelled SLURM jobs this run left queued or running: %s", ", ".join(cancelled))
        return cancelled

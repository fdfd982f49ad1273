"""Watch a site job launched by another task, through the launcher spec.

:class:`SiteJobSensor` finds the job by its identity (job, run, round, site, try) -- from the
launching task's XCom, or given -- with the site backend's :meth:`find_job`, never by an
in-memory handle: a worker restart, a retry, a cleared sensor re-attach to the same pod, SLURM
job or container instead of starting another. Each check polls the job through the backend's state table
(``docs/state-mapping.md``): ``poke`` mode and ``mode="reschedule"`` poll from the worker;
deferrable mode waits in the triggerer with the trigger the backend's registry entry names
(:class:`~flare_airflow.triggers.pod_state.PodStateTrigger`,
:class:`~flare_airflow.triggers.slurm_state.SlurmJobTrigger`,
:class:`~flare_airflow.triggers.container_state.ContainerJobTrigger`), which emit typed events.

When the job succeeded, the sensor checks and publishes the site's update (exactly once: a
cleared sensor finds it published and reports it again) and returns its summary as XCom, like
the fused site task. When the job failed, the sensor fails (``soft_fail``: is skipped) with the
job's return code, reason and last log lines, and leaves them in the site's failure record.
A sensor that times out or is killed leaves the job running (it belongs to its launch; the run's
sweep teardown ends what is left).
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from airflow.providers.common.compat.sdk import conf
from airflow.sdk import Context
from airflow.sdk.bases.sensor import BaseSensorOperator, PokeReturnValue
from airflow.sdk.bases.xcom import BaseXCom
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from flare_airflow.core.config import JobConfig
from flare_airflow.core.errors import ConfigError
from flare_airflow.core.failure_record import read_failure
from flare_airflow.core.model import read_artifact
from flare_airflow.core.spec import JobHandleSpec, JobIdentity, JobReturnCode, JobState
from flare_airflow.core.store import path_from_uri, record_path
from flare_airflow.operators.bindings import binding
from flare_airflow.operators.common import push_failure
from flare_airflow.operators.site_job import watched_job
from flare_airflow.operators.site_outputs import Summary, finish_site_job, record_site_failure
from flare_airflow.operators.site_steps import (
    SiteJobFailed,
    job_at_site,
    make_site_run,
    site_argv,
    site_launcher,
    site_task_defaults,
)
from flare_airflow.site_task.checks import published_summary
from flare_airflow.site_task.spec import SiteRun


class SiteJobSensor(BaseSensorOperator):
    """Wait for one site's job of one round to end; publish its update.

    :param job: the job (a validated :class:`JobConfig` or the path of its YAML file).
    :param site: the site (launcher ``k8s`` or ``slurm``).
    :param round_num: the round, 1-based.
    :param launch_task_id: the task whose XCom holds the job's identity (a
        :class:`~flare_airflow.operators.site_job.SiteJobLaunchOperator`).
    :param identity: the identity itself (a dict with job, run_id, round, site, try_number;
        templated) instead of ``launch_task_id``.
    :param deferrable: wait in the triggerer; by default what ``[operators] default_deferrable``
        says. Otherwise ``mode`` (``poke`` or ``reschedule``) decides, as for every sensor.
    :param poke_interval: seconds between checks; default: the site's ``poll_interval``.

    Every other sensor argument (``timeout``, ``soft_fail``, ``mode``, ``exponential_backoff``)
    means what it means for any Airflow sensor. Returns (XCom) the update's URI, sha256, sample
    count and metrics, as the fused site task does.
    """

    ui_color = "#e8f4d9"
    template_fields: Sequence[str] = ("job_name", "site", "round_num", "launch_task_id", "identity")

    def __init__(
        self,
        *,
        job: JobConfig | str | pathlib.Path,
        site: str,
        round_num: int,
        launch_task_id: str | None = None,
        identity: dict[str, Any] | None = None,
        deferrable: bool = conf.getboolean("operators", "default_deferrable", fallback=False),
        **kwargs: Any,
    ) -> None:
        cfg = watched_job(job, site)
        if (launch_task_id is None) == (identity is None):
            raise ConfigError(f"site {site!r} round {round_num}: give the sensor either launch_task_id or identity")
        kwargs.setdefault("poke_interval", cfg.sites[site].block.poll_interval)
        # The site's pool, queue, executor and retries, as every site task; the trainer's timeout
        # bounds the wait (the sensor's timeout: execution_timeout would not count reschedules).
        given_execution_timeout = "execution_timeout" in kwargs
        site_task_defaults(cfg, site, kwargs)
        if not given_execution_timeout:
            kwargs.pop("execution_timeout", None)
        if cfg.trainer.timeout:
            kwargs.setdefault("timeout", cfg.trainer.timeout)
        super().__init__(**kwargs)
        self.job = cfg
        self._declared = cfg  # the job as the DAG declares it; self.job: as this worker's site policy makes it
        self.job_name = cfg.job
        self.site = site
        self.round_num = round_num
        self.launch_task_id = launch_task_id
        self.identity = identity
        self.deferrable = deferrable
        self._found: tuple[JobIdentity, Any] | None = None
        self._lines: list[str] = []

    # ------------------------------------------------------------------ the job and its result

    def _identity(self, context: Context) -> JobIdentity:
        data = self.identity
        if data is None:
            data = context["ti"].xcom_pull(task_ids=self.launch_task_id)
        if not data:
            raise AirflowFailException(
                f"site {self.site!r} round {self.round_num}: {self.launch_task_id} left no site job identity in "
                "its XCom; clear it (with downstream) to launch the job"
            )
        try:
            identity = JobIdentity.from_dict(data)
        except ValueError as exc:
            raise AirflowFailException(f"site {self.site!r} round {self.round_num}: {exc}") from None
        if (identity.job, identity.site, identity.round) != (self.job.job, self.site, self.round_num):
            raise AirflowFailException(
                f"site {self.site!r} round {self.round_num} of job {self.job.job!r}: the identity it was given is of "
                f"{identity.label}"
            )
        return identity

    def _run(self, context: Context, identity: JobIdentity) -> SiteRun:
        return make_site_run(
            self.job,
            self.site,
            self.round_num,
            context,
            argv=site_argv(self.job, self.site),
            try_number=identity.try_number,
        )

    def _fail(self, context: Context, run: SiteRun | None, rc: JobReturnCode, reason: str) -> AirflowFailException:
        """The sensor's failure (``soft_fail`` turns it into a skip), recorded as every site task
        records it; not retried -- the job ended: clear the launch task to run it again."""
        return AirflowFailException(str(record_site_failure(context, run, self.site, self.round_num, rc, reason)))

    def _recorded(self, run: SiteRun) -> dict[str, Any] | None:
        """The update this site job already published (a cleared sensor), or ``None``."""
        output = path_from_uri(run.output)
        staged = path_from_uri(run.staging) if run.staging else None
        if staged is not None and record_path(staged).exists():
            return None  # sent and not yet published: accept_update does it
        if not record_path(output).exists():
            return None
        _, record = read_artifact(output)  # verified against its record
        return published_summary(run, record)  # signed again: the aggregation counts only signed updates

    def _succeeded(self, context: Context, run: SiteRun, identity: JobIdentity) -> dict[str, Any]:
        recorded = self._recorded(run)
        if recorded is not None:
            self.log.info("site job %s: its update was already published; reporting it", identity.label)
            context["ti"].xcom_push(key=BaseXCom.XCOM_RETURN_KEY, value=recorded)
            return recorded
        return self._finish(context, run, JobReturnCode.SUCCESS, None)

    def _finish(self, context: Context, run: SiteRun, rc: JobReturnCode, handle: JobHandleSpec | None) -> Summary:
        """The site task's own decision on an ended job (:func:`finish_site_job`); its failure --
        an unusable update or a failed job -- is the job's result, not the watch's: not retried."""
        try:
            return finish_site_job(context, run, self.site, self.round_num, rc, handle=handle)
        except SiteJobFailed as exc:
            raise AirflowFailException(str(exc)) from None

    def check(self, context: Context) -> dict[str, Any] | None:
        """One look at the job: its update's summary when it succeeded, ``None`` while it runs;
        raises :class:`AirflowFailException` when it failed or cannot be found."""
        return self._look(context)[0]

    def _look(self, context: Context, offset: int | None = None) -> tuple[dict[str, Any] | None, Any]:
        """:meth:`check`, and the job's handle while it runs. ``offset``: bytes of a SLURM job's
        output already in the task log (its trigger showed them)."""
        # The worker's site policy (namespace, cluster, SLURM block) says where the job was launched.
        self.job = job_at_site(self._declared, self.site, context, self.round_num)
        identity = self._identity(context)
        run = self._run(context, identity)
        handle = self._found[1] if self._found is not None and self._found[0] == identity else None
        if handle is None:
            launcher = site_launcher(self.job, self.site, try_number=identity.try_number, sink=self._lines.append)
            try:
                handle = launcher.find_job(identity)
            except Exception as exc:  # the backend cannot be asked now: a retry looks again
                detail = " ".join(str(exc).split())[:500] or type(exc).__name__
                message = (
                    f"site {self.site!r} round {self.round_num}: cannot look for site job {identity.label}: "
                    f"{detail} [INFRASTRUCTURE_ERROR]"
                )
                push_failure(context, message)
                raise AirflowException(message) from None
            if handle is None:
                return self._gone(context, run, identity), None
            if offset is not None and hasattr(handle, "output"):
                handle.output.offset = offset
        rc = handle.poll()
        state = handle.state
        if self.reschedule and not state.finished:
            # Each reschedule finds the job afresh and reads its output from the start: show it once, at the end.
            self._lines.clear()
        else:
            for line in self._lines:
                self.log.info("%s", line)
            self._lines.clear()
        if not state.finished:
            self._found = (identity, handle)  # the next poke of this process continues with it
            self.log.info("site job %s: %s", identity.label, state.value)
            return None, handle
        self._found = None
        if state is JobState.SUCCEEDED:
            return self._succeeded(context, run, identity), None
        return self._finish(context, run, rc, handle), None

    def _gone(self, context: Context, run: SiteRun, identity: JobIdentity) -> dict[str, Any]:
        """No such job (any more): a finished pod is deleted; its result is in the store."""
        recorded = self._recorded(run)
        if recorded is not None:
            return self._succeeded(context, run, identity)
        failure = read_failure(path_from_uri(run.output))
        if failure is not None:
            raise self._fail(context, None, JobReturnCode.EXECUTION_ERROR, f"its recorded result: {failure}")
        raise self._fail(
            context,
            run,
            JobReturnCode.INFRASTRUCTURE_ERROR,
            f"site job {identity.label} was not found on the site's backend and left no result: it was deleted or "
            "never launched; clear the launch task (with downstream) to run it again",
        )

    # ------------------------------------------------------------------ poke / reschedule

    def poke(self, context: Context) -> bool | PokeReturnValue:
        summary = self.check(context)
        return False if summary is None else PokeReturnValue(True, xcom_value=summary)

    # ------------------------------------------------------------------ deferrable

    def execute(self, context: Context) -> Any:
        if not self.deferrable or binding(self.job.sites[self.site].launcher).trigger is None:
            # A backend without a trigger in the registry is watched from the worker, in the
            # sensor's poke or reschedule mode.
            return super().execute(context)
        self._defer_or_finish(context)

    def _defer_or_finish(self, context: Context) -> Any:
        summary, handle = self._look(context)
        if summary is not None:
            return summary
        self.defer(
            trigger=self._trigger(handle),
            method_name="execute_complete",
            timeout=timedelta(seconds=self.timeout) if self.timeout is not None else None,
        )

    def _trigger(self, handle: Any) -> Any:
        make = binding(self.job.sites[self.site].launcher).trigger
        assert make is not None, "execute defers only a backend with a trigger"
        return make(self.job, self.site, handle, self.round_num)

    def execute_complete(self, context: Context, event: dict[str, Any]) -> Any:
        """The trigger saw the job end (or could not watch it): look at the job once more, through
        the same handle and state table as ``poke``, and decide there."""
        self.log.info("site %s round %d: trigger event %s (%s)", self.site, self.round_num, event.get("status"),
                      event.get("reason") or event.get("state"))  # fmt: skip
        offset = event.get("offset")
        summary, handle = self._look(context, offset=int(offset) if isinstance(offset, int) else None)
        if summary is not None:
            return summary
        if event.get("status") == "error":
            raise self._fail(
                context,
                None,
                JobReturnCode.INFRASTRUCTURE_ERROR,
                f"the watch of site {self.site!r} round {self.round_num} failed ({event.get('reason')}); the job "
                "still runs: clear this sensor to watch it again",
            )
        # A state the handle does not call final yet (a pending timeout counted from another
        # start): wait again.
        self.defer(trigger=self._trigger(handle), method_name="execute_complete")

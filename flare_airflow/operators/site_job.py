"""Launch a site job through the launcher spec in one task; watch it in another
(:class:`flare_airflow.sensors.site_job.SiteJobSensor`).

:class:`SiteJobLaunchOperator` starts one site job (a pod, a SLURM batch job) of one round and
returns its identity -- (job, run, round, site, try) -- as XCom, nothing else: whoever holds the
identity finds the job again through the backend (:meth:`JobLauncherSpec.find_job`), whichever
process launched it. The launch is idempotent: a launch whose job already exists (same identity
and try) re-attaches instead of starting a second one; a later try first ends the jobs of earlier
tries (:meth:`terminate_earlier_tries`), as the fused site task does.

Process sites cannot be watched from another task (their job ends with the task that launched
it, by design): for them the fused :class:`~flare_airflow.operators.site.SiteTrainOperator` stays.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from typing import Any

from airflow.sdk import BaseOperator, Context
from airflow.sdk.exceptions import AirflowFailException

from flare_airflow.core.config import JobConfig, load_job
from flare_airflow.core.errors import ConfigError
from flare_airflow.core.spec import JobHandleSpec, JobIdentity, JobLauncherSpec
from flare_airflow.operators.common import FINISHED_STATES, task_states
from flare_airflow.operators.lifecycle import SiteTaskLifecycle
from flare_airflow.operators.site_steps import (
    site_argv,
    skip_beyond_rounds,
    try_number_of,
    watchable,
)
from flare_airflow.site_task.spec import SiteRun


def watched_job(job: JobConfig | str | pathlib.Path, site: str) -> JobConfig:
    """The job of a launch + sensor pair (a validated :class:`JobConfig` or its YAML file's path),
    checked at parse time: ``site`` is one of its sites and its jobs can be watched by a sensor."""
    cfg = job if isinstance(job, JobConfig) else load_job(job)
    if site not in cfg.sites:
        raise ConfigError(f"site {site!r} is not a site of job {cfg.job!r} (sites: {', '.join(cfg.sites)})")
    watchable(cfg, site)
    return cfg


class SiteJobLaunchOperator(SiteTaskLifecycle[JobHandleSpec], BaseOperator):
    """Launch one site's job of one round through the site's launcher spec; return its identity.

    The site-task lifecycle up to the launch; its watch hands the job to a
    :class:`~flare_airflow.sensors.site_job.SiteJobSensor`, and a launch that finds this try's
    job already running re-attaches to it instead of launching a second.

    :param job: the job (a validated :class:`JobConfig` or the path of its YAML file).
    :param site: the site (a backend with ``watch: sensor``; a process site is a configuration error).
    :param round_num: the round, 1-based; rounds beyond the run's ``rounds`` are skipped.
    :param global_task_id: the task whose XCom names the input global model's sha256 (the trainer
        verifies the model it receives against it).

    Returns (XCom) the job's identity ``{"job", "run_id", "round", "site", "try_number"}`` plus
    where it runs (``backend`` and pod, SLURM job or container id); a :class:`SiteJobSensor` reads
    it. The site's previous update of this round is cleared before the launch; the sensor
    publishes the new one.
    """

    ui_color = "#d0e6f5"
    template_fields: Sequence[str] = SiteTaskLifecycle.site_template_fields
    stages_store = False  # the job outlives this task: it reaches the store itself

    def __init__(
        self,
        *,
        job: JobConfig | str | pathlib.Path,
        site: str,
        round_num: int,
        global_task_id: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            job=watched_job(job, site), site=site, round_num=round_num, global_task_id=global_task_id, **kwargs
        )

    def argv(self) -> list[str]:
        return site_argv(self.job, self.site)

    def check_may_run(self, context: Context) -> None:
        """Skip a round beyond the run's ``rounds``; refuse a launch cleared without its watch.

        A launch cleared on its own after its sensor finished would start a job nobody watches: its
        update would never be published. It fails instead, before launching, saying what to clear.
        """
        skip_beyond_rounds(context, self.job, self.round_num)
        downstream = sorted(getattr(context.get("task"), "downstream_task_ids", None) or ())
        done = {t: s for t, s in task_states(context, downstream).items() if s in FINISHED_STATES}
        if done:
            task_id, state = sorted(done.items())[0]
            raise AirflowFailException(
                f"site {self.site!r} round {self.round_num} not launched: its watch {task_id} already finished "
                f"({state}) and was not cleared with this task, so the job's update would never be published. "
                f"Clear {context['ti'].task_id} with 'Downstream' on and 'Only failed' off"
            )

    def reattach(self, *, launcher: JobLauncherSpec | None, identity: JobIdentity) -> JobHandleSpec | None:
        """This try launched it already (its task process was lost after the launch)."""
        assert launcher is not None
        found = launcher.find_job(identity)
        if found is not None:
            self.log.info("site job %s already launched: %s; not launching another", identity.label, found.where())
        return found

    def watch(self, *, context: Context, run: SiteRun, handle: JobHandleSpec) -> dict[str, Any]:
        """The sensor watches: hand it the job's identity and where it runs."""
        identity = JobIdentity.of(run.site_job(), try_number_of(context))
        return {**identity.to_dict(), **handle.where()}

    def on_kill(self) -> None:
        """The job belongs to the launch, not to this task's process: the sensor watches it, the
        run's sweep ends what is left."""

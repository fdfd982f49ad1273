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
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator, Context
from airflow.sdk.exceptions import AirflowFailException

from flare_airflow.core.backends import BACKENDS, load
from flare_airflow.core.config import JobConfig, load_job
from flare_airflow.core.errors import ConfigError, FlareAirflowError
from flare_airflow.core.spec import JobIdentity, JobReturnCode
from flare_airflow.launchers.errors import LaunchError
from flare_airflow.launchers.trainer import trainer_argv
from flare_airflow.operators.common import FINISHED_STATES, store_for, task_states
from flare_airflow.operators.site import (
    SiteJobFailed,
    job_at_site,
    make_site_run,
    resolve_secret_env,
    site_config_failed,
    site_task_defaults,
    skip_beyond_rounds,
)
from flare_airflow.operators.site_outputs import claim_and_clear
from flare_airflow.site_task.spec import SiteRun

if TYPE_CHECKING:
    from flare_airflow.core.spec import JobLauncherSpec
    from flare_airflow.launchers.kubernetes import KubernetesLauncher
    from flare_airflow.launchers.slurm import SlurmLauncher


def watchable(job: JobConfig, site: str) -> None:
    """Raise :class:`ConfigError` unless ``site``'s jobs can be watched by a sensor."""
    backend = job.sites[site].backend
    if not backend.watchable:
        titles = [b.title for b in BACKENDS.values() if b.watchable]
        others = ", ".join(titles[:-1]) + " and " + titles[-1]
        raise ConfigError(
            f"site {site!r}: a {backend.name} site job cannot be launched in one task and watched in another -- it "
            f"ends with the task that launched it (a {backend.name} job never outlives its task); use the fused site "
            f"task (watch: task) for {backend.name} sites; {others} sites can use watch: sensor"
        )


def as_job(job: JobConfig | str | pathlib.Path) -> JobConfig:
    return job if isinstance(job, JobConfig) else load_job(job)


def site_launcher(
    job: JobConfig,
    site: str,
    *,
    try_number: int = 1,
    sink: Callable[[str], None] | None = None,
    hidden: Sequence[str] = (),
) -> JobLauncherSpec:
    """The site's launcher (launcher spec) on this worker, built by its backend's registry entry."""
    watchable(job, site)
    factory = load(str(job.sites[site].backend.launcher))
    launcher: JobLauncherSpec = factory(job, site, try_number=try_number, sink=sink, hidden=hidden)
    return launcher


def kubernetes_launcher(
    job: JobConfig, site: str, *, try_number: int, sink: Callable[[str], None] | None, hidden: Sequence[str]
) -> KubernetesLauncher:
    """A Kubernetes site's launcher: its cluster through the site's Airflow connection (``KubernetesHook``)."""
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook

    from flare_airflow.launchers.kubernetes import KubernetesLauncher

    spec = job.sites[site]
    k8s = spec.launcher_spec.k8s
    hook = KubernetesHook(
        conn_id=k8s.kubernetes_conn_id,
        in_cluster=k8s.in_cluster,
        config_file=k8s.config_file,
        cluster_context=k8s.cluster_context,
    )
    return KubernetesLauncher(
        k8s,
        spec.resource_spec,
        store_root=str(store_for(job).root),
        api_client=hook.api_client,
        try_number=try_number,
        sink=sink,
    )


def slurm_launcher(
    job: JobConfig, site: str, *, try_number: int, sink: Callable[[str], None] | None, hidden: Sequence[str]
) -> SlurmLauncher:
    """A SLURM site's launcher: local commands or the site's SSH connection."""
    from flare_airflow.hooks.slurm import slurm_commands
    from flare_airflow.launchers.slurm import SlurmLauncher

    spec = job.sites[site]
    slurm = spec.launcher_spec.slurm
    return SlurmLauncher(
        slurm, spec.resource_spec, commands=slurm_commands(slurm), try_number=try_number, sink=sink, hidden=hidden
    )


def site_argv(job: JobConfig, site: str) -> list[str]:
    """The trainer's argv where the site runs it: this worker, an image, a cluster."""
    spec = job.sites[site]
    if spec.backend.argv == "image":
        return trainer_argv(job, spec.block)
    if spec.backend.argv == "cluster":
        return trainer_argv(job, cluster=spec.block)
    return trainer_argv(job)


class SiteJobLaunchOperator(BaseOperator):
    """Launch one site's job of one round through the site's launcher spec; return its identity.

    :param job: the job (a validated :class:`JobConfig` or the path of its YAML file).
    :param site: the site (launcher ``k8s`` or ``slurm``; a process site is a configuration error).
    :param round_num: the round, 1-based; rounds beyond the run's ``rounds`` are skipped.
    :param global_task_id: the task whose XCom names the input global model's sha256 (the trainer
        verifies the model it receives against it).

    Returns (XCom) the job's identity ``{"job", "run_id", "round", "site", "try_number"}`` plus
    where it runs (``backend`` and pod or SLURM job id); a :class:`SiteJobSensor` reads it. The
    site's previous update of this round is cleared before the launch; the sensor publishes the
    new one.
    """

    ui_color = "#d0e6f5"
    template_fields: Sequence[str] = ("job_name", "site", "round_num")

    def __init__(
        self,
        *,
        job: JobConfig | str | pathlib.Path,
        site: str,
        round_num: int,
        global_task_id: str | None = None,
        **kwargs: Any,
    ) -> None:
        cfg = as_job(job)
        if site not in cfg.sites:
            raise ConfigError(f"site {site!r} is not a site of job {cfg.job!r} (sites: {', '.join(cfg.sites)})")
        watchable(cfg, site)
        site_task_defaults(cfg, site, kwargs)
        super().__init__(**kwargs)
        self.job = cfg
        self.job_name = cfg.job
        self.site = site
        self.round_num = round_num
        self.global_task_id = global_task_id

    def _failed(self, context: Context, rc: JobReturnCode, reason: str) -> Exception:
        return site_config_failed(context, self.job, self.site, self.round_num, f"{reason} [{rc.name}]")

    def _check_may_launch(self, context: Context) -> None:
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

    def execute(self, context: Context) -> dict[str, Any]:
        self._check_may_launch(context)
        self.job = job_at_site(self.job, self.site, context, self.round_num)
        try_number = int(context["ti"].try_number or 1)
        run: SiteRun = make_site_run(
            self.job,
            self.site,
            self.round_num,
            context,
            argv=site_argv(self.job, self.site),
            global_task_id=self.global_task_id,
            try_number=try_number,
        )
        site_job = run.site_job()
        identity = JobIdentity.of(site_job, try_number)
        secrets: dict[str, str] = {}
        if self.job.sites[self.site].backend.worker_secrets:
            try:
                secrets = resolve_secret_env(self.job, self.site)
            except SiteJobFailed as exc:
                raise self._failed(context, JobReturnCode.CONFIG_ERROR, str(exc)) from None
        try:
            launcher = site_launcher(self.job, self.site, try_number=try_number, hidden=list(secrets.values()))
            found = launcher.find_job(identity)
            if found is not None:
                # This try launched it already (its task process was lost after the launch).
                self.log.info("site job %s already launched: %s; not launching another", identity.label, found.where())
                return {**identity.to_dict(), **found.where()}
            claim_and_clear(run)
            ended = launcher.terminate_earlier_tries(identity)
            if ended:
                self.log.info("site job %s: ended the jobs of earlier tries: %s", identity.label, ", ".join(ended))
            handle = launcher.launch_job(
                replace(site_job, argv=tuple(run.argv)), {"try_number": try_number, "secrets": secrets}
            )
        except LaunchError as exc:  # nothing was started; the backend says why (pull failure, bad spec)
            raise self._failed(context, exc.return_code, str(exc)) from None
        except FlareAirflowError as exc:  # ConfigError: nothing was started
            raise self._failed(context, JobReturnCode.CONFIG_ERROR, str(exc)) from None
        except Exception as exc:  # the cluster could not be reached or refused the call
            detail = " ".join(str(exc).split())[:500] or type(exc).__name__
            raise self._failed(context, JobReturnCode.INFRASTRUCTURE_ERROR, f"cannot launch: {detail}") from None
        self.log.info("site job %s launched: %s", identity.label, handle.where())
        return {**identity.to_dict(), **handle.where()}

"""Site job task for process sites: a BashOperator whose command is fixed and whose input is data.

The shell never sees user input: ``bash_command`` is ``exec <python> -m
flare_airflow.launchers.site_runner`` and the site job (argv, environment, paths) travels as JSON
in one environment variable. The runner starts the trainer from that argv without a shell, in its
own process group, and forwards Airflow's SIGTERM to it.
"""

from __future__ import annotations

import json
import shlex
import sys
from datetime import timedelta
from typing import Any

from airflow.providers.standard.operators.bash import BashOperator
from airflow.sdk import Context
from airflow.sdk.exceptions import AirflowException, AirflowSkipException

from flare_airflow.core.config import JobConfig
from flare_airflow.core.errors import FlareAirflowError
from flare_airflow.core.store import path_from_uri
from flare_airflow.launchers.site_runner import SPEC_ENV, SUMMARY_PREFIX, SiteRun, read_failure
from flare_airflow.operators.common import run_id_of, run_params, store_for


class SiteJobFailed(FlareAirflowError, AirflowException):
    """A site's trainer failed or sent an unusable update."""


def _summary(output: str) -> dict[str, Any] | None:
    line = output.strip().splitlines()[-1] if output.strip() else ""
    if line.startswith(SUMMARY_PREFIX):
        return dict(json.loads(line[len(SUMMARY_PREFIX) :]))
    return None


def trainer_argv(job: JobConfig) -> list[str]:
    command = job.trainer.command or [sys.executable]
    return [*command, str(job.script_path()), *job.trainer.args]


def site_task_defaults(job: JobConfig, site: str, kwargs: dict[str, Any]) -> None:
    """Task arguments every site task gets from the site's spec: pool, retries, timeout."""
    spec = job.sites[site]
    pool = spec.pool_name(site)
    if pool is not None:
        # One slot per GPU: the pool's slots are the site's GPUs (see docs/gpu-pools.md).
        kwargs.setdefault("pool", pool)
        kwargs.setdefault("pool_slots", spec.resource_spec.num_of_gpus)
    kwargs.setdefault("retries", spec.retries)
    kwargs.setdefault("retry_delay", timedelta(seconds=spec.retry_delay_seconds))
    if job.trainer.timeout:
        kwargs.setdefault("execution_timeout", timedelta(seconds=job.trainer.timeout))


def skip_beyond_rounds(context: Context, job: JobConfig, round_num: int) -> None:
    params = run_params(context, job)
    if round_num > params.rounds:
        raise AirflowSkipException(
            f"round {round_num} skipped: this run asked for {params.rounds} of at most {job.rounds} rounds"
        )


def make_site_run(job: JobConfig, site: str, round_num: int, context: Context, *, argv: list[str]) -> SiteRun:
    """The site job of (run, round, site): identity, Client API paths, hyper-parameters, devices."""
    params = run_params(context, job)
    store = store_for(job)
    run_id = run_id_of(context)
    spec = job.sites[site]
    process = spec.launcher_spec.process
    manager = spec.resource_manager
    local = spec.launcher == "process"
    return SiteRun(
        job=job.job,
        run_id=run_id,
        round=round_num,
        total_rounds=params.rounds,
        site=site,
        task="train",
        argv=argv,
        global_model=str(store.global_model(job.job, run_id, round_num - 1)),
        output=str(store.site_update(job.job, run_id, round_num, site)),
        env=dict(process.env) if local else {},
        hparams=params.hparams,
        cwd=str(job.resolve(process.cwd)) if local and process.cwd else None,
        launch_timeout=job.trainer.launch_timeout,
        shutdown_timeout=job.trainer.shutdown_timeout,
        assign_gpus=local and manager is not None and manager.type == "gpu" and not manager.ignore_host,
        num_gpus=spec.resource_spec.num_of_gpus,
        gpu_capacity=manager.num_of_gpus if manager is not None else None,
        mem_per_gpu_gib=spec.resource_spec.mem_per_gpu_in_GiB,
    )


class SiteTrainOperator(BashOperator):
    """Train one site for one round as a local process.

    :param job: the validated job.
    :param site: the site's name (a key of ``job.sites``).
    :param round_num: the round, 1-based. Rounds beyond the run's ``rounds`` parameter are skipped.

    Returns (XCom) the update's URI, sha256, sample count and metrics; never weights.
    """

    ui_color = "#d9f0d3"
    template_fields = ()

    def __init__(self, *, job: JobConfig, site: str, round_num: int, **kwargs: Any) -> None:
        site_task_defaults(job, site, kwargs)
        super().__init__(
            bash_command=f"exec {shlex.quote(sys.executable)} -m flare_airflow.launchers.site_runner",
            append_env=True,
            skip_on_exit_code=None,
            do_xcom_push=True,
            output_processor=_summary,
            **kwargs,
        )
        self.job = job
        self.site = site
        self.round_num = round_num
        self._spec_json = ""

    def site_run(self, context: Context) -> SiteRun:
        return make_site_run(self.job, self.site, self.round_num, context, argv=trainer_argv(self.job))

    def get_env(self, context: Context) -> dict[str, str]:
        env = super().get_env(context)
        env[SPEC_ENV] = self._spec_json
        return env

    def execute(self, context: Context) -> Any:
        skip_beyond_rounds(context, self.job, self.round_num)
        run = self.site_run(context)
        self._spec_json = run.to_json()
        self.log.info("site %s round %d: %s", self.site, self.round_num, shlex.join(run.argv))
        try:
            return super().execute(context)
        except AirflowException as exc:
            if isinstance(exc, AirflowSkipException):
                raise
            reason = read_failure(path_from_uri(run.output)) or str(exc)
            raise SiteJobFailed(f"site {self.site!r} round {self.round_num} failed: {reason}") from None

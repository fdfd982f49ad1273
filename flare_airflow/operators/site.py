"""Site job task for process sites: the site-task lifecycle whose job is a fixed shell command.

:class:`SiteTrainOperator` is :class:`~flare_airflow.operators.lifecycle.SiteTaskLifecycle` mixed
into a ``BashOperator``. The shell never sees user input: ``bash_command`` is ``exec <python> -m
flare_airflow.site_task`` and the site job (argv, environment, paths) travels as JSON in one
environment variable. The runner starts the trainer from that argv without a shell, in its own
process group, forwards Airflow's SIGTERM to it, and claims, checks and publishes in the job's own
process (so a process job never outlives its task: no earlier tries to end, no sensor to watch it).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import sys
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

from airflow.providers.standard.operators.bash import BashOperator
from airflow.sdk import Context
from airflow.sdk.exceptions import AirflowException, AirflowSkipException

from flare_airflow.core.failure_record import read_failure
from flare_airflow.core.spec import JobLauncherSpec, JobReturnCode
from flare_airflow.core.store import path_from_uri
from flare_airflow.launchers.process.launcher import scratch_prefix
from flare_airflow.launchers.trainer import trainer_argv
from flare_airflow.operators.lifecycle import SiteTaskLifecycle
from flare_airflow.operators.site_steps import (
    SiteJobFailed,
    noise_secret_for,
    site_failed,
)
from flare_airflow.site_task.owners import owners_value
from flare_airflow.site_task.spec import (
    NOISE_SECRET_ENV,
    OWNERS_ENV,
    RESULT_FILE_ENV,
    SECRETS_ENV,
    SPEC_ENV,
    SUMMARY_PREFIX,
    SiteRun,
)


def _runner_reason(path: str) -> str | None:
    try:
        with open(path) as fh:
            data = json.loads(fh.read(1 << 16) or "null")
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or "reason" not in data:
        return None
    return f"{data['reason']} [{data.get('name', '?')}]"


def _supervisor_pid() -> list[int]:
    """The Task SDK supervisor's pid when it runs this task in a process of its own (a worker),
    else nothing: ``airflow dags test`` runs tasks in-process and its parent may be any shell."""
    try:
        from airflow.sdk.execution_time import task_runner
        from airflow.sdk.execution_time.comms import CommsDecoder
    except ImportError:
        return []
    return [os.getppid()] if isinstance(getattr(task_runner, "SUPERVISOR_COMMS", None), CommsDecoder) else []


def _summary(output: str) -> dict[str, Any] | None:
    line = output.strip().splitlines()[-1] if output.strip() else ""
    if line.startswith(SUMMARY_PREFIX):
        return dict(json.loads(line[len(SUMMARY_PREFIX) :]))
    return None


class SiteTrainOperator(SiteTaskLifecycle[None], BashOperator):
    """Train one site for one round as a local process.

    Its arguments are the lifecycle's (:class:`~flare_airflow.operators.lifecycle.SiteTaskLifecycle`).

    Returns (XCom) the update's URI, sha256, sample count and metrics; never weights.
    """

    ui_color = "#d9f0d3"
    runner_checks_input = True  # the runner it starts checks the input global model (site_task/runner.py)
    # The Rendered Templates tab: which site job this is, plus BashOperator's own fields (the
    # fixed runner command; ``env`` and ``cwd`` stay unset -- the site job's environment travels
    # in the runner's spec at execute time and secret values never reach a template field).
    template_fields: Sequence[str] = (*SiteTaskLifecycle.site_template_fields, *BashOperator.template_fields)
    _secrets_json = ""
    _result_file = ""
    _noise_secret: str | None = None

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(
            bash_command=f"exec {shlex.quote(sys.executable)} -m flare_airflow.site_task",
            append_env=True,
            skip_on_exit_code=None,
            do_xcom_push=True,
            output_processor=_summary,
            **kwargs,
        )
        self._spec_json = ""

    def argv(self) -> list[str]:
        return trainer_argv(self.job)

    def get_env(self, context: Context) -> dict[str, str]:
        env = super().get_env(context)
        env[SPEC_ENV] = self._spec_json
        # This task process and its supervisor: the site job ends when either does (a killed
        # supervisor leaves the task process running, and the kernel tells the runner only of its parent).
        env[OWNERS_ENV] = owners_value([os.getpid(), *_supervisor_pid()])
        env[RESULT_FILE_ENV] = self._result_file
        if self._secrets_json:
            env[SECRETS_ENV] = self._secrets_json
        if self._noise_secret:
            env[NOISE_SECRET_ENV] = self._noise_secret
        return env

    # The job is the shell command's process: no launcher spec, and the runner claims the try in
    # the job's own process (a process job cannot outlive its task, so no earlier try's job runs).
    def launcher(self, *, try_number: int, secrets: Mapping[str, str]) -> JobLauncherSpec | None:
        return None

    def claim(self, run: SiteRun) -> None:
        return None

    def launch(
        self,
        *,
        context: Context,
        run: SiteRun,
        launcher: JobLauncherSpec | None,
        try_number: int,
        secrets: Mapping[str, str],
    ) -> None:
        """Give the runner its spec, secrets and result file; the shell command starts it in :meth:`watch`."""
        self._secrets_json = json.dumps(dict(secrets)) if secrets else ""
        try:
            self._noise_secret = noise_secret_for(run)
        except SiteJobFailed as exc:
            raise self.fail(context, run, JobReturnCode.CONFIG_ERROR, str(exc)) from None
        self.log.info("site %s round %d: %s", self.site, self.round_num, shlex.join(run.argv))
        # Named after this task process: if it is killed (SIGKILL: no finally), a later launch on
        # the host sweeps the file (launchers/process/launcher.py, sweep_scratch).
        fd, self._result_file = tempfile.mkstemp(prefix=scratch_prefix("flare-site-result-"))
        os.close(fd)
        self._spec_json = run.to_json()

    def watch(self, *, context: Context, run: SiteRun, handle: None) -> Any:
        """Run the runner as the shell command; it checks and publishes the update itself."""
        try:
            return BashOperator.execute(self, context)
        except AirflowException as exc:
            if isinstance(exc, AirflowSkipException):
                raise
            reason = _runner_reason(self._result_file) or read_failure(path_from_uri(run.output)) or str(exc)
            raise site_failed(context, self.site, self.round_num, reason) from None
        finally:
            with contextlib.suppress(OSError):
                os.unlink(self._result_file)

    def on_kill(self) -> None:
        BashOperator.on_kill(self)  # SIGTERM to the runner, which ends the trainer

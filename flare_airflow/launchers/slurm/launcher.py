"""The SLURM launcher spec: a site job is one batch job, submitted with ``sbatch --parsable``.

:class:`SlurmLauncher` builds the batch script and ``sbatch`` command (:mod:`.script`), submits
through a :class:`~flare_airflow.launchers.slurm.commands.SlurmCommands` (this host, or a login
node over SSH) and returns a :class:`SlurmJobHandle`. The handle reads the job's state
(:func:`~flare_airflow.launchers.slurm.commands.read_job`) through the one state table
(:func:`~flare_airflow.launchers.slurm.state.map_job`), streams the job's output file to a sink
line by line, and ``scancel``s the job on :meth:`~SlurmJobHandle.terminate`. A handle can be
rebuilt from the job's id, name and output file alone (:meth:`SlurmJobHandle.attach`): that is
all a deferred Airflow task or a later try needs.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from flare_airflow.core.config import ResourceSpec, SlurmLaunchSpec
from flare_airflow.core.spec import (
    JobHandleSpec,
    JobIdentity,
    JobLauncherSpec,
    JobReturnCode,
    JobState,
    JobStatus,
    LineSink,
    SiteJob,
    wait_by_polling,
)
from flare_airflow.launchers.errors import LaunchError
from flare_airflow.launchers.slurm.commands import (
    LocalCommands,
    SlurmCommandError,
    SlurmCommands,
    cancel,
    find_jobs,
    list_jobs,
    read_job,
)
from flare_airflow.launchers.slurm.naming import job_name, output_file, site_job_prefix, try_of
from flare_airflow.launchers.slurm.script import batch_script, parse_job_id, sbatch_argv
from flare_airflow.launchers.slurm.state import map_job
from flare_airflow.launchers.trainer import output_prefix

TAIL_LINES = 20
_TAIL_CHARS = 300
# Transient failures of scontrol in a row before the job counts as lost.
_MAX_READ_FAILURES = 5


@dataclass(frozen=True)
class SubmittedJob:
    """What identifies a submitted batch job: enough to rebuild its handle anywhere."""

    job_id: str
    name: str
    output: str
    submitted_at: float


class OutputReader:
    """The job's output file, read from where the last read stopped, as whole lines."""

    def __init__(self, commands: SlurmCommands, path: str, offset: int = 0, hidden: Iterable[str] = ()) -> None:
        self.commands = commands
        self.path = path
        self.offset = offset
        self._partial = b""
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.hidden = {v for v in hidden if v}

    def read(self, final: bool = False) -> list[str]:
        """New complete lines (and, when ``final``, the last line without its newline)."""
        lines: list[str] = []
        while True:
            chunk = self.commands.read_from(self.path, self.offset)
            if not chunk:
                break
            self.offset += len(chunk)
            data = self._partial + chunk
            *complete, self._partial = data.split(b"\n")
            lines += [raw.decode(errors="replace") for raw in complete]
        if final and self._partial:
            lines.append(self._partial.decode(errors="replace"))
            self._partial = b""
        out = []
        for line in lines:
            for value in self.hidden:
                line = line.replace(value, "***")
            if line.strip():
                self.tail.append(line)
            out.append(line)
        return out

    def last_lines(self, count: int = 5) -> str:
        lines = list(self.tail)[-count:]
        return " | ".join(line if len(line) <= _TAIL_CHARS else line[: _TAIL_CHARS - 1] + "…" for line in lines)


class SlurmJobHandle(JobHandleSpec):
    """Handle of one site job's batch job."""

    def __init__(
        self,
        commands: SlurmCommands,
        submitted: SubmittedJob,
        spec: SlurmLaunchSpec,
        *,
        label: str = "",
        sink: LineSink | None = None,
        offset: int = 0,
        hidden: Iterable[str] = (),
    ) -> None:
        self.commands = commands
        self.submitted = submitted
        self.spec = spec
        self.label = label or submitted.name
        self.sink = sink
        self.output = OutputReader(commands, submitted.output, offset, hidden)
        self._status = JobStatus(JobState.STARTING, JobReturnCode.UNKNOWN, "", done=False)
        self._final: JobStatus | None = None
        self._cancelled = False
        self._failures = 0
        self._lock = threading.RLock()

    @classmethod
    def attach(
        cls,
        commands: SlurmCommands,
        submitted: SubmittedJob,
        spec: SlurmLaunchSpec,
        **kwargs: Any,
    ) -> SlurmJobHandle:
        """The handle of a job submitted earlier (by this process or another)."""
        return cls(commands, submitted, spec, **kwargs)

    @property
    def job_id(self) -> str:
        return self.submitted.job_id

    def where(self) -> dict[str, Any]:
        return {"backend": "slurm", "job_id": self.job_id, "name": self.submitted.name}

    @property
    def status(self) -> JobStatus:
        return self._final or self._status

    def _emit(self, lines: list[str]) -> None:
        if self.sink is not None:
            for line in lines:
                self.sink(line)

    def read_status(self) -> JobStatus:
        """One read of the job's state through the state table (no output read, no cancel)."""
        info = read_job(self.commands, self.job_id)
        return map_job(
            info.job_state,
            info.reason,
            info.exit_code,
            pending_seconds=time.time() - self.submitted.submitted_at,
            pending_timeout=self.spec.pending_timeout,
            startup_timeout=self.spec.startup_timeout,
            cancelled_by_us=self._cancelled,
        )

    def poll(self) -> JobReturnCode:
        with self._lock:
            if self._final is not None:
                return self._final.return_code
            try:
                status = self.read_status()
                self._failures = 0
            except SlurmCommandError as exc:
                self._failures += 1
                if self._failures < _MAX_READ_FAILURES:
                    return JobReturnCode.UNKNOWN
                status = JobStatus(
                    JobState.FAILED, JobReturnCode.INFRASTRUCTURE_ERROR, f"cannot read the job's state: {exc}", True
                )
            self._status = status
            self._emit(self.output.read(final=status.done))
            if status.done:
                self._final = status
                if status.state is not JobState.SUCCEEDED and status.state is not JobState.TERMINATED:
                    # Timed out while pending, unknown state, lost: it must not stay queued.
                    self._cancel_quietly()
            return status.return_code

    @property
    def state(self) -> JobState:
        return self.status.state

    @property
    def reason(self) -> str:
        status = self.status
        if not status.done or status.state is JobState.SUCCEEDED:
            return ""
        last = self.output.last_lines()
        where = f"SLURM job {self.job_id} ({status.native})" if status.native else f"SLURM job {self.job_id}"
        return f"{where}: {status.reason}" + (f"; its last output: {last}" if last else "")

    def wait(self, timeout: float | None = None) -> JobReturnCode:
        return wait_by_polling(self.poll, lambda: self._final is not None, self.spec.poll_interval, timeout)

    def _cancel_quietly(self) -> None:
        # The job has ended or slurmctld is unreachable: nothing more to do here.
        with contextlib.suppress(SlurmCommandError):
            cancel(self.commands, [self.job_id])

    def terminate(self, wait_seconds: float = 30.0) -> None:
        """``scancel`` the job and wait (up to ``wait_seconds``) until SLURM reports it ended."""
        with self._lock:
            if self._final is not None:
                return
            self._cancelled = True
            cancel(self.commands, [self.job_id])
            deadline = time.monotonic() + wait_seconds
            while self._final is None and time.monotonic() < deadline:
                self.poll()
                if self._final is None:
                    time.sleep(0.5)


class SlurmLauncher(JobLauncherSpec):
    """Launch site jobs as SLURM batch jobs (NVFlare's SLURM launcher, LazyLLM's ``SlurmLauncher``).

    :param spec: the site's ``launcher_spec.slurm``.
    :param resources: the site job's ``resource_spec`` (GPUs, CPUs, memory).
    :param commands: where SLURM's commands run (default: this host).
    :param sink: receives the job's output line by line (default: none).
    :param try_number: the try this launch is (part of the job's name).
    :param hidden: strings (secret values) replaced by ``***`` in output lines and reasons.
    """

    def __init__(
        self,
        spec: SlurmLaunchSpec,
        resources: ResourceSpec | None = None,
        *,
        commands: SlurmCommands | None = None,
        sink: LineSink | None = None,
        prefix_lines: bool = True,
        try_number: int = 1,
        hidden: Iterable[str] = (),
    ) -> None:
        self.spec = spec
        self.resources = resources or ResourceSpec()
        self.commands = commands or LocalCommands()
        self.sink = sink
        self.prefix_lines = prefix_lines
        self.try_number = try_number
        self.hidden = tuple(v for v in hidden if v)

    def submit(self, job: SiteJob, extra_env: Mapping[str, str] | None = None) -> SubmittedJob:
        """Submit ``job``'s batch job; ``extra_env`` (secrets) goes into the script only."""
        if not job.argv:
            raise LaunchError(f"{job.label}: empty argv")
        name = job_name(job.job, job.run_id, job.round, job.site, self.try_number)
        try:
            output_dir = self.commands.absolute(self.spec.output_dir)
            made = self.commands.run(["mkdir", "-p", "--", output_dir])
            if made.returncode != 0:
                raise LaunchError(
                    f"{job.label}: cannot create output_dir {output_dir} on the submit host: "
                    f"{made.stderr.strip()[:300]}"
                )
            output = output_file(output_dir, name)
            argv = sbatch_argv(self.spec, self.resources, name=name, output=output)
            res = self.commands.run(argv, stdin=batch_script(job, self.spec, extra_env))
        except SlurmCommandError as exc:
            raise LaunchError(f"{job.label}: cannot submit the SLURM job: {exc}") from None
        job_id = parse_job_id(res.stdout)
        if res.returncode != 0 or not job_id:
            detail = (res.stderr or res.stdout).strip().replace("\n", " ")[:500]
            raise LaunchError(
                f"{job.label}: sbatch refused the job ({detail}); check the site's launcher_spec.slurm "
                "(partition, account, qos, time_limit, extra_sbatch_options) and resource_spec against the cluster"
            )
        return SubmittedJob(job_id, name, output, time.time())

    def launch_job(self, job_meta: SiteJob, fl_ctx: Mapping[str, Any] | None = None) -> SlurmJobHandle:
        submitted = self.submit(job_meta, (fl_ctx or {}).get("secrets"))
        prefix = output_prefix(job_meta) if self.prefix_lines else ""
        sink = self.sink

        def emit(line: str) -> None:
            if sink is not None:
                sink(prefix + line)

        return SlurmJobHandle(self.commands, submitted, self.spec, label=job_meta.label, sink=emit, hidden=self.hidden)

    def find_job(self, identity: JobIdentity) -> SlurmJobHandle | None:
        """The handle of the batch job submitted under ``identity`` (found by its name, whoever
        submitted it: ``squeue``, then accounting or the job completion log), or ``None``.

        Its output file follows from the name (``output_dir``); pending timeouts count from its
        submit time. Raises :class:`LaunchError` when SLURM cannot be asked.
        """
        name = job_name(identity.job, identity.run_id, identity.round, identity.site, identity.try_number)
        try:
            found = find_jobs(self.commands, name)
            if not found:
                return None
            output = output_file(self.commands.absolute(self.spec.output_dir), name)
        except SlurmCommandError as exc:
            raise LaunchError(f"{identity.label}: cannot look for SLURM job {name}: {exc}") from None
        newest = found[0]
        submitted = SubmittedJob(newest.job_id, name, output, newest.submitted_at or time.time())
        prefix = output_prefix(identity.site_job()) if self.prefix_lines else ""
        sink = self.sink

        def emit(line: str) -> None:
            if sink is not None:
                sink(prefix + line)

        return SlurmJobHandle.attach(
            self.commands, submitted, self.spec, label=identity.label, sink=emit, hidden=self.hidden
        )

    def terminate_earlier_tries(self, identity: JobIdentity) -> list[str]:
        """``scancel`` the queued or running jobs of the tries of this site job before
        ``identity``'s (found by name): they run unwatched, their tries are over. Returns what
        was cancelled, as ``<job id> (<name>)``; raises :class:`SlurmCommandError`."""
        prefix = site_job_prefix(identity.job, identity.run_id, identity.round, identity.site)
        earlier = [
            (job_id, name)
            for job_id, name, _ in list_jobs(self.commands, prefix)
            if (number := try_of(name, prefix)) is not None and number < identity.try_number
        ]
        cancel(self.commands, [job_id for job_id, _ in earlier])
        return [f"{job_id} ({name})" for job_id, name in earlier]

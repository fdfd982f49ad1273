"""Talking to SLURM: its client commands run locally or on a login node, and what they print.

A :class:`SlurmCommands` runs one command from an argv (locally without a shell; over SSH as
``shlex.join(argv)``, every word quoted), can feed it text on stdin (the batch script goes to
``sbatch`` that way: no script file to leave behind) and reads a file's bytes from an offset (the
job's output). :class:`LocalCommands` is the local one; the Airflow layer provides one over an
SSH connection (``flare_airflow.hooks.slurm``). Reads of the job state are parsed here.
"""

from __future__ import annotations

import abc
import os
import shlex
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from flare_airflow.launchers.process.environment import trainer_environment

COMMAND_TIMEOUT = 60.0
_MAX_READ = 1 << 20


@dataclass(frozen=True)
class CommandResult:
    returncode: int
    stdout: str
    stderr: str


class SlurmCommandError(RuntimeError):
    """A SLURM command could not be run at all (no such program, connection lost, timeout)."""


class SlurmCommands(abc.ABC):
    """Where SLURM's client commands run: this host or a login node."""

    @abc.abstractmethod
    def run(self, argv: Sequence[str], stdin: str | None = None, timeout: float = COMMAND_TIMEOUT) -> CommandResult:
        """Run ``argv`` (never through a shell with unquoted words) and return what it printed."""

    @abc.abstractmethod
    def home(self) -> str:
        """The submitting user's home directory on the submit host (relative paths start there)."""

    def read_from(self, path: str, offset: int, limit: int = _MAX_READ) -> bytes:
        """Up to ``limit`` bytes of ``path`` from ``offset`` (``b""`` if it does not exist yet)."""
        res = self.run(
            ["sh", "-c", 'tail -c +"$1" -- "$2" 2>/dev/null | head -c "$3"', "read", str(offset + 1), path, str(limit)]
        )
        return res.stdout.encode("utf-8", errors="surrogateescape")

    def absolute(self, path: str) -> str:
        expanded = path if path.startswith("/") else f"{self.home().rstrip('/')}/{path.removeprefix('~/')}"
        return os.path.normpath(expanded)


def submit_environment(base: Mapping[str, str]) -> dict[str, str]:
    """The environment ``sbatch`` runs with locally, which the job inherits (``--export=ALL``): the
    worker's minus Airflow's own variables and minus the ``SLURM_*`` of any job the worker itself
    runs in (``SLURM_CONF`` stays: it names the cluster)."""
    env = trainer_environment(base, {})
    return {k: v for k, v in env.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}


class LocalCommands(SlurmCommands):
    """SLURM's commands on this host (the Airflow worker is a submit host)."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self.env = submit_environment(os.environ if env is None else env)

    def run(self, argv: Sequence[str], stdin: str | None = None, timeout: float = COMMAND_TIMEOUT) -> CommandResult:
        try:
            res = subprocess.run(
                list(argv),
                input=stdin,
                capture_output=True,
                text=True,
                errors="surrogateescape",
                env=self.env,
                timeout=timeout,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise SlurmCommandError(f"cannot run {shlex.join(argv)[:200]}: {exc}") from None
        return CommandResult(res.returncode, res.stdout, res.stderr)

    def home(self) -> str:
        return os.path.expanduser("~")

    def read_from(self, path: str, offset: int, limit: int = _MAX_READ) -> bytes:
        try:
            with open(path, "rb") as fh:
                fh.seek(offset)
                return fh.read(limit)
        except FileNotFoundError:
            return b""
        except OSError as exc:
            raise SlurmCommandError(f"cannot read the job's output {path}: {exc.strerror or exc}") from None


def parse_show_job(text: str) -> dict[str, str]:
    """``scontrol -o show job`` output (one line of ``Key=Value`` words; a value may hold spaces)."""
    fields: dict[str, str] = {}
    key = None
    for word in text.strip().split(" "):
        name, eq, value = word.partition("=")
        if eq and name and name.replace("/", "").replace(":", "").isalnum():
            key = name
            fields[key] = value
        elif key is not None:
            fields[key] += " " + word
    return fields


@dataclass(frozen=True)
class JobInfo:
    """One read of a batch job: SLURM's JobState, Reason and ExitCode (``None`` state: unknown)."""

    job_state: str | None
    reason: str = ""
    exit_code: str = "0:0"
    node_list: str = ""
    source: str = "scontrol"


def read_job(commands: SlurmCommands, job_id: str) -> JobInfo:
    """The job's state from ``scontrol`` while slurmctld remembers it, else from ``sacct``.

    Raises :class:`SlurmCommandError` when slurmctld cannot be asked (not when it forgot the job).
    """
    res = commands.run(["scontrol", "-o", "show", "job", job_id])
    if res.returncode == 0 and "JobState=" in res.stdout:
        fields = parse_show_job(res.stdout.splitlines()[0])
        return JobInfo(
            fields.get("JobState", ""),
            fields.get("Reason", ""),
            fields.get("ExitCode", "0:0"),
            fields.get("NodeList", ""),
        )
    if "Invalid job id" not in res.stderr:
        raise SlurmCommandError(f"scontrol show job {job_id} failed: {(res.stderr or res.stdout).strip()[:300]}")
    acct = commands.run(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "State,ExitCode,Reason"])
    source = "sacct"
    if acct.returncode != 0:
        # No accounting database: the job completion log (JobCompType=jobcomp/filetxt) may have it.
        acct = commands.run(["sacct", "-c", "-n", "-P", "-j", job_id, "-o", "State,ExitCode"])
        source = "jobcomp"
    line = acct.stdout.strip().splitlines()[0] if acct.returncode == 0 and acct.stdout.strip() else ""
    if not line:
        return JobInfo(None, source="none")
    state, _, rest = line.partition("|")
    exit_code, _, reason = rest.partition("|")
    return JobInfo(state, reason, exit_code or "0:0", source=source)


@dataclass(frozen=True)
class FoundJob:
    """A batch job found by name: its id, name, state and when it was submitted (epoch seconds)."""

    job_id: str
    name: str
    state: str
    submitted_at: float


def _epoch(text: str) -> float | None:
    try:
        return datetime.fromisoformat(text.strip()).timestamp()
    except ValueError:
        return None


def find_jobs(commands: SlurmCommands, name: str) -> list[FoundJob]:
    """The submitting user's jobs named exactly ``name``, in any state, newest first: from
    ``squeue -t all`` while slurmctld remembers them (``MinJobAge`` after they end), else from
    accounting (``sacct``) or the job completion log (``sacct -c``) where the cluster keeps one.

    Raises :class:`SlurmCommandError` when slurmctld cannot be asked.
    """
    res = commands.run(["squeue", "--me", "-h", "-t", "all", "-n", name, "-o", "%i|%j|%T|%V"])
    if res.returncode != 0:
        raise SlurmCommandError(f"squeue failed: {res.stderr.strip()[:300]}")
    rows = [line.strip().split("|") for line in res.stdout.splitlines() if line.strip()]
    if not rows:
        for argv in (["sacct", "-n", "-P", "-X"], ["sacct", "-c", "-n", "-P"]):
            acct = commands.run([*argv, "--name", name, "-o", "JobID,JobName,State,Submit"])
            if acct.returncode == 0:
                rows = [line.strip().split("|") for line in acct.stdout.splitlines() if line.strip()]
                break
    found = [
        FoundJob(row[0], row[1], row[2].split()[0] if row[2].strip() else "", _epoch(row[3]) or 0.0)
        for row in rows
        if len(row) >= 4 and row[1] == name and row[0].isdigit()
    ]
    return sorted(found, key=lambda job: int(job.job_id), reverse=True)


def list_jobs(commands: SlurmCommands, prefix: str) -> list[tuple[str, str, str]]:
    """``(job id, name, state)`` of the submitting user's queued or running jobs named ``prefix*``."""
    res = commands.run(["squeue", "--me", "-h", "-o", "%i|%j|%T"])
    if res.returncode != 0:
        raise SlurmCommandError(f"squeue failed: {res.stderr.strip()[:300]}")
    jobs = []
    for line in res.stdout.splitlines():
        job_id, _, rest = line.strip().partition("|")
        name, _, state = rest.partition("|")
        if job_id and name.startswith(prefix):
            jobs.append((job_id, name, state))
    return jobs


def cancel(commands: SlurmCommands, job_ids: Sequence[str]) -> None:
    """``scancel`` the jobs (a job that already ended is no error)."""
    if not job_ids:
        return
    res = commands.run(["scancel", *job_ids])
    if res.returncode != 0 and "Invalid job id" not in res.stderr and "already completing" not in res.stderr:
        raise SlurmCommandError(f"scancel {' '.join(job_ids)} failed: {res.stderr.strip()[:300]}")

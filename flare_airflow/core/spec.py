"""The launcher spec, with NVIDIA FLARE's names and semantics.

``JobLauncherSpec.launch_job(job_meta, fl_ctx) -> JobHandleSpec``; a handle can be polled,
waited on (with an optional timeout) and terminated. Return codes are NVFlare's ``JobReturnCode``.
Every backend maps its native states onto :class:`JobState` and :class:`JobReturnCode` in one
table (see ``docs/state-mapping.md``); an unknown state is never treated as success.
"""

from __future__ import annotations

import abc
import enum
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NotRequired, TypedDict


class JobReturnCode(enum.IntEnum):
    """NVFlare's return codes. ``UNKNOWN`` also means "still running" when polled."""

    SUCCESS = 0
    EXECUTION_ERROR = 1
    ABORTED = 9
    EXCEPTION = 101
    UNSAFE_COMPONENT = 102
    CONFIG_ERROR = 103
    INFRASTRUCTURE_ERROR = 104
    UNKNOWN = 127


class JobState(enum.StrEnum):
    """One set of job states for every backend."""

    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TERMINATED = "terminated"
    UNKNOWN = "unknown"

    @property
    def finished(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.TERMINATED)


@dataclass(frozen=True)
class JobStatus:
    """One read of a site job, the same type for every backend: what it means (state, return code,
    reason), whether it has ended, whether it waits for resources (GPUs, a partition), and the
    backend's own words for it (``native``, e.g. SLURM's ``PENDING (Resources)``)."""

    state: JobState
    return_code: JobReturnCode
    reason: str
    done: bool
    waiting_for_resources: bool = False
    native: str = ""


EventStatus = Literal["success", "failed", "timeout", "error"]


class SiteJobEvent(TypedDict):
    """The payload of every site-job trigger's event (``TriggerEvent(event)``), one type for all backends.

    ``status`` is the cncf provider's vocabulary: ``success``, ``failed``, ``timeout`` (never ran to
    its end), ``error`` (the watch itself failed; the job may still run). ``state`` and
    ``return_code`` are the common :class:`JobState` / :class:`JobReturnCode`; the rest says where
    the job runs (a pod's ``name`` and ``namespace``, a SLURM job's ``job_id``) and what it printed.
    """

    status: EventStatus
    state: str
    return_code: int
    reason: str
    name: NotRequired[str]
    namespace: NotRequired[str]
    job_id: NotRequired[str]
    native: NotRequired[str]
    message: NotRequired[str]
    offset: NotRequired[int]
    last_output: NotRequired[str]
    _redefer_count: NotRequired[int]


@dataclass(frozen=True)
class SiteJob:
    """What a launcher needs to run one site job: identity, exact argv, environment, timeouts.

    ``env`` holds the Client API's ``FLARE_*`` variables and site policy variables. Secrets are
    never put here by the Airflow layer as values in argv; ``argv`` is executed without a shell.
    """

    job: str
    run_id: str
    round: int
    site: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None
    launch_timeout: float | None = None
    shutdown_timeout: float = 10.0

    @property
    def label(self) -> str:
        return f"{self.job}/{self.site}/r{self.round}"


@dataclass(frozen=True)
class JobIdentity:
    """Which launch of a site job: (job, run, round, site) and the try that launched it.

    Every backend can name and label its jobs from it, so a job is found again from its identity
    alone (:meth:`JobLauncherSpec.find_job`): by a later try, a sensor in another process, a
    teardown. It travels as a plain dict (XCom) through :meth:`to_dict` / :meth:`from_dict`.
    """

    job: str
    run_id: str
    round: int
    site: str
    try_number: int = 1

    @classmethod
    def of(cls, site_job: SiteJob, try_number: int) -> JobIdentity:
        return cls(site_job.job, site_job.run_id, site_job.round, site_job.site, try_number)

    def to_dict(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "run_id": self.run_id,
            "round": self.round,
            "site": self.site,
            "try_number": self.try_number,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> JobIdentity:
        """The identity in ``data``; ``ValueError`` naming what is missing or malformed."""
        try:
            return cls(
                job=str(data["job"]),
                run_id=str(data["run_id"]),
                round=int(data["round"]),
                site=str(data["site"]),
                try_number=int(data.get("try_number", 1)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"not a site job identity (needs job, run_id, round, site and try_number): {str(data)[:200]} ({exc})"
            ) from None

    def site_job(self, shutdown_timeout: float = 10.0) -> SiteJob:
        """A :class:`SiteJob` that carries only this identity (what a handle found by identity knows)."""
        return SiteJob(self.job, self.run_id, self.round, self.site, argv=(), shutdown_timeout=shutdown_timeout)

    @property
    def label(self) -> str:
        return f"{self.job}/{self.site}/r{self.round}/t{self.try_number}"


LineSink = Callable[[str], None]


class JobHandleSpec(abc.ABC):
    """A launched site job."""

    @abc.abstractmethod
    def terminate(self) -> None:
        """Stop the job (graceful first, forced after the shutdown timeout) and release its resources."""

    @abc.abstractmethod
    def poll(self) -> JobReturnCode:
        """Return the job's return code now; ``UNKNOWN`` while it runs."""

    @abc.abstractmethod
    def wait(self, timeout: float | None = None) -> JobReturnCode:
        """Block until the job ends (or ``timeout`` seconds pass: then ``UNKNOWN``)."""

    @property
    @abc.abstractmethod
    def state(self) -> JobState:
        """The job's state in the common state set."""

    @property
    @abc.abstractmethod
    def reason(self) -> str:
        """Why the job ended the way it did (empty while running or on success)."""

    def logs(self) -> str:
        """The trainer's output so far, as the backend keeps it (empty where a backend streams it
        elsewhere: a process job's lines go to its task log as they come)."""
        return ""

    def where(self) -> dict[str, Any]:
        """What the backend calls this job (pod, SLURM job id, container), shown in XCom and logs;
        never needed to find it again (its :class:`JobIdentity` is)."""
        return {}


def wait_by_polling(
    poll: Callable[[], JobReturnCode], ended: Callable[[], bool], interval: float, timeout: float | None
) -> JobReturnCode:
    """:meth:`JobHandleSpec.wait` for a job that can only be polled (a pod, a SLURM job): ``poll()``
    every ``interval`` seconds until ``ended()``; ``UNKNOWN`` once ``timeout`` seconds have passed."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        rc = poll()
        if ended():
            return rc
        if deadline is not None and time.monotonic() >= deadline:
            return JobReturnCode.UNKNOWN
        pause = interval
        if deadline is not None:
            pause = min(pause, max(0.0, deadline - time.monotonic()))
        time.sleep(pause)


class JobLauncherSpec(abc.ABC):
    """Launches site jobs on one backend."""

    @abc.abstractmethod
    def launch_job(self, job_meta: SiteJob, fl_ctx: Mapping[str, Any] | None = None) -> JobHandleSpec:
        """Start the job described by ``job_meta`` and return its handle."""

    def find_job(self, identity: JobIdentity) -> JobHandleSpec | None:
        """The handle of the job launched earlier under ``identity`` (by any process), or ``None``
        when the backend has no such job (any more). Backends whose jobs cannot outlive the process
        that launched them raise ``NotImplementedError`` saying why."""
        raise NotImplementedError(f"{type(self).__name__} cannot find a site job by its identity")

    def terminate_earlier_tries(self, identity: JobIdentity) -> list[str]:
        """End the jobs launched under ``identity``'s earlier tries (a try whose worker died left
        them running, unwatched) before this try launches its own; returns what was ended. Backends
        whose jobs end with their task have none to end."""
        return []

"""FLARE job statuses mapped onto the house's job states and NVFlare's return codes (one table).

FLARE's job statuses (``nvflare.apis.job_def.RunStatus``) are ``SUBMITTED``, ``DISPATCHED``,
``RUNNING`` and the end states ``FINISHED:<how>``. Only ``FINISHED:COMPLETED`` is success; every
other end state is a failure, and a status this table does not know is never treated as success
(docs/coming-from-nvflare.md prints this table).
"""

from __future__ import annotations

from dataclasses import dataclass

from flare_airflow.core.spec import JobReturnCode, JobState

COMPLETED = "FINISHED:COMPLETED"

# FLARE status -> (our state, return code, what it means)
STATUS_TABLE: dict[str, tuple[JobState, JobReturnCode, str]] = {
    "SUBMITTED": (JobState.STARTING, JobReturnCode.UNKNOWN, "in FLARE's job queue"),
    "DISPATCHED": (JobState.STARTING, JobReturnCode.UNKNOWN, "deployed to the server and clients, starting"),
    "RUNNING": (JobState.RUNNING, JobReturnCode.UNKNOWN, "running"),
    COMPLETED: (JobState.SUCCEEDED, JobReturnCode.SUCCESS, "completed"),
    "FINISHED:ABORTED": (JobState.TERMINATED, JobReturnCode.ABORTED, "aborted (by an admin, or by on_kill)"),
    "FINISHED:EXECUTION_EXCEPTION": (
        JobState.FAILED,
        JobReturnCode.EXECUTION_ERROR,
        "a component raised during the job",
    ),
    "FINISHED:ABNORMAL": (JobState.FAILED, JobReturnCode.EXCEPTION, "the job's processes ended abnormally"),
    "FINISHED:CANT_SCHEDULE": (
        JobState.FAILED,
        JobReturnCode.INFRASTRUCTURE_ERROR,
        "FLARE could not schedule it (sites or resources missing)",
    ),
}


@dataclass(frozen=True)
class FlareStatus:
    native: str
    state: JobState
    return_code: JobReturnCode
    meaning: str

    @property
    def done(self) -> bool:
        return self.state in (JobState.SUCCEEDED, JobState.FAILED, JobState.TERMINATED) or self.native.startswith(
            "FINISHED"
        )

    @property
    def succeeded(self) -> bool:
        return self.state is JobState.SUCCEEDED


def map_status(native: str) -> FlareStatus:
    """One FLARE job status in the house's terms; an unknown ``FINISHED:*`` is a failure, anything
    else unknown is still running (never success)."""
    if native in STATUS_TABLE:
        state, rc, meaning = STATUS_TABLE[native]
        return FlareStatus(native, state, rc, meaning)
    if native.startswith("FINISHED"):
        return FlareStatus(
            native, JobState.FAILED, JobReturnCode.UNKNOWN, "ended in a state flare-airflow does not know"
        )
    return FlareStatus(native, JobState.UNKNOWN, JobReturnCode.UNKNOWN, "not finished (a status not in the table)")

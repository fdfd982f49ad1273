"""The exit-code table: a trainer's exit status or signal to ``JobState`` / ``JobReturnCode``.

One table for every backend (``docs/state-mapping.md``): a process's exit, a pod's or a
container's trainer exit code and a SLURM job's ExitCode all map through :func:`map_exit`; each
backend maps only its own native states (Pending, PENDING, image pull errors) on top of it.
"""

from __future__ import annotations

import signal

from flare_airflow.core.spec import JobReturnCode, JobState

_PASSTHROUGH_CODES = {
    JobReturnCode.EXCEPTION,
    JobReturnCode.UNSAFE_COMPONENT,
    JobReturnCode.CONFIG_ERROR,
    JobReturnCode.INFRASTRUCTURE_ERROR,
}


def map_exit(code: int | None, *, terminated: bool) -> tuple[JobState, JobReturnCode, str]:
    """Map a process exit status to ``(state, return code, reason)``.

    =================================  ===========  ====================
    exit status                        state        return code
    =================================  ===========  ====================
    still running                      running      UNKNOWN
    0                                  succeeded    SUCCESS
    101 / 102 / 103 / 104              failed       same code
    any other code > 0                 failed       EXECUTION_ERROR
    any status after our terminate()   terminated   ABORTED
    signal, not ours (OOM kill, crash) failed       EXECUTION_ERROR
    =================================  ===========  ====================
    """
    if code is None:
        return JobState.RUNNING, JobReturnCode.UNKNOWN, ""
    if terminated:
        # We asked it to stop: whatever it exited with, it did not finish its work.
        how = _signal_name(-code) if code < 0 else f"exit code {code}"
        return JobState.TERMINATED, JobReturnCode.ABORTED, f"terminated ({how})"
    if code == 0:
        return JobState.SUCCEEDED, JobReturnCode.SUCCESS, ""
    if code < 0:
        name = _signal_name(-code)
        hint = " (possibly the out-of-memory killer)" if -code == signal.SIGKILL else ""
        return JobState.FAILED, JobReturnCode.EXECUTION_ERROR, f"killed by {name}{hint}"
    if code in _PASSTHROUGH_CODES:
        rc = JobReturnCode(code)
        return JobState.FAILED, rc, f"exit code {code} ({rc.name})"
    return JobState.FAILED, JobReturnCode.EXECUTION_ERROR, f"exit code {code}"


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"

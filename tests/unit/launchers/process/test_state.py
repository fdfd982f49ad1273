"""The exit-status table (flare_airflow.core.exit_codes.map_exit), with real exits."""

from __future__ import annotations

import signal

import pytest

from flare_airflow.core.exit_codes import map_exit
from flare_airflow.core.spec import JobState
from flare_airflow.launchers.process import ProcessLauncher
from tests.unit.launchers.process.jobs import PY, RC, site_job


@pytest.mark.parametrize(
    ("code", "terminated", "state", "rc", "reason"),
    [
        (None, False, JobState.RUNNING, RC.UNKNOWN, ""),
        (0, False, JobState.SUCCEEDED, RC.SUCCESS, ""),
        (1, False, JobState.FAILED, RC.EXECUTION_ERROR, "exit code 1"),
        (2, False, JobState.FAILED, RC.EXECUTION_ERROR, "exit code 2"),
        (9, False, JobState.FAILED, RC.EXECUTION_ERROR, "exit code 9"),  # exit 9 is not ABORTED
        (101, False, JobState.FAILED, RC.EXCEPTION, "exit code 101 (EXCEPTION)"),
        (102, False, JobState.FAILED, RC.UNSAFE_COMPONENT, "exit code 102 (UNSAFE_COMPONENT)"),
        (103, False, JobState.FAILED, RC.CONFIG_ERROR, "exit code 103 (CONFIG_ERROR)"),
        (104, False, JobState.FAILED, RC.INFRASTRUCTURE_ERROR, "exit code 104 (INFRASTRUCTURE_ERROR)"),
        (127, False, JobState.FAILED, RC.EXECUTION_ERROR, "exit code 127"),  # never UNKNOWN ("running")
        (255, False, JobState.FAILED, RC.EXECUTION_ERROR, "exit code 255"),
        (-signal.SIGTERM, True, JobState.TERMINATED, RC.ABORTED, "terminated (SIGTERM)"),
        (-signal.SIGKILL, True, JobState.TERMINATED, RC.ABORTED, "terminated (SIGKILL)"),
        (3, True, JobState.TERMINATED, RC.ABORTED, "terminated (exit code 3)"),
        (0, True, JobState.TERMINATED, RC.ABORTED, "terminated (exit code 0)"),  # stopped early: not a success
        (
            -signal.SIGKILL,
            False,
            JobState.FAILED,
            RC.EXECUTION_ERROR,
            "killed by SIGKILL (possibly the out-of-memory killer)",
        ),
        (-signal.SIGSEGV, False, JobState.FAILED, RC.EXECUTION_ERROR, "killed by SIGSEGV"),
        (-signal.SIGTERM, False, JobState.FAILED, RC.EXECUTION_ERROR, "killed by SIGTERM"),
        (-200, False, JobState.FAILED, RC.EXECUTION_ERROR, "killed by signal 200"),
    ],
)
def test_map_exit(code, terminated, state, rc, reason) -> None:
    assert map_exit(code, terminated=terminated) == (state, rc, reason)


@pytest.mark.parametrize(
    ("code", "rc"), [(0, RC.SUCCESS), (1, RC.EXECUTION_ERROR), (103, RC.CONFIG_ERROR), (127, RC.EXECUTION_ERROR)]
)
def test_real_exit_codes(code, rc, lines) -> None:
    handle = ProcessLauncher(sink=lines).launch_job(site_job([PY, "-c", f"import sys; sys.exit({code})"]))
    assert handle.wait(timeout=30) is rc
    assert handle.poll() is rc
    assert handle.state is (JobState.SUCCEEDED if code == 0 else JobState.FAILED)
    assert handle.reason == ("" if code == 0 else map_exit(code, terminated=False)[2])


def test_a_trainer_killed_by_a_signal_it_did_not_get_from_us(lines) -> None:
    code = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    handle = ProcessLauncher(sink=lines).launch_job(site_job([PY, "-c", code]))
    assert handle.wait(timeout=30) is RC.EXECUTION_ERROR
    assert handle.state is JobState.FAILED
    assert handle.reason == "killed by SIGKILL (possibly the out-of-memory killer)"

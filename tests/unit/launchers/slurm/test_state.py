"""The SLURM state table (map_job): every state, pending reasons and timeouts, never a silent success."""

from __future__ import annotations

import pytest

from flare_airflow.core.spec import JobReturnCode, JobState
from flare_airflow.launchers.slurm import map_job, waits_its_turn


@pytest.mark.parametrize(
    ("state", "exit_code", "expected", "rc"),
    [
        ("COMPLETED", "0:0", JobState.SUCCEEDED, JobReturnCode.SUCCESS),
        ("FAILED", "3:0", JobState.FAILED, JobReturnCode.EXECUTION_ERROR),
        ("FAILED", "101:0", JobState.FAILED, JobReturnCode.EXCEPTION),
        ("FAILED", "104:0", JobState.FAILED, JobReturnCode.INFRASTRUCTURE_ERROR),
        ("FAILED", "0:9", JobState.FAILED, JobReturnCode.EXECUTION_ERROR),
        ("COMPLETED", "0:15", JobState.FAILED, JobReturnCode.EXECUTION_ERROR),
        ("CANCELLED", "0:15", JobState.TERMINATED, JobReturnCode.ABORTED),
        ("CANCELLED+", "0:0", JobState.TERMINATED, JobReturnCode.ABORTED),
        ("TIMEOUT", "0:0", JobState.FAILED, JobReturnCode.EXECUTION_ERROR),
        ("OUT_OF_MEMORY", "0:125", JobState.FAILED, JobReturnCode.EXECUTION_ERROR),
        ("NODE_FAIL", "0:0", JobState.FAILED, JobReturnCode.INFRASTRUCTURE_ERROR),
        ("BOOT_FAIL", "0:0", JobState.FAILED, JobReturnCode.INFRASTRUCTURE_ERROR),
        ("PREEMPTED", "0:0", JobState.FAILED, JobReturnCode.INFRASTRUCTURE_ERROR),
        ("DEADLINE", "0:0", JobState.FAILED, JobReturnCode.EXECUTION_ERROR),
        ("SOMETHING_NEW", "0:0", JobState.FAILED, JobReturnCode.INFRASTRUCTURE_ERROR),
        ("", "0:0", JobState.FAILED, JobReturnCode.INFRASTRUCTURE_ERROR),
    ],
)
def test_final_states(state: str, exit_code: str, expected: JobState, rc: JobReturnCode) -> None:
    status = map_job(state, "None", exit_code)
    assert (status.state, status.return_code, status.done) == (expected, rc, True)
    assert status.reason or expected is JobState.SUCCEEDED


@pytest.mark.parametrize("state", ["RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "CONFIGURING", "PENDING"])
def test_states_that_keep_watching(state: str) -> None:
    status = map_job(state, "Resources")
    assert not status.done
    assert status.return_code is JobReturnCode.UNKNOWN
    assert status.state in (JobState.RUNNING, JobState.STARTING)


def test_exit_code_and_reason_are_in_the_words() -> None:
    assert "exit code 3" in map_job("FAILED", "NonZeroExitCode", "3:0").reason
    assert "SIGKILL" in map_job("FAILED", "", "0:9").reason
    assert "time limit" in map_job("TIMEOUT").reason
    assert "out of memory" in map_job("OUT_OF_MEMORY").reason
    assert map_job("PENDING", "Resources").native == "PENDING (Resources)"


def test_cancelled_says_by_whom() -> None:
    assert "by flare-airflow" in map_job("CANCELLED", cancelled_by_us=True).reason
    assert "outside flare-airflow" in map_job("CANCELLED").reason


def test_a_job_nobody_remembers_is_not_a_success() -> None:
    status = map_job(None)
    assert (status.state, status.return_code, status.done) == (
        JobState.FAILED,
        JobReturnCode.INFRASTRUCTURE_ERROR,
        True,
    )
    assert "MinJobAge" in status.reason


@pytest.mark.parametrize("reason", ["Resources", "Priority", "None", "Dependency", "QOSGrpGRES", "AssocGrpCpuLimit"])
def test_waiting_its_turn_gets_pending_timeout(reason: str) -> None:
    assert waits_its_turn(reason)
    assert not map_job("PENDING", reason, pending_seconds=200, pending_timeout=300, startup_timeout=100).done
    late = map_job("PENDING", reason, pending_seconds=301, pending_timeout=300, startup_timeout=100)
    assert late.done and late.return_code is JobReturnCode.INFRASTRUCTURE_ERROR
    assert "pending_timeout=300s" in late.reason and late.waiting_for_resources


@pytest.mark.parametrize(
    "reason",
    ["PartitionConfig", "ReqNodeNotAvail", "PartitionTimeLimit", "InvalidAccount", "QOSMaxGRESPerJob", "JobHeldAdmin"],
)
def test_reasons_waiting_does_not_fix_get_startup_timeout(reason: str) -> None:
    assert not waits_its_turn(reason)
    assert not map_job("PENDING", reason, pending_seconds=50, pending_timeout=300, startup_timeout=100).done
    late = map_job("PENDING", reason, pending_seconds=101, pending_timeout=300, startup_timeout=100)
    assert late.done and late.return_code is JobReturnCode.CONFIG_ERROR
    assert f"PENDING ({reason})" in late.reason and "startup_timeout=100s" in late.reason

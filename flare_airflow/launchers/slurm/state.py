"""The SLURM backend's state table: a batch job's JobState / Reason / ExitCode to ``JobState`` /
``JobReturnCode`` (``docs/state-mapping.md``).

State comes from ``scontrol -o show job`` while slurmctld remembers the job (``MinJobAge``, 300 s
by default, after it ends), then from ``sacct`` where accounting exists; a job known to neither
is never a success. While PENDING, the reason decides how long waiting is reasonable: a job
waiting its turn (Resources, Priority, limits that free up as other jobs end) gets
``pending_timeout``; a job that waiting does not help (PartitionConfig, ReqNodeNotAvail,
InvalidAccount, a per-job limit, a held job, ...) gets ``startup_timeout``.
"""

from __future__ import annotations

from flare_airflow.core.exit_codes import map_exit
from flare_airflow.core.spec import JobReturnCode, JobState, JobStatus

# Reasons of a job that waits its turn: other jobs must end first.
WAITING_REASONS = frozenset(
    {"None", "Resources", "Priority", "BeginTime", "Dependency", "Licenses", "JobArrayTaskLimit", "Reservation"}
)
# Limits that free up when the account's / QOS's other jobs end (not the *PerJob ones: never).
_WAITING_LIMIT_PREFIXES = ("AssocGrp", "AssocMax", "QOSGrp", "QOSMax", "MaxJobs", "MaxCpu", "MaxGRES", "MaxNode")

_RUNNING = frozenset(
    {"RUNNING", "COMPLETING", "SUSPENDED", "STOPPED", "RESIZING", "SIGNALING", "STAGE_OUT", "REQUEUED", "REQUEUE_FED"}
)
_STARTING = frozenset({"PENDING", "CONFIGURING", "REQUEUE_HOLD", "RESV_DEL_HOLD"})
# Terminal states other than COMPLETED / FAILED / CANCELLED: (return code, what happened).
_ENDED: dict[str, tuple[JobReturnCode, str]] = {
    "TIMEOUT": (JobReturnCode.EXECUTION_ERROR, "the job reached its time limit (launcher_spec.slurm.time_limit)"),
    "OUT_OF_MEMORY": (
        JobReturnCode.EXECUTION_ERROR,
        "the job ran out of memory (raise resource_spec.memory, the job's --mem)",
    ),
    "NODE_FAIL": (JobReturnCode.INFRASTRUCTURE_ERROR, "a node of the job failed"),
    "BOOT_FAIL": (JobReturnCode.INFRASTRUCTURE_ERROR, "a node of the job failed to boot"),
    "PREEMPTED": (JobReturnCode.INFRASTRUCTURE_ERROR, "the job was preempted by another job"),
    "DEADLINE": (JobReturnCode.EXECUTION_ERROR, "the job reached its deadline"),
    "REVOKED": (JobReturnCode.INFRASTRUCTURE_ERROR, "the job was revoked (it runs on another cluster)"),
    "SPECIAL_EXIT": (JobReturnCode.EXECUTION_ERROR, "the job ended in SPECIAL_EXIT"),
}


def waits_its_turn(reason: str) -> bool:
    """Whether a PENDING job with this reason gets ``pending_timeout`` (else ``startup_timeout``)."""
    if reason in WAITING_REASONS:
        return True
    return reason.startswith(_WAITING_LIMIT_PREFIXES) and "PerJob" not in reason


def parse_exit_code(text: str) -> tuple[int, int]:
    """SLURM's ``ExitCode=<code>:<signal>`` as ``(code, signal)``; unreadable parts are 0."""
    code, _, sig = text.partition(":")
    return (int(code) if code.isdigit() else 0, int(sig) if sig.isdigit() else 0)


def map_job(
    job_state: str | None,
    reason: str = "",
    exit_code: str = "0:0",
    *,
    pending_seconds: float = 0.0,
    pending_timeout: float = 300.0,
    startup_timeout: float = 120.0,
    cancelled_by_us: bool = False,
) -> JobStatus:
    """Map one read of a batch job to ``JobStatus``.

    ``job_state`` ``None``: the job is known neither to slurmctld nor to accounting.
    ``pending_seconds``: how long the job has been waiting since it was submitted.

    ====================================  ==========  ====================  ==============================
    SLURM                                 state       return code           done
    ====================================  ==========  ====================  ==============================
    PENDING (Resources, Priority, ...)    starting    UNKNOWN               > pending_timeout: failed, 104
    PENDING (any other reason)            starting    UNKNOWN               > startup_timeout: failed, 103
    CONFIGURING, REQUEUE_HOLD             starting    UNKNOWN               no
    RUNNING, COMPLETING, SUSPENDED, ...   running     UNKNOWN               no
    COMPLETED (ExitCode 0:0)              succeeded   SUCCESS               yes
    FAILED, ExitCode n:0                  failed      as a process exit n   yes
    FAILED, ExitCode 0:s (signal)         failed      EXECUTION_ERROR       yes
    CANCELLED                             terminated  ABORTED               yes
    TIMEOUT, OUT_OF_MEMORY, DEADLINE      failed      EXECUTION_ERROR       yes
    NODE_FAIL, BOOT_FAIL, PREEMPTED       failed      INFRASTRUCTURE_ERROR  yes
    unknown to slurmctld and sacct        failed      INFRASTRUCTURE_ERROR  yes
    any other state                       failed      INFRASTRUCTURE_ERROR  yes
    ====================================  ==========  ====================  ==============================
    """
    if job_state is None:
        return JobStatus(
            JobState.FAILED,
            JobReturnCode.INFRASTRUCTURE_ERROR,
            "the job is no longer known to slurmctld (it forgets finished jobs after MinJobAge) and no accounting "
            "(sacct) has it: its outcome is unknown",
            done=True,
        )
    state = job_state.split()[0].rstrip("+") if job_state.strip() else ""
    native = f"{state} ({reason})" if reason and reason != "None" else state
    if state in _STARTING:
        if state != "PENDING":
            return JobStatus(JobState.STARTING, JobReturnCode.UNKNOWN, "", done=False, native=native)
        turn = waits_its_turn(reason)
        limit, what = (pending_timeout, "pending_timeout") if turn else (startup_timeout, "startup_timeout")
        if pending_seconds > limit:
            rc = JobReturnCode.INFRASTRUCTURE_ERROR if turn else JobReturnCode.CONFIG_ERROR
            why = (
                "waiting for its turn"
                if turn
                else "a reason waiting does not fix (check partition, account, qos and the resources asked for)"
            )
            return JobStatus(
                JobState.FAILED,
                rc,
                f"the job stayed PENDING ({reason}) for more than {what}={limit:g}s, {why}",
                done=True,
                waiting_for_resources=turn,
                native=native,
            )
        return JobStatus(
            JobState.STARTING, JobReturnCode.UNKNOWN, "", done=False, waiting_for_resources=turn, native=native
        )
    if state in _RUNNING:
        return JobStatus(JobState.RUNNING, JobReturnCode.UNKNOWN, "", done=False, native=native)
    code, sig = parse_exit_code(exit_code)
    if state == "COMPLETED" and code == 0 and sig == 0:
        return JobStatus(JobState.SUCCEEDED, JobReturnCode.SUCCESS, "", done=True, native=native)
    if state == "CANCELLED":
        who = "by flare-airflow (scancel)" if cancelled_by_us else "outside flare-airflow (scancel by a user or admin)"
        return JobStatus(
            JobState.TERMINATED, JobReturnCode.ABORTED, f"the job was cancelled {who}", True, native=native
        )
    if state in ("FAILED", "COMPLETED"):
        _, rc, why = map_exit(-sig if sig and not code else code, terminated=False)
        return JobStatus(JobState.FAILED, rc, f"the job failed: {why}", done=True, native=native)
    if state in _ENDED:
        rc, why = _ENDED[state]
        return JobStatus(JobState.FAILED, rc, f"{why} [{state}]", done=True, native=native)
    return JobStatus(
        JobState.FAILED,
        JobReturnCode.INFRASTRUCTURE_ERROR,
        f"unknown SLURM job state {job_state!r}: not counted as a success",
        done=True,
        native=native,
    )

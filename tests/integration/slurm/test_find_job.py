"""A SLURM site job found again by its identity (job, run, round, site, try): by name through
``squeue`` while slurmctld remembers it, then through the job completion log (real daemons)."""

from __future__ import annotations

import dataclasses
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path

from flare_airflow.core.config import ResourceSpec, SlurmLaunchSpec
from flare_airflow.core.spec import JobIdentity, JobReturnCode, JobState, SiteJob
from flare_airflow.launchers.slurm import CommandResult, LocalCommands, SlurmLauncher, find_jobs, job_name
from flare_airflow.launchers.slurm.commands import COMMAND_TIMEOUT
from flare_airflow_testing.slurm.cluster import SlurmCluster
from tests.integration.slurm.test_slurm_launcher import commands
from tests.integration.slurm.test_slurm_launcher import site_job as launcher_site_job

# A run of this module's own: the session's SLURM cluster remembers other modules' jobs (slurmctld
# for MinJobAge, the completion log for ever), and test_slurm_launcher.py submits many jobs of
# (demo, manual__t, round 1, site-1, try 1) -- which "another try is not found" would find when the
# pytest workers run that module first.
RUN = f"manual__find-{uuid.uuid4().hex[:8]}"


def site_job(argv: list[str], round_num: int = 1) -> SiteJob:
    return dataclasses.replace(launcher_site_job(argv, round_num=round_num), run_id=RUN)


def launcher(slurm: SlurmCluster, tmp_path: Path, try_number: int = 1, lines: list[str] | None = None) -> SlurmLauncher:
    return SlurmLauncher(
        SlurmLaunchSpec(output_dir=str(tmp_path / "out"), poll_interval=0.3),
        ResourceSpec(),
        commands=commands(slurm),
        try_number=try_number,
        sink=None if lines is None else lines.append,
    )


class MockForgetfulSlurmctld(LocalCommands):
    """MOCK (named as such): slurmctld forgets a finished job after MinJobAge (300 s in the test
    cluster, too long to wait for). This answers ``squeue`` and ``scontrol show job`` as slurmctld
    does for a forgotten job; every other command (``sacct -c`` reading the real job completion
    log) runs for real."""

    def run(self, argv: Sequence[str], stdin: str | None = None, timeout: float = COMMAND_TIMEOUT) -> CommandResult:
        if argv[0] == "squeue":
            return CommandResult(0, "", "")
        if list(argv[:3]) == ["scontrol", "-o", "show"]:
            return CommandResult(1, "", "slurm_load_jobs error: Invalid job id specified\n")
        return super().run(argv, stdin, timeout)


def test_a_job_is_found_by_its_identity_running_and_finished(slurm: SlurmCluster, tmp_path: Path) -> None:
    release = tmp_path / "release"
    script = "import os, sys, time\nwhile not os.path.exists(sys.argv[1]): time.sleep(0.1)\nprint('done')"
    submitted = launcher(slurm, tmp_path, try_number=2).launch_job(
        site_job([sys.executable, "-c", script, str(release)])
    )
    identity = JobIdentity("demo", RUN, 1, "site-1", 2)

    lines: list[str] = []
    other = launcher(slurm, tmp_path, lines=lines)  # another process: it knows only the identity
    found = other.find_job(identity)
    assert found is not None and found.job_id == submitted.job_id
    assert found.submitted.output == submitted.submitted.output
    assert abs(found.submitted.submitted_at - submitted.submitted.submitted_at) < 5
    assert other.find_job(JobIdentity("demo", RUN, 1, "site-1", 1)) is None, "another try"
    assert other.find_job(JobIdentity("demo", RUN, 2, "site-1", 2)) is None, "another round"
    assert found.poll() is JobReturnCode.UNKNOWN

    release.touch()
    assert found.wait(60) is JobReturnCode.SUCCESS, found.reason
    assert lines == ["[site-1 r1] done"]
    again = other.find_job(identity)
    assert again is not None and again.poll() is JobReturnCode.SUCCESS, "a finished job is found with its result"
    assert submitted.wait(10) is JobReturnCode.SUCCESS


def test_a_failed_job_is_found_in_the_completion_log_once_slurmctld_forgot_it(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    argv = [sys.executable, "-c", "import sys; print('bad input'); sys.exit(103)"]
    handle = launcher(slurm, tmp_path).launch_job(site_job(argv, round_num=7))
    assert handle.wait(60) is JobReturnCode.CONFIG_ERROR
    identity = JobIdentity("demo", RUN, 7, "site-1", 1)

    forgetful = MockForgetfulSlurmctld(commands(slurm).env)
    jobs = find_jobs(forgetful, job_name("demo", RUN, 7, "site-1", 1))
    assert [(j.job_id, j.state) for j in jobs] == [(handle.job_id, "FAILED")]
    found = SlurmLauncher(SlurmLaunchSpec(output_dir=str(tmp_path / "out")), commands=forgetful).find_job(identity)
    assert found is not None and found.job_id == handle.job_id
    assert found.poll() is JobReturnCode.CONFIG_ERROR
    assert found.state is JobState.FAILED
    assert "exit code 103" in found.reason and "bad input" in found.reason, found.reason

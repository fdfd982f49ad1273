"""The SLURM site task's clean-up paths against the real daemons: a later try cancels the jobs of
earlier tries (a killed worker's job), and the run's teardown cancels whatever the run left."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from flare_airflow.core.config import SlurmLaunchSpec
from flare_airflow.core.spec import SiteJob
from flare_airflow.launchers.slurm import LocalCommands, SlurmLauncher
from flare_airflow.operators.slurm import SiteSlurmOperator, SweepSlurmJobsOperator
from flare_airflow.site_task.spec import SiteRun
from flare_airflow_testing.slurm.cluster import SlurmCluster
from tests.unit.airflow_layer import make_job

RUN_ID = "manual__drill"


@pytest.fixture
def commands(slurm: SlurmCluster, monkeypatch: pytest.MonkeyPatch) -> LocalCommands:
    for name, value in slurm.env.items():
        monkeypatch.setenv(name, value)  # the operator makes its own LocalCommands from the environment
    return LocalCommands({**os.environ, **slurm.env})


def orphan(commands: LocalCommands, tmp_path: Path, site: str, round_num: int, try_number: int) -> str:
    """A job as a killed worker's try left it: submitted, running, nobody watching."""
    job = SiteJob("unit", RUN_ID, round_num, site, (sys.executable, "-c", "import time; time.sleep(300)"))
    launcher = SlurmLauncher(
        SlurmLaunchSpec(output_dir=str(tmp_path / "out")), commands=commands, try_number=try_number
    )
    return launcher.submit(job).job_id


def queued_after_gone(slurm: SlurmCluster, job_ids: list[str], timeout: float = 10.0) -> list[str]:
    """The queued job ids once ``job_ids`` left the queue (cancelled jobs stay listed up to KillWait)."""
    deadline = time.monotonic() + timeout
    while True:
        ids = [line.split()[0] for line in slurm.jobs()]
        if not set(job_ids) & set(ids) or time.monotonic() > deadline:
            return ids
        time.sleep(0.2)


def slurm_job(tmp_path: Path):
    block = {"launcher": "slurm", "launcher_spec": {"slurm": {"output_dir": str(tmp_path / "out")}}}
    return make_job(tmp_path, sites={"site-1": block, "site-2": block, "site-3": {}})


def test_a_later_try_cancels_the_jobs_of_earlier_tries(
    slurm: SlurmCluster, commands: LocalCommands, tmp_path: Path
) -> None:
    job = slurm_job(tmp_path)
    first = orphan(commands, tmp_path, "site-1", 1, 1)
    other_site = orphan(commands, tmp_path, "site-2", 1, 1)
    op = SiteSlurmOperator(task_id="site-1", job=job, site="site-1", round_num=1)
    run = SiteRun(
        job="unit",
        run_id=RUN_ID,
        round=1,
        total_rounds=2,
        site="site-1",
        task="train",
        argv=[],
        global_model="",
        output="",
    )
    assert op.cancel_earlier_tries(commands, run, try_number=1) == []  # the first try has no earlier one
    assert op.cancel_earlier_tries(commands, run, try_number=2) == [first]
    ids = queued_after_gone(slurm, [first])
    assert first not in ids and other_site in ids  # another site's job is not this site job's
    slurm.run("scancel", other_site)


def test_the_teardown_cancels_every_job_of_the_run_and_nothing_else(
    slurm: SlurmCluster, commands: LocalCommands, tmp_path: Path
) -> None:
    job = slurm_job(tmp_path)
    ours = [orphan(commands, tmp_path, "site-1", 2, 1), orphan(commands, tmp_path, "site-2", 1, 3)]
    unrelated = SlurmLauncher(SlurmLaunchSpec(output_dir=str(tmp_path / "out")), commands=commands).submit(
        SiteJob("unit", "manual__other", 1, "site-1", ("sleep", "300"))
    )
    sweep = SweepSlurmJobsOperator(task_id="sweep_slurm_jobs", job=job)
    cancelled = sweep.sweep_site_jobs({"run_id": RUN_ID})  # type: ignore[arg-type]
    assert sorted(item.split(":")[1].split()[0] for item in cancelled) == sorted(ours)
    assert queued_after_gone(slurm, ours) == [unrelated.job_id]
    slurm.run("scancel", unrelated.job_id)

"""The batch script and sbatch command line: built from an argv, every user string quoted."""

from __future__ import annotations

import shlex
import subprocess

import pytest

from flare_airflow.core.config import ResourceSpec, SlurmLaunchSpec
from flare_airflow.core.spec import SiteJob
from flare_airflow.launchers.slurm import (
    batch_script,
    job_name,
    output_file,
    parse_job_id,
    parse_show_job,
    sbatch_argv,
    site_job_prefix,
    try_of,
)

HOSTILE = ["$(touch /tmp/pwned)", "`id`", "; rm -rf /", "a'b", 'c"d', "line\nbreak", "$HOME", "*"]


def site_job(argv: list[str], **env: str) -> SiteJob:
    return SiteJob(job="demo", run_id="manual__1", round=2, site="site-1", argv=tuple(argv), env=env)


def run_script(text: str, tmp_path) -> str:
    # Replace the trainer's exec by printing the argv bash would run, one word per line.
    path = tmp_path / "job.sh"
    path.write_text(text.replace("\nexec ", "\nprintf '%s\\0' ", 1))
    return subprocess.run(["bash", str(path)], capture_output=True, text=True, check=True).stdout


def test_the_script_runs_the_exact_argv(tmp_path) -> None:
    argv = ["python3", "train.py", *HOSTILE]
    script = batch_script(site_job(argv, FLARE_SITE="site-1", NOTE="$(id) `id`"), SlurmLaunchSpec())
    assert run_script(script, tmp_path).split("\0")[:-1] == argv
    assert not (tmp_path / "pwned").exists()
    assert "#SBATCH" not in script


def test_environment_values_are_quoted(tmp_path) -> None:
    env = {"A": "$(touch /tmp/pwned)", "B": "x'y", "C": "two words"}
    script = batch_script(site_job(["env"]), SlurmLaunchSpec(), env)
    path = tmp_path / "env.sh"
    path.write_text(script.replace("\nexec env", '\nprintf \'%s\\0\' "$A" "$B" "$C"'))
    out = subprocess.run(["bash", str(path)], capture_output=True, text=True, check=True).stdout
    assert out.split("\0")[:-1] == [env["A"], env["B"], env["C"]]


def test_several_tasks_run_through_srun_with_the_rank_wrapper() -> None:
    script = batch_script(site_job(["python3", "t.py", "; id"]), SlurmLaunchSpec(nodes=2, tasks_per_node=2))
    last = script.strip().splitlines()[-1]
    assert last.startswith("exec srun --kill-on-bad-exit=1 --ntasks-per-node=2 bash -c ")
    assert shlex.split(last)[-4:] == ["flare-rank", "python3", "t.py", "; id"]
    assert "export LOCAL_WORLD_SIZE=2" in script
    assert "MASTER_PORT=$(( 20000 + SLURM_JOB_ID % 20000 ))" in script
    assert "export MASTER_PORT=29400" in batch_script(site_job(["x"]), SlurmLaunchSpec(nodes=2, master_port=29400))


def test_sbatch_argv_from_spec_and_resources() -> None:
    spec = SlurmLaunchSpec(
        partition="gpu",
        account="lab",
        qos="high",
        time_limit="01:00:00",
        nodes=2,
        cwd="/scratch/fl",
        extra_sbatch_options=["--constraint=a100", "--exclusive"],
    )
    argv = sbatch_argv(spec, ResourceSpec(num_of_gpus=2, num_of_cpus=3.5, memory="4Gi"), name="n", output="/o/n.out")
    assert argv == [
        "sbatch",
        "--parsable",
        "--job-name=n",
        "--output=/o/n.out",
        "--nodes=2",
        "--ntasks-per-node=1",
        "--chdir=/scratch/fl",
        "--partition=gpu",
        "--account=lab",
        "--qos=high",
        "--time=01:00:00",
        "--gres=gpu:2",
        "--cpus-per-task=4",
        "--mem=4096M",
        "--constraint=a100",
        "--exclusive",
    ]


def test_names_share_a_prefix_per_site_job() -> None:
    prefix = site_job_prefix("demo", "manual__1", 2, "site-1")
    assert job_name("demo", "manual__1", 2, "site-1", 3) == prefix + "t3"
    assert prefix.startswith("fl-demo-site-1-r2-")
    assert try_of(prefix + "t3", prefix) == 3
    assert try_of(prefix + "t3x", prefix) is None
    assert try_of(site_job_prefix("demo", "manual__2", 2, "site-1") + "t1", prefix) is None
    assert site_job_prefix("demo", "manual__1", 2, "site-1") != site_job_prefix("demo", "manual__1", 2, "site-2")
    assert output_file("/o/", "n") == "/o/n.out"
    with pytest.raises(ValueError):
        job_name("demo", "r", 1, "s", -1)


def test_parsers() -> None:
    assert parse_job_id("123\n") == "123"
    assert parse_job_id("123;cluster\n") == "123"
    assert parse_job_id("error\n") == ""
    fields = parse_show_job("JobId=5 JobName=a b JobState=PENDING Reason=Resources Dependency=(null) ExitCode=0:0")
    assert fields["JobName"] == "a b"
    assert (fields["JobState"], fields["Reason"], fields["ExitCode"]) == ("PENDING", "Resources", "0:0")
